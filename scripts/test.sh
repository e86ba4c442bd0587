#!/usr/bin/env bash
# The whole test suite: what CI runs (.ci/run) and what README.md tells a fresh machine to run.
set -euo pipefail
cd "$(dirname "$0")/.."
XDISTILL_TOKENIZERS="$(scripts/get-tokenizers.sh)"
export XDISTILL_TOKENIZERS
# The load balancer of the replicas test (tests/tests/balancer.rs), from Debian's packages.
scripts/install-haproxy.sh
cargo test --workspace --locked "$@"
scripts/python-tests.sh
