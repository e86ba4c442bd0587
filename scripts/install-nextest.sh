#!/usr/bin/env bash
# Installs cargo-nextest, the suite's test runner (scripts/test.sh, .config/nextest.toml), from
# crates.io when it is missing or older than the configuration needs. Idempotent: with a recent
# enough `cargo nextest` on the PATH it does nothing.
#
# Installing builds it from source with `cargo install --locked` (a few minutes on 2 cores, once
# per machine, into ~/.cargo/bin).
set -euo pipefail
want=0.9.143 # installed when needed (crates.io)
need=0.9.91  # the oldest that reads .config/nextest.toml (test priorities)

# "0.9.143" -> 9143-style comparable number: major*1e6 + minor*1e3 + patch.
num() { echo "$1" | awk -F. '{ printf "%d\n", $1 * 1000000 + $2 * 1000 + $3 }'; }

have="$(cargo nextest --version 2>/dev/null | awk '/^cargo-nextest /{ print $2; exit }' || true)"
if [ -n "$have" ] && [ "$(num "$have")" -ge "$(num "$need")" ]; then
  exit 0
fi
echo "installing cargo-nextest $want from crates.io (${have:+found $have, older than $need; }once per machine)" >&2
cargo install --locked --quiet cargo-nextest --version "$want"
