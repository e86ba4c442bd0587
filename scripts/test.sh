#!/usr/bin/env bash
# The whole test suite: what CI runs (.ci/run) and what README.md tells a fresh machine to run.
#
# 1. The Rust tests of every crate: every test binary runs even when one fails
#    (--no-fail-fast), and the failed tests are listed at the end.
# 2. On a CPU with AVX-512, the crates whose hot loops dispatch on the SIMD level (shared,
#    kernels, server) once more with XDISTILL_SIMD=avx2: the AVX2 paths an AVX2-only CPU runs.
#    On an AVX2-only CPU, the same crates once more at XDISTILL_SIMD=baseline.
# 3. The Python client's tests (scripts/python-tests.sh).
# Arguments go to every `cargo test` (e.g. `scripts/test.sh -- --nocapture`).
set -uo pipefail
cd "$(dirname "$0")/.."
XDISTILL_TOKENIZERS="$(scripts/get-tokenizers.sh)" || exit 1
export XDISTILL_TOKENIZERS
# The load balancer of the replicas tests, from Debian's packages (skipped without root,
# except under CI=true).
scripts/install-haproxy.sh || exit 1

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
failed=()

# Runs `cargo test ARGS…` under a label, its output to the terminal and a log; records failures.
run_cargo_tests() {
  local label="$1"; shift
  echo "=== $label" >&2
  local log="$logs/$(echo "$label" | tr -c 'A-Za-z0-9' _).log"
  if ! cargo test "$@" 2>&1 | tee "$log"; then
    local names
    # libtest prints each failed test as `    name` under a `failures:` heading (twice: once
    # with its output, once as a list); `error: test failed, to rerun pass …` names the binary.
    names="$(grep -E '^error: test failed, to rerun pass' "$log" | sed -E 's/^error: test failed, to rerun pass //' || true)"
    failed+=("$label: ${names:-cargo test failed before running tests (see above)}")
    local tests
    tests="$(awk '/^failures:$/{f++; next} f==2 && /^    [^ ]/{print} /^test result:/{f=0}' "$log" | sort -u)"
    [ -n "$tests" ] && failed+=("$(echo "$tests" | sed 's/^ */    /')")
  fi
}

run_cargo_tests "cargo test --workspace" --workspace --locked --no-fail-fast ${1+"$@"}

simd="$(grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx2 || echo baseline)"
XDISTILL_SIMD="$simd" run_cargo_tests "XDISTILL_SIMD=$simd: shared, kernels, server" \
  --locked --no-fail-fast -p xdistill-shared -p xdistill-kernels -p xdistill-server ${1+"$@"}

echo "=== python client" >&2
# The binaries `cargo test --workspace` built (a `cargo build` of two packages alone would
# resolve features differently and rebuild the dependencies).
export XDISTILL_BIN_DIR="$PWD/target/debug"
scripts/python-tests.sh -rs || failed+=("python client: scripts/python-tests.sh failed (see above)")

skipped="$(cat "$logs"/*.log 2>/dev/null | grep -E '^SKIPPED ' | sort -u || true)"
if [ -n "$skipped" ]; then
  echo >&2
  echo "Skipped (Rust):" >&2
  echo "$skipped" | sed 's/^/  /' >&2
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo >&2
  echo "FAILED:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all test stages passed" >&2
