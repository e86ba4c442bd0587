#!/usr/bin/env bash
# Builds the CUDA variants of `teacher` and `trainer` on a machine without a GPU.
#
# The CUDA 13.0 toolkit comes from PyPI wheels (nvcc, cudart, cublas, curand, nvrtc) unpacked into
# .cuda/toolkit; linking uses the driver stub. Targets sm_90 (H100/H200) unless CUDA_COMPUTE_CAP
# says otherwise. Output: target/cuda/release/{teacher,trainer}. At run time the GPU machine needs
# the NVIDIA driver and the CUDA 13 runtime libraries (libcudart.so.13, libcublas.so.13,
# libcurand.so.10) on LD_LIBRARY_PATH, e.g. from the same wheels or PyTorch's pip packages.
# The trainer is built with the `nccl` feature (the NCCL backend of data-parallel training), so
# the GPU machine also needs NCCL's libnccl.so.2 at run time: PyTorch's pip packages ship it
# (nvidia-nccl-cu13, under nvidia/nccl/lib). Here it comes from the same wheel (NCCL 2.30, the
# API version of cudarc's bindings), unpacked into .cuda/nccl and linked like the toolkit.
#
#   scripts/build-cuda.sh            # download (once), unpack (once), build
#   scripts/build-cuda.sh --toolkit  # only prepare the toolkit, print the env to use it
# cuDNN's headers (for the fused-attention shim in kernels/cudnn) come from PyPI too.
#   scripts/build-cuda.sh --bundle   # build, plus the CUDA test executables, and pack what
#                                    # scripts/gpu-check.sh needs into target/cuda/gpu-bundle
#                                    # (stripped, xz-packed: small enough to carry to a GPU machine)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cuda="$root/.cuda"
wheels="$cuda/wheels"
tk="$cuda/toolkit"
pkgs=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.5.25
      nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14)
nccl_pkg=nvidia-nccl-cu13==2.30.7
# cuDNN's headers for the fused-attention shim (kernels/cudnn): the header-only graph frontend and
# cuDNN's own headers. cuDNN itself is loaded at run time from the GPU machine's PyTorch packages.
cudnn_pkgs=(nvidia-cudnn-frontend==1.32.0 nvidia-cudnn-cu13==9.27.0.42)

if [ ! -x "$tk/nvidia/cu13/bin/nvcc" ]; then
  mkdir -p "$wheels"
  echo "fetching the CUDA 13.0 toolkit wheels from PyPI (~650 MB, once)" >&2
  python3 -m pip download -q --no-deps -d "$wheels" "${pkgs[@]}"
  python3 -m pip install -q --no-deps --no-compile --target "$tk" \
    $(for p in "${pkgs[@]}"; do ls "$wheels"/"$(echo "${p%%==*}" | tr - _)"-"${p##*==}"-*.whl; done)
fi
home="$tk/nvidia/cu13"
[ -x "$home/bin/nvcc" ] || { echo "nvcc missing under $home/bin" >&2; exit 1; }
# NCCL (~215 MB) in its own directory, so that a toolkit unpacked before NCCL was needed stays.
ncclib="$cuda/nccl/nvidia/nccl/lib"
if [ ! -e "$ncclib/libnccl.so.2" ]; then
  mkdir -p "$wheels"
  echo "fetching NCCL ($nccl_pkg) from PyPI (~215 MB, once)" >&2
  python3 -m pip download -q --no-deps -d "$wheels" "$nccl_pkg"
  rm -rf "$cuda/nccl"
  python3 -m pip install -q --no-deps --no-compile --target "$cuda/nccl" \
    "$wheels"/nvidia_nccl_cu13-"${nccl_pkg##*==}"-*.whl
fi
[ -e "$ncclib/libnccl.so.2" ] || { echo "libnccl.so.2 missing under $ncclib" >&2; exit 1; }
ln -sfn "$ncclib/libnccl.so.2" "$home/lib/libnccl.so.2"
cudnn_inc="$cuda/cudnn"
if [ ! -f "$cudnn_inc/fe/include/cudnn_frontend.h" ] || [ ! -f "$cudnn_inc/cd/nvidia/cudnn/include/cudnn.h" ]; then
  mkdir -p "$wheels" "$cudnn_inc"
  echo "fetching cuDNN's headers (${cudnn_pkgs[*]}, ~550 MB, once)" >&2
  python3 -m pip download -q --no-deps -d "$wheels" "${cudnn_pkgs[@]}"
  unzip -q -o "$wheels"/nvidia_cudnn_frontend-"${cudnn_pkgs[0]##*==}"-*.whl 'include/*' -d "$cudnn_inc/fe"
  unzip -q -o "$wheels"/nvidia_cudnn_cu13-"${cudnn_pkgs[1]##*==}"-*.whl 'nvidia/cudnn/include/*' -d "$cudnn_inc/cd"
fi
export XDISTILL_CUDNN_INCLUDE="$cudnn_inc/fe/include:$cudnn_inc/cd/nvidia/cudnn/include"
# The wheels ship no driver (libcuda.so.1 comes with the NVIDIA driver), so link against a stub:
# a tiny library exporting every driver entry point cudarc declares, with the driver's soname.
# At run time the real libcuda.so.1 of the GPU machine is loaded instead.
if [ ! -e "$home/lib/stubs/libcuda.so" ]; then
  (cd "$root" && cargo fetch --locked -q)
  sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$(awk '/^name = "cudarc"/{getline; gsub(/[^0-9.]/,""); print}' "$root/Cargo.lock")"/src/driver/sys/mod.rs | head -n 1)
  [ -f "$sys" ] || { echo "cudarc sources not found (cargo fetch failed?)" >&2; exit 1; }
  mkdir -p "$home/lib/stubs"
  grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$sys" | sed 's/^pub unsafe fn //' | sort -u \
    | sed 's/.*/void &(void) {}/' > "$home/lib/stubs/libcuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib/stubs/libcuda.so" "$home/lib/stubs/libcuda_stub.c"
fi
# Unversioned names for the linker, and the driver stub as libcuda.so(.1).
(cd "$home/lib" && for f in lib*.so.[0-9]*; do base=${f%%.so.*}.so; [ -e "$base" ] || [ -L "$base" ] || ln -s "$f" "$base"; done
 ln -sfn stubs/libcuda.so libcuda.so.1
 ln -sfn stubs/libcuda.so libcuda.so)

export CUDA_HOME="$home" CUDA_PATH="$home"
export PATH="$home/bin:$PATH"
export LIBRARY_PATH="$home/lib:$home/lib/stubs:${LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="$home/lib:${LD_LIBRARY_PATH:-}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}"
if [ "${1:-}" = "--toolkit" ]; then
  nvcc --version | tail -n 2
  echo "export CUDA_HOME=$home PATH=$home/bin:\$PATH LIBRARY_PATH=$home/lib:$home/lib/stubs CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION XDISTILL_CUDNN_INCLUDE=$XDISTILL_CUDNN_INCLUDE"
  exit 0
fi
cd "$root"
export CARGO_TARGET_DIR="$root/target/cuda"
cargo build --release --locked --features cuda,xdistill-trainer-cli/nccl -p xdistill-server -p xdistill-trainer-cli
ls -la target/cuda/release/teacher target/cuda/release/trainer
[ "${1:-}" = "--bundle" ] || exit 0

# The integration tests of shared (the model tests), of the server (the device top-k parity
# test) and of the kernels (the fused loss), built for the GPU: test-shared, test-server and
# test-kernels in the bundle, run by gpu-check.sh with a
# module filter. Their executables are found from cargo's JSON messages (names carry a hash). `candle-core/nccl` keeps cudarc's features
# those of the build above, so that cudarc is not compiled a second time.
tests=$(cargo test --release --locked --features cuda,candle-core/nccl --no-run --message-format=json \
    -p xdistill-shared --test integration -p xdistill-server --test integration \
    -p xdistill-kernels --test integration \
  | python3 -c 'import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(os.path.basename(os.path.dirname(m["manifest_path"])), m["executable"])')
bundle="$root/target/cuda/gpu-bundle"
rm -rf "$bundle" && mkdir -p "$bundle/tokenizers/qwen3"
# xz: the binaries carry candle's PTX as text, which xz packs to half of gzip's size (the
# bundle must travel to the GPU machine with the sources in 64 MiB).
pack() { strip -o "$bundle/$2" "$1" && xz -f -9e -T0 "$bundle/$2"; }
pack target/cuda/release/teacher teacher
pack target/cuda/release/trainer trainer
while read -r name exe; do pack "$exe" "test-$name"; done <<<"$tests"
# gpu-check step 4's driver-call counts: bench/cuda_calls.c, preloaded into bench-step.
cc -shared -fPIC -O2 -o target/cuda/libcuda_calls.so bench/cuda_calls.c -ldl
xz -c -9e target/cuda/libcuda_calls.so > "$bundle/libcuda_calls.so.xz"
# gpu-check step 6 (bench/full_vocab.py --device cuda): the student-side cost example, and GSM8K
# text when the shared data sits beside the checkout (or in $XDISTILL_DATA).
cargo build --release --locked --features nccl -p xdistill-trainer --example full_vocab_cost
pack target/cuda/release/examples/full_vocab_cost full_vocab_cost
# gpu-check step 4's PyTorch + Liger row: Liger's Triton kernels, pure Python (the GPU machine
# has PyTorch and Triton but no package index).
mkdir -p "$bundle/wheels"
python3 -m pip download -q --no-deps -d "$bundle/wheels" liger-kernel==0.8.5
gsm8k="${XDISTILL_DATA:-$root/../shared/data}/gsm8k/train.jsonl"
if [ -f "$gsm8k" ]; then
  mkdir -p "$bundle/data" && xz -c -9e "$gsm8k" > "$bundle/data/gsm8k-train.jsonl.xz"
fi
# The Qwen3 tokenizer (tiny test models and the benchmark model use it). The other names the
# tokenizer lookup expects point at it: the GPU tests use only Qwen3.
tok=$(scripts/get-tokenizers.sh)
xz -c -9e "$tok/qwen3/tokenizer.json" > "$bundle/tokenizers/qwen3/tokenizer.json.xz"
for n in llama3 llama2 gemma3 deepseek_v3; do
  mkdir -p "$bundle/tokenizers/$n" && ln -sfn ../qwen3/tokenizer.json "$bundle/tokenizers/$n/tokenizer.json"
done
du -sh "$bundle" && ls -la "$bundle"
