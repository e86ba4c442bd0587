#!/usr/bin/env bash
# The whole test suite: what CI runs (.ci/run) and what README.md tells a fresh machine to run.
#
# Stages, each timed; at the end a table of them (and of every test binary) and the ten slowest
# tests (scripts/test-report.py):
# 1. tokenizers: the five real tokenizers the tests read (scripts/get-tokenizers.sh).
# 2. haproxy: the load balancer of the replicas tests (scripts/install-haproxy.sh).
# 3. cargo-nextest: the test runner, installed from crates.io when missing
#    (scripts/install-nextest.sh).
# 4. build: every crate's tests and the binaries they run (`cargo test --workspace --no-run`;
#    where its time went: target/cargo-timings/cargo-timing.html).
# 5. rust tests: every test of every crate, each in its own process, three at once per two
#    cores, the slowest first, a hung one killed after ten minutes (.config/nextest.toml);
#    every test runs even when one fails, and the failures are listed at the end.
# 6. simd pass: on a CPU with AVX-512, what depends on the SIMD level (the dispatched kernels of
#    shared, kernels and the server, and the tests that compare a teacher's numbers with a
#    reference) once more with XDISTILL_SIMD=avx2: the AVX2 paths an AVX2-only CPU runs. On an
#    AVX2-only CPU, the same at XDISTILL_SIMD=baseline. Same build, nextest profile `simd`.
# 7. python client: the Python client's tests (scripts/python-tests.sh; its venv is made beside
#    the build).
# Arguments go to both `cargo nextest run`s (e.g. `scripts/test.sh -E 'test(kl)' --no-capture`).
set -uo pipefail
cd "$(dirname "$0")/.."

# CI builds a clean clone once and throws it away: incremental state would never be reused, and
# writing it costs compile time. So do the workspace crates' line tables (dev profile: `debug =
# "line-tables-only"`), which only backtraces read: about 15 % of their code generation
# (xdistill-trainer's library 38-41 s -> 33 s); a failing assertion still names its file and
# line. (A developer's rerun keeps the dev profile as it is: incremental, with line tables.)
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=0; fi

# Threads in the test processes, where every core already runs a test and its teachers. candle
# splits an elementwise op over 64k elements across its CPU "barrier pool", whose threads spin
# 25,000 times before they sleep and whose caller spins until they are done: here that spinning
# only took the CPU from the other processes (3% of the Rust tests' samples, `perf record -a`).
# CANDLE_NUM_THREADS=1 runs those ops on the calling thread (matmuls keep their threads). And
# candle asks for its matmul thread count at every matmul, which without RAYON_NUM_THREADS means
# parsing /proc/cpuinfo (num_cpus' physical cores; 1% of the samples): set it to the count rayon
# takes anyway. On the 45 end-to-end tests (2 cores, 2026-12-01), runs side by side: 212.6 ->
# 195.8 s and 192.7 -> 179.4 s with the first, 176.4 s with both (user CPU 303 -> 255 s).
export CANDLE_NUM_THREADS="${CANDLE_NUM_THREADS:-1}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-$(nproc)}"

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
failed=()
stages="$logs/stages.tsv"

now() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s; fi; }
t_start="$(now)"

# Runs COMMAND… as stage LABEL: prints the label, times it, records it (and a failure).
stage() {
  local label="$1"; shift
  echo "=== $label" >&2
  local t0 t1 status=ok
  t0="$(now)"
  "$@" || status=failed
  t1="$(now)"
  printf '%s\t%s\t%s\n' "$label" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" \
    "$status" >> "$stages"
  [ "$status" = ok ]
}

tokenizers() {
  XDISTILL_TOKENIZERS="$(scripts/get-tokenizers.sh)" || return 1
  export XDISTILL_TOKENIZERS
}
stage tokenizers tokenizers || { echo "the tokenizers are needed by every stage" >&2; exit 1; }
# The load balancer of the replicas tests, from Debian's packages (skipped without root, except
# under CI=true).
stage haproxy scripts/install-haproxy.sh || exit 1
stage cargo-nextest scripts/install-nextest.sh || exit 1

# The Python client's venv (PyPI downloads, mostly waiting on the network) is made beside the
# build; the python stage below waits for it.
venv_log="$logs/venv.log"
stage "python venv (beside the build)" scripts/python-tests.sh --venv-only > "$venv_log" 2>&1 &
venv_pid=$!

# --timings: each crate's compile time, in target/cargo-timings/cargo-timing.html.
if stage build cargo test --workspace --locked --no-run --timings; then
  # `cargo nextest run --workspace` builds what the stage above built (the same packages and
  # features): nothing.
  # Three tests per two cores: an end-to-end test waits on its teachers' start-up and HTTP
  # between bursts of compute, and with one test per core the cores sat idle for 6 % of the run
  # (`perf record -a`). Runs alternated on one build (2 cores, 2026-12-01): 282.5 and 305.7 s
  # at one per core, 263.2 and 283.9 s at 3, 289.4 s at 4 (more CPU for the same work).
  # (Through nextest's environment variable, so that a `--test-threads` argument overrides it.)
  NEXTEST_TEST_THREADS="$(( $(nproc) * 3 / 2 ))" stage "rust tests" \
    cargo nextest run --workspace --locked --no-fail-fast ${1+"$@"} ||
    failed+=("rust tests: see the failures listed above")
  cp target/nextest/default/junit.xml "$logs/rust.xml" 2>/dev/null

  simd="$(grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx2 || echo baseline)"
  # Two tests per core: most of this pass waits on teacher processes (start-up, HTTP) more
  # than it computes, so a second test per core fills the idle time.
  XDISTILL_SIMD="$simd" NEXTEST_TEST_THREADS="$((2 * $(nproc)))" \
    stage "simd pass (XDISTILL_SIMD=$simd)" \
    cargo nextest run --workspace --locked --no-fail-fast --profile simd ${1+"$@"} ||
    failed+=("simd pass (XDISTILL_SIMD=$simd): see the failures listed above")
  cp target/nextest/simd/junit.xml "$logs/simd.xml" 2>/dev/null
else
  failed+=("build: cargo test --workspace --no-run failed (see above); no Rust test ran")
fi

# The binaries the build stage built (a `cargo build` of two packages alone would resolve
# features differently and rebuild the dependencies). Run after the SIMD pass, not beside it:
# side by side the two took as long as one after the other (143 s against 48 + 87 s on 2
# cores) and the extra load made two teachers' keep-alive races show.
export XDISTILL_BIN_DIR="$PWD/target/debug"
if ! wait "$venv_pid"; then
  cat "$venv_log" >&2
  echo "the Python client's venv could not be made (above); the python stage makes it again" >&2
fi
stage "python client" scripts/python-tests.sh -rs --junitxml="$logs/python.xml" ||
  failed+=("python client: scripts/python-tests.sh failed (see above)")
printf 'wall\t%s\n' "$(awk -v a="$t_start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')" >> "$stages"

python3 scripts/test-report.py "$stages" "$logs/rust.xml" "$logs/simd.xml" "$logs/python.xml" >&2

if [ "${#failed[@]}" -gt 0 ]; then
  echo >&2
  echo "FAILED:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all test stages passed" >&2
