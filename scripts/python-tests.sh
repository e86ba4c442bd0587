#!/usr/bin/env bash
# The Python client's tests (python/tests) against real `teacher` processes on a tiny model.
#
# Makes (or reuses) a virtual environment at target/pyenv with python/requirements-test.txt and
# the client (`pip install ./python`), builds the `teacher` and `trainer` debug binaries unless
# XDISTILL_BIN_DIR points at others, and runs pytest; pytest's exit status is this script's.
# Extra arguments go to pytest (e.g. `scripts/python-tests.sh -k sglang -x`); `--venv-only`
# makes the venv and stops (scripts/test.sh runs that beside its build: it waits on PyPI more
# than it computes).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

venv="$root/target/pyenv"
py="$venv/bin/python"

# 1. The venv: reinstalled only when the requirements or the client changed since last time.
#    The stamp is a SHA-256 computed by python3, the same on Linux and macOS (which has no
#    sha256sum).
stamp_of() {
  python3 -c 'import hashlib, sys
h = hashlib.sha256()
for p in sys.argv[1:]:
    with open(p, "rb") as f:
        h.update(f.read())
print(h.hexdigest())' \
    python/requirements-test.txt python/pyproject.toml python/README.md python/xdistill/*.py \
    python/xdistill/py.typed
}
if [ ! -x "$py" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
stamp="$(stamp_of)"
if [ "$(cat "$venv/.xdistill-stamp" 2>/dev/null || true)" != "$stamp" ]; then
  pip_q=(--quiet --disable-pip-version-check)
  "$py" -m pip install "${pip_q[@]}" -r python/requirements-test.txt
  "$py" -m pip install "${pip_q[@]}" --force-reinstall --no-deps ./python
  rm -rf python/build python/*.egg-info
  echo "$stamp" > "$venv/.xdistill-stamp"
fi
[ "${1:-}" = "--venv-only" ] && exit 0

# 2. The binaries (a no-op when they are up to date).
if [ -z "${XDISTILL_BIN_DIR:-}" ]; then
  cargo build --locked -p xdistill-server --bin teacher -p xdistill-trainer-cli --bin trainer
  XDISTILL_BIN_DIR="$root/target/debug"
fi
export XDISTILL_BIN_DIR

# 3. The tokenizers the tiny model is built on.
if [ -z "${XDISTILL_TOKENIZERS:-}" ]; then
  XDISTILL_TOKENIZERS="$(scripts/get-tokenizers.sh)"
fi
export XDISTILL_TOKENIZERS

# 4. The tests. They import the installed package (python/ itself is not on sys.path), so the
#    packaging is tested too. Two pytest processes per core, up to 4 (pytest-xdist; each starts
#    the session's teachers it needs): the tests wait more than they compute (retries' back-off,
#    teachers starting, a replica killed behind HAProxy), and one process per core left the
#    cores idle half the time. On 2 cores (CI build, 2026-12-03, runs alternated): 43 s in one
#    process; 28.2, 25.3, 28.9 s in 2 (24 CPU-s); 24.5, 25.6 s in 3; 21.8, 22.3, 23.3 s in 4
#    (35 CPU-s); 29.9, 30.8 s in 6. `-n 0` (given after) runs them in this one.
#    (`${1+"$@"}`: no arguments pass `set -u` on old bash versions too, such as macOS's 3.2.)
cores="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
workers=$((2 * cores < 4 ? 2 * cores : 4))
exec "$py" -m pytest -q -p no:cacheprovider -n "$workers" python/tests ${1+"$@"}
