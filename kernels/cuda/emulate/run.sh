#!/bin/bash
# Builds and runs the host emulation of the CUDA kernels (cuda_runtime_emu.h) against their
# references (f64, or the CPU kernel's own f32 arithmetic); exits non-zero on a mismatch. Needs
# g++ with C++20 only.
set -euo pipefail
command -v g++ >/dev/null || { echo "g++ (12 or newer, C++20) is needed to run the kernels' host emulation (apt-get install g++)" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$(mktemp -d)}
# One harness per kernel file (or group), each its own program: NAME_test.cpp.
for test in topk_rows optimizer log_softmax elementwise topk_kd; do
  g++ -std=c++20 -O1 -ffp-contract=off -I "$here" -include "$here/cuda_runtime_emu.h" \
    "$here/${test}_test.cpp" -o "$out/${test}_test"
  "$out/${test}_test"
done
