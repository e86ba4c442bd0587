#!/usr/bin/env bash
# The checks a change passes before it is committed, beside the test suite (scripts/test.sh,
# which CI runs and which does not run these: they would build every dependency a second time,
# in check mode): formatting, clippy with warnings as errors over every target, and the API
# documentation with warnings as errors (broken or private intra-doc links). Each step runs even
# when one before it fails; the exit status says whether all passed.
set -uo pipefail
cd "$(dirname "$0")/.."

failed=()
step() {
  local label="$1"; shift
  echo "=== $label" >&2
  "$@" || failed+=("$label")
}

step "cargo fmt" cargo fmt --all --check
step "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTDOCFLAGS="${RUSTDOCFLAGS:-} -D warnings" step "cargo doc" \
  cargo doc --workspace --no-deps --locked

if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all checks passed" >&2
