#!/usr/bin/env bash
# The GPU checks and benchmarks in one command, for a machine with an NVIDIA GPU (H100/H200),
# its driver, Python with PyTorch + transformers (their pip packages bring the CUDA 13 runtime
# libraries), and no Rust toolchain or network. Run from the repository root with the bundle
# `scripts/build-cuda.sh --bundle` made (target/cuda/gpu-bundle, carried beside the sources):
#
#   scripts/gpu-check.sh [BUNDLE]        # figures and logs go to $OUT (or runs/gpu-check)
#
# 1. the decoder model tests on the GPU (f32); 1b. cuDNN's fused attention (bf16, f16) against an
#    f64 reference and decoders through it against the eager attention; its training forward and
#    backward against f64 loops, and training passes through it against the blockwise core;
# 1c. the project's own CUDA kernels (kernels/cuda: top-k selection, multi-tensor AdamW, sums of
#    squares, log-softmax) against f64 or the CPU kernel's bits; the fused layer ops (RMSNorm,
#    RoPE, gated activation, with their backward) against their CPU reference, and whole
#    training passes and served logits through them against the composed ops; the fused top-k
#    distillation loss and cross-entropy (topk_kd.cu) against its CPU reference;
# 2. the teacher's device top-k path on the GPU against the f64 CPU reference and the host path,
#    with candle's sorts and with the selection kernel (XDISTILL_CUDA_KERNELS=on);
# 2b. the NCCL collectives in a world of one (`trainer nccl-check`: host buffers and a GPU tensor);
# 3. a random model of Qwen3-0.6B's shape (Qwen3 vocabulary): teacher (cuda, bf16) scored
#    tokens/s at k = 64 vs transformers forward + torch.topk, with their answers compared;
# 4. the student training step (bf16 compute, f32 masters, AdamW) vs PyTorch eager (autocast),
#    each way of keeping activations and with cuDNN's attention core;
# 5. a Qwen3-1.7B-shaped student at 4096 tokens (checkpointed) vs PyTorch "careful";
# 6. exact full-vocabulary transport (issue 32): `bench/full_vocab.py --device cuda`.
# 3t. teacher speed (issue 46): random models of Qwen3-0.6B's and Qwen3-1.7B's shapes, ours
#    through HTTP (MessagePack, 4 clients) in the batch-invariant mode, packed (the GPU's
#    default; its matmuls by the fixed algorithm, and again a cuBLAS GEMM per block), and the
#    padded one (`--batch-invariant false`), with cuDNN's attention and the selection kernel
#    (`SPEED_RUNS`, mode:attention:topk, default "packed:cudnn:kernel
#    packed-per-block:cudnn:kernel packed-exact:cudnn:kernel padded:cudnn:kernel";
#    `alone:cudnn:kernel` adds a forward per sequence) against transformers (SDPA) + torch.topk
#    in-process, at 8 x 512, 4 x 2048, 1 x 8192 and mixed 8 x 256-1024, k = 64, bf16, with
#    the server's phase breakdown (forward, LM head, top-k, copy, encoding; synchronised). Not in the default run
#    (it is long): STEPS="3t". SPEED_MODELS="qwen3-0.6b" measures one of the two shapes. It
#    runs before step 3 and leaves its Qwen3-0.6B model to steps 3 and 4.
# r. on-policy generation (issue 47 item 7): a 32-row greedy rollout of 128 tokens on the
#    random Qwen3-0.6B, `trainer eval` (old and new paths) vs transformers' generate,
#    tokens/s; then an on-policy run of 3 steps, student and teacher (4 layers of that shape)
#    on the card. Not in the default run: STEPS="r".
# p. kernels per teacher forward and per student step (issues 46, 47): `ncu` on a 4-layer model of
#    Qwen3-0.6B's shape (the kernel mix per layer is the full model's), every launch timed,
#    summed per kernel by bench/ncu_kernels.py. Not in the default run: STEPS="p"
#    (PROFILE_TEACHER=0: the student's step only; PROFILE_SHAPE="8x1024", PROFILE_LAYERS=28 and
#    PROFILE_PATHS="step-new" profile the new path's step at another shape or depth).
#
# STEPS="1 2 6" runs only those steps (default: all but 3t, r and p); STEP_SHAPES="4x512",
# STEP_STEPS=5 and STEP_ACTIVATIONS="auto" shorten step 4. Each step has a time limit, so that
# one hung step leaves the others their time on a lent machine.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bundle=${1:-target/cuda/gpu-bundle}
out=${OUT:-$root/runs/gpu-check}
mkdir -p "$out"
log="$out/gpu-check.log"
# Lines cut at 2,000 characters: a failed assert_eq! on two tensors prints megabytes, and a log
# over 16 MiB does not come back from a lent machine (the 2026-11-29 H200 run's was lost so).
# `sed -u` reads and writes a line at a time: the GPU image's awk (mawk) read its pipe in blocks,
# so a run stopped by `timeout` lost everything still in that buffer (on 2026-12-04 a 460 s
# run's whole log). A caller's time limit leaves the log complete up to the moment it stops.
exec > >(sed -u 's/^\(.\{2000\}\).*/\1/' | tee -a "$log") 2>&1
work=$(mktemp -d /tmp/xdistill-gpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
check() { if "$@"; then echo "PASS: $*"; else echo "FAIL ($?): $*"; fail=1; fi; }
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }
# Steps that run only when named (long, or profiles): 3t, r, p.
only() { [[ " ${STEPS:-} " == *" $1 "* ]]; }
# Waits (at most 5 minutes) until the teacher on port $1 answers /health, or process $2 exits.
wait_healthy() {
  for _ in $(seq 600); do
    "${PYTHON:-python3}" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=1)" \
      2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

step "unpacking $bundle into $work"
[ -d "$bundle" ] || { echo "no bundle at $bundle: run scripts/build-cuda.sh --bundle first" >&2; exit 2; }
# xz-packed files (scripts/build-cuda.sh --bundle); Python's lzma where the xz tool is missing.
unxz_to() {
  if command -v xz >/dev/null 2>&1; then xz -dc "$1" > "$2"
  else "${PYTHON:-python3}" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; fi
}
for f in "$bundle"/*.xz; do unxz_to "$f" "$work/$(basename "${f%.xz}")"; chmod +x "$work/$(basename "${f%.xz}")"; done
mkdir -p "$work/tokenizers/qwen3"
unxz_to "$bundle/tokenizers/qwen3/tokenizer.json.xz" "$work/tokenizers/qwen3/tokenizer.json"
for n in llama3 llama2 gemma3 deepseek_v3; do
  mkdir -p "$work/tokenizers/$n" && ln -sfn ../qwen3/tokenizer.json "$work/tokenizers/$n/tokenizer.json"
done
ls -la "$work"

step "CUDA runtime libraries from the Python packages"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
py=${PYTHON:-python3}
libdirs=$("$py" - <<'PY'
import glob, os
roots = []
try:
    import nvidia
    roots += list(nvidia.__path__)
except ImportError:
    pass
try:
    import torch
    roots.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
except ImportError:
    pass
want = ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libnvrtc.so.13",
        "libnccl.so.2",  # NCCL: the trainer is built with the `nccl` feature
        "libcudnn.so.9",  # loaded at run time by the fused attention (kernels/cudnn)
        "libnvtx3interop.so.1"]  # NVTX ranges under a profiler (shared/src/profiling.rs), if present
dirs = []
for w in want:
    for r in roots:
        hits = glob.glob(os.path.join(r, "**", w), recursive=True)
        if hits:
            d = os.path.dirname(hits[0])
            if d not in dirs:
                dirs.append(d)
            break
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd "$work/teacher" | grep -E 'cuda|cublas|curand|nvrtc|not found'
ldd "$work/trainer" | grep -E 'nccl|not found'
if ldd "$work/teacher" "$work/trainer" | grep 'not found' >/dev/null; then  # no -q: with pipefail, ldd's SIGPIPE would read as no match
  echo "missing libraries (above): set LD_LIBRARY_PATH to the CUDA 13 runtime" >&2; exit 3
fi

export XDISTILL_TOKENIZERS="$work/tokenizers" XDISTILL_TEST_TMPDIR="$work/tmp"
export XDISTILL_TEACHER_BIN="$work/teacher" RUST_BACKTRACE=1
if want 1; then
step "1. decoder model tests on the GPU"
check timeout 300 env XDISTILL_TEST_DEVICE=cuda "$work/test-shared" model:: --test-threads=1
step "1b. cuDNN's fused attention (serving and training): against f64 references, decoders and training passes through it"
check timeout 300 env XDISTILL_TEST_DEVICE=cuda RUST_LOG=info "$work/test-shared" cudnn_attention:: \
  --test-threads=1 --nocapture
step "1c. the project's CUDA kernels (kernels/cuda): top-k, AdamW, gradient accumulation, sums of squares, log-softmax, fused layer ops, the accumulating and blocked GEMMs"
check timeout 180 env XDISTILL_TEST_DEVICE=cuda "$work/test-shared" cuda_kernels:: --test-threads=1 --nocapture
check timeout 120 env XDISTILL_TEST_DEVICE=cuda "$work/test-kernels" topk_kd_gpu:: --test-threads=1 --nocapture
fi
if want 2; then
step "2. device top-k path: GPU vs the f64 CPU reference and the CPU host path (sorts, then the kernel)"
for kernels in off on; do
  check timeout 300 env XDISTILL_TEST_DEVICE=cuda XDISTILL_CUDA_KERNELS=$kernels "$work/test-server" device_topk:: \
    --test-threads=1
done
step "   the same tests on the CPU (sanity of the bundle)"
check timeout 300 "$work/test-server" device_topk:: --test-threads=1

step "2b. NCCL collectives, world of one (trainer nccl-check: exact sums' bits, fast all-reduce; GPU tensors through the host, then on the device)"
for kernels in off on; do
  check timeout 120 env XDISTILL_CUDA_KERNELS=$kernels "$work/trainer" nccl-check
done
fi

if only 3t; then
step "3t. teacher speed: ours (HTTP) vs transformers (SDPA) + torch.topk, invariant and padded"
# name hidden layers heads kv-heads intermediate
for spec in "qwen3-0.6b 1024 28 16 8 3072" "qwen3-1.7b 2048 28 16 8 6144"; do
  set -- $spec
  name=$1
  [[ " ${SPEED_MODELS:-qwen3-0.6b qwen3-1.7b} " == *" $name "* ]] || continue
  model="$work/$name-speed"
  check "$work/trainer" init-model --arch qwen3 --tokenizer "$work/tokenizers/qwen3/tokenizer.json" \
    --hidden-size "$2" --layers "$3" --heads "$4" --kv-heads "$5" --head-dim 128 \
    --intermediate-size "$6" --tie-embeddings --pad-vocab-to 64 --max-position-embeddings 16384 \
    --seed 1 --out "$model"
  # mode:attention:topk. Modes: `packed` (invariant, one packed forward per batch, its matmuls
  # one cuBLASLt product by the algorithm fixed for a block of rows: the GPU's default),
  # `packed-per-block` (the same with a cuBLAS GEMM per block: XDISTILL_PACKED_GEMM=per-block,
  # the default before 2026-11-30), `alone` (invariant, a forward per sequence: before the
  # packed forward; sequences of --packed-rows inputs or more still run so), `padded`
  # (`--batch-invariant false`); `true`/`false` are the defaults of the two. The new path
  # (cuDNN's attention, the project's kernels) each way; the invariant goal is packed at >= 0.8x
  # padded.
  # `packed-exact`: packed with a cuDNN graph per exact length (XDISTILL_ATTENTION_BUCKET=1,
  # as before 2026-11-30), on the mixed lengths only.
  runs=${SPEED_RUNS:-packed:cudnn:kernel packed-per-block:cudnn:kernel packed-exact:cudnn:kernel padded:cudnn:kernel}
  first_run=${runs%% *}
  for run in $runs; do
    IFS=: read -r mode attention topk <<< "$run"
    topk=${topk:-sort}
    kernels=off; [ "$topk" = kernel ] && kernels=on
    gemm=fixed-algo
    case $mode in
      packed) invariant=true; packing=on ;;
      packed-per-block) invariant=true; packing=on; gemm=per-block ;;
      packed-exact) invariant=true; packing=on ;;
      alone) invariant=true; packing=off ;;
      padded) invariant=false; packing=auto ;;
      *) invariant=$mode; packing=auto ;;
    esac
    port=18124
    log="$out/teacher-$name-$mode-$attention-$topk.log"
    bucket=32; [ "$mode" = packed-exact ] && bucket=1
    XDISTILL_ATTENTION=$attention XDISTILL_CUDA_KERNELS=$kernels XDISTILL_PACKED_GEMM=$gemm \
      XDISTILL_ATTENTION_BUCKET=$bucket "$work/teacher" --model "$model" --device cuda \
      --dtype bf16 --port $port --cache-bytes 0 \
      --batch-invariant "$invariant" --packed-forward $packing --max-batch-tokens 16384 --max-queue-tokens 1048576 \
      > "$log" 2>&1 &
    tpid=$!
    wait_healthy $port $tpid
    grep -E "attention|scoring path" "$log" | head -n 3
    # PyTorch's side does not depend on our mode: measured once, beside the first run.
    torch_flag="--no-torch"; [ "$run" = "$first_run" ] && torch_flag=""
    # "mixed": each row of its own length in [256, 1024], a new mix every batch (what a
    # teacher serving dataset text sees: cuDNN's graph per shape shows here only).
    for shape in "8 512 16" "4 2048 8" "1 8192 6" "8 1024 16 mixed"; do
      set -- $shape
      # One sequence runs alone in both modes: the padded mode's figure would repeat the other.
      [ "$invariant" = false ] && [ "$1" = 1 ] && continue
      # Exact shapes (a graph per length, as before 2026-11-30) only where lengths vary.
      [ "$mode" = packed-exact ] && [ "${4:-}" != mixed ] && continue
      mixed=""; [ "${4:-}" = mixed ] && mixed="--mixed-lengths"
      check timeout 150 env PYTHONUNBUFFERED=1 "$py" bench/gpu_teacher.py --model "$model" \
        --url "http://127.0.0.1:$port" --batch "$1" --seq-len "$2" --k 64 --requests "$3" \
        --clients 4 --dtype bf16 --label "$name $mode attention=$attention topk=$topk" $torch_flag $mixed
    done
    # The fixed GEMM algorithm's fallbacks, if any (one warning per shape or row count).
    grep "packed GEMM" "$log" | head -n 8
    kill -TERM $tpid; wait $tpid
  done
  # Step 4 trains a student of Qwen3-0.6B's shape: it takes this one.
  if [ "$name" = qwen3-0.6b ]; then mv "$model" "$work/qwen3-0.6b-random"; else rm -rf "$model"; fi
done
fi

if want 3 || want 4; then
step "3. a random model of Qwen3-0.6B's shape"
model="$work/qwen3-0.6b-random"
# Step 3t, when it ran first, left this model behind (the same shape and weights).
[ -d "$model" ] || check "$work/trainer" init-model --arch qwen3 --tokenizer "$work/tokenizers/qwen3/tokenizer.json" \
  --hidden-size 1024 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --intermediate-size 3072 \
  --tie-embeddings --pad-vocab-to 64 --max-position-embeddings 4096 --seed 1 --out "$model"
"$py" -c "import json; c = json.load(open('$model/config.json')); print({k: c[k] for k in ('vocab_size', 'hidden_size', 'num_hidden_layers', 'head_dim', 'tie_word_embeddings')})"

if want 3; then
step "   teacher (cuda, bf16, device top-k) vs transformers + torch.topk, k = 64"
port=18123
"$work/teacher" --model "$model" --device cuda --dtype bf16 --port $port --cache-bytes 0 \
  --max-batch-tokens 8192 --max-queue-tokens 1048576 > "$out/teacher.log" 2>&1 &
tpid=$!
wait_healthy $port $tpid
curl -s "http://127.0.0.1:$port/v1/info" | head -c 600; echo
for shape in "8 512" "4 2048"; do
  set -- $shape
  check timeout 180 env PYTHONUNBUFFERED=1 "$py" bench/gpu_teacher.py --model "$model" --url "http://127.0.0.1:$port" \
    --batch "$1" --seq-len "$2" --k 64 --requests 24 --clients 4 --dtype bf16
done
kill -TERM $tpid; wait $tpid
tail -n 5 "$out/teacher.log"
fi
fi


if want 4; then
step "4. student step: ours (cuda, bf16 compute, f32 masters) vs PyTorch eager (autocast bf16)"
# Activations: `auto` (what training does: the line's `activations=` says what it chose), `off`
# (everything kept, eager attention), `selective` (all but the attention core: the blockwise
# attention) and `on` (full checkpointing: one more forward), beside each other (issue 47 item
# 6); then `auto` on the new path: cuDNN's attention core (forward and backward) and the
# project's kernels (fused RMSNorm, RoPE and gated activation with their backward, the
# log-softmax, the multi-tensor AdamW, the gradients' norm in one launch), the default since
# steps 1b and 1c passed on an H200 (2026-11-29); each run names both switches.
liger_whl=$(ls "$bundle"/wheels/liger_kernel-*.whl 2>/dev/null | head -n 1)
if [ -n "$liger_whl" ]; then
  check "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/liger" "$liger_whl"
else
  echo "skipped: PyTorch with Liger's kernels (no liger-kernel wheel in the bundle)"
fi
for shape in ${STEP_SHAPES:-4x512 8x1024}; do
  set -- ${shape/x/ }
  for ckpt in ${STEP_ACTIVATIONS:-auto off selective on} new new-cached; do
    attn=eager kernels=off extra=
    # The new path first checks a micro-batch's loss and gradients against the CPU's in f32
    # (2 x 128 tokens, head chunks of 97 rows: the fused head chunks by hand among them); then
    # again with candle's launch parameters cached on the device (`--param-cache`: what the
    # host-to-device copy of each strided operand's dims and strides costs).
    case "$ckpt" in
      new) attn=cudnn kernels=on ckpt=auto extra=--check-cpu ;;
      new-cached) attn=cudnn kernels=on ckpt=auto extra=--param-cache ;;
    esac
    check timeout 180 env XDISTILL_ATTENTION=$attn XDISTILL_CUDA_KERNELS=$kernels "$work/trainer" bench-step --model "$model" --device cuda \
      --dtype bf16 --batch "$1" --seq-len "$2" --k 64 --steps "${STEP_STEPS:-10}" \
      --activation-checkpointing "$ckpt" --write-batch "$work/batch.safetensors" $extra
  done
  # The driver calls of 2 timed steps (bench/cuda_calls.c, preloaded; bench-step's
  # --profiler-range marks the timed steps as the CUDA profiler's range): the host's waits, copies each way and the
  # launches candle and the project's kernels make (cuBLAS's and cuDNN's are not seen; step p
  # counts every launch), the composed path and the new one: per step, half of each line.
  if [ -f "$work/libcuda_calls.so" ]; then
    for path in composed new; do
      attn=eager kernels=off; [ "$path" = new ] && attn=cudnn kernels=on
      check timeout 120 env LD_PRELOAD="$work/libcuda_calls.so" XDISTILL_ATTENTION=$attn XDISTILL_CUDA_KERNELS=$kernels \
        "$work/trainer" bench-step --model "$model" --device cuda --dtype bf16 --batch "$1" --seq-len "$2" --k 64 \
        --steps 2 --activation-checkpointing auto --profiler-range
    done
  else
    echo "skipped: driver calls per step (no libcuda_calls.so in the bundle)"
  fi
  check timeout 180 env PYTHONUNBUFFERED=1 "$py" bench/torch_step.py "$model" "$work/batch.safetensors" "${STEP_STEPS:-10}" 16 cuda bf16
  # PyTorch eager with Liger's Triton kernels (RMSNorm, RoPE, SwiGLU), from the wheel the bundle
  # carries (`scripts/build-cuda.sh --bundle`; the machine has no index to install from).
  if [ -d "$work/liger" ]; then
    check timeout 180 env PYTHONUNBUFFERED=1 PYTHONPATH="$work/liger" "$py" bench/torch_step.py "$model" \
      "$work/batch.safetensors" "${STEP_STEPS:-10}" 16 cuda bf16 liger
  fi
done
fi

if only r; then
step "r. on-policy generation (issue 47 item 7): a 32-row greedy rollout, ours vs transformers' generate"
# The random Qwen3-0.6B of step 3 (made here if that step did not run), GSM8K's first 32
# questions, 128 new tokens per row, no stop strings: ours through `trainer eval` (batched
# prefill, one decoding step per token over the KV cache) on the composed path and on the new
# one (cuDNN's prefill attention where it applies, the project's kernels), then PyTorch.
model="$work/qwen3-0.6b-random"
[ -d "$model" ] || check "$work/trainer" init-model --arch qwen3 --tokenizer "$work/tokenizers/qwen3/tokenizer.json" \
  --hidden-size 1024 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --intermediate-size 3072 \
  --tie-embeddings --pad-vocab-to 64 --max-position-embeddings 4096 --seed 1 --out "$model"
prompts="$work/data/train.jsonl"
if [ ! -f "$prompts" ] && [ -f "$bundle/data/gsm8k-train.jsonl.xz" ]; then
  mkdir -p "$work/data" && unxz_to "$bundle/data/gsm8k-train.jsonl.xz" "$prompts"
fi
if [ -f "$prompts" ]; then
  for path in old new; do
    attn=eager kernels=off
    if [ $path = new ]; then attn=cudnn kernels=on; fi
    check timeout 300 env XDISTILL_ATTENTION=$attn XDISTILL_CUDA_KERNELS=$kernels "$work/trainer" eval \
      --model "$model" --prompts "$prompts" --limit 32 --samples 0 --max-new-tokens 128 --no-stop \
      --batch-size 32 --device cuda --dtype bf16 --quiet
  done
  check timeout 300 env PYTHONUNBUFFERED=1 "$py" bench/torch_rollout.py "$model" "$prompts" 32 128 cuda bf16
  # An on-policy run of a few steps on the GPU (issue 47: rollouts, the teacher's scores of
  # them, the sampled-token loss's head chunks by hand, AdamW): student and teacher 4 layers of
  # Qwen3-0.6B's shape with its tokenizer, both on the card, configs/on_policy.toml on GSM8K's
  # questions, 3 steps of 16 prompts, 48 new tokens each. Its step lines and summary.
  onp="$work/qwen3-0.6b-4layers-onp"
  [ -d "$onp" ] || check "$work/trainer" init-model --arch qwen3 --tokenizer "$work/tokenizers/qwen3/tokenizer.json" \
    --hidden-size 1024 --layers 4 --heads 16 --kv-heads 8 --head-dim 128 --intermediate-size 3072 \
    --tie-embeddings --pad-vocab-to 64 --max-position-embeddings 4096 --seed 1 --out "$onp"
  port=18126
  "$work/teacher" --model "$onp" --device cuda --dtype bf16 --port $port > "$out/teacher-onp.log" 2>&1 &
  tpid=$!
  wait_healthy $port $tpid
  check timeout 300 "$work/trainer" on-policy --config configs/on_policy.toml \
    --teacher-url "http://127.0.0.1:$port" --student "$onp" --prompts "$prompts" --output "$work/onp-run" \
    --max-steps 3 --set policy.device="cuda" --set data.prompt_field="question" \
    --set data.completion_field="answer" --set distillation.val_at_start=false \
    --set distillation.val_at_end=false --set checkpointing.enabled=false
  kill -TERM $tpid; wait $tpid
else
  echo "skipped: no GSM8K prompts in the bundle"
fi
fi

if only p; then
step "p. kernels per teacher forward and per student step (ncu, 4 layers of Qwen3-0.6B's shape)"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
layers=${PROFILE_LAYERS:-4}
small="$work/qwen3-0.6b-${layers}layers"
check "$work/trainer" init-model --arch qwen3 --tokenizer "$work/tokenizers/qwen3/tokenizer.json" \
  --hidden-size 1024 --layers "$layers" --heads 16 --kv-heads 8 --head-dim 128 --intermediate-size 3072 \
  --tie-embeddings --pad-vocab-to 64 --max-position-embeddings 4096 --seed 1 --out "$small"
pshape=${PROFILE_SHAPE:-4x512}
set -- ${pshape/x/ }
if [ -n "$ncu" ]; then
  # Every launch timed (one metric, one pass each); clocks left alone (--clock-control none).
  prof() { local name=$1; shift; timeout 240 "$ncu" --clock-control none --metrics gpu__time_duration.sum \
    --csv --log-file "$out/ncu-$name.csv" "$@" > "$out/ncu-$name.out" 2>&1; }
  # Student: one warm-up and one timed step at 4 x 512, activations as training chooses; the
  # composed path, then the new one (cuDNN's attention core and the project's kernels: fused
  # norms, RoPE, gated activation, AdamW, layers by hand), so that the launches per step show
  # before and after. bench-step runs one more step timed phase by phase: 3 steps profiled.
  for path in ${PROFILE_PATHS:-step step-new}; do
    attn=eager kernels=off
    if [ $path = step-new ]; then attn=cudnn kernels=on; fi
    # Phase marks (xdistill_shared::profiling): the table below also cut by phase.
    XDISTILL_PHASE_MARKS=on XDISTILL_ATTENTION=$attn XDISTILL_CUDA_KERNELS=$kernels check prof $path \
      "$work/trainer" bench-step --model "$small" --device cuda --dtype bf16 --batch "$1" --seq-len "$2" \
      --k 64 --steps 1
    tail -n 3 "$out/ncu-$path.out"
    check "$py" bench/ncu_kernels.py "$out/ncu-$path.csv" --per 3 --phases \
      --label "student step ($layers layers, $1 x $2, attention $attn, kernels $kernels)"
  done
  # Teacher: the start-up probe, then one warm-up and one request of 1 x 512 (invariant mode),
  # with the eager attention and with cuDNN's (PROFILE_TEACHER=0 skips it).
  teacher_atts="eager cudnn"; [ "${PROFILE_TEACHER:-1}" = 0 ] && teacher_atts=""
  for att in $teacher_atts; do
    port=18125
    XDISTILL_PHASE_MARKS=on XDISTILL_ATTENTION=$att prof "teacher-$att" "$work/teacher" --model "$small" --device cuda \
      --dtype bf16 --port $port --cache-bytes 0 --max-batch-tokens 8192 &
    ppid=$!
    wait_healthy $port $ppid
    check timeout 120 env PYTHONUNBUFFERED=1 "$py" bench/gpu_teacher.py --model "$small" \
      --url "http://127.0.0.1:$port" --batch 1 --seq-len 512 --k 64 --requests 1 --clients 1 --no-torch
    pkill -TERM -f "^$work/teacher --model $small" ; wait  # the teacher, not ncu: ncu then writes
    tail -n 3 "$out/ncu-teacher-$att.out"
    check "$py" bench/ncu_kernels.py "$out/ncu-teacher-$att.csv" --phases \
      --label "teacher ($att attention): probe + 2 requests of 1 x 512 (4 layers)"
  done
else
  echo "skipped: no ncu on this machine"
fi
fi

if want 5; then
step "5. a real-size student: Qwen3-1.7B's shape at 4096 tokens, checkpointed, vs PyTorch careful"
# hidden 2048, 28 layers, 16 heads, 8 KV heads, head dim 128, intermediate 6144, tied: 1.72 B.
big="$work/qwen3-1.7b-random"
check "$work/trainer" init-model --arch qwen3 --tokenizer "$work/tokenizers/qwen3/tokenizer.json" \
  --hidden-size 2048 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --intermediate-size 6144 \
  --tie-embeddings --max-position-embeddings 40960 --out "$big"
# Peak device memory: nvidia-smi sampled every 100 ms while each step runs.
peak_mib() { sort -n "$1" | tail -n 1; }
for shape in "1 4096" "4 4096"; do
  set -- $shape
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$work/mem.log" &
  smi=$!
  check timeout 240 "$work/trainer" bench-step --model "$big" --device cuda --dtype bf16 --batch "$1" \
    --seq-len "$2" --k 64 --steps 3 --activation-checkpointing on --write-batch "$work/big.safetensors"
  kill $smi; echo "ours $1 x $2: peak device memory $(peak_mib "$work/mem.log") MiB (nvidia-smi)"
  check timeout 240 env PYTHONUNBUFFERED=1 "$py" bench/torch_step.py "$big" "$work/big.safetensors" 3 16 cuda bf16 careful
done
fi

if want 6; then
step "6. exact full-vocabulary transport (issue 32): bf16 teachers on the GPU, student-side cost"
# Routes /hidden_states, /topk_logits k = 64 and full logits from teachers serving in bf16 on
# the GPU; the teacher head + log-softmax and the exact forward KL on the GPU (candle vs PyTorch).
if [ -f "$bundle/data/gsm8k-train.jsonl.xz" ] && [ -f "$work/full_vocab_cost" ]; then
  mkdir -p "$work/examples" "$work/data"
  ln -sfn ../full_vocab_cost "$work/examples/full_vocab_cost"
  unxz_to "$bundle/data/gsm8k-train.jsonl.xz" "$work/data/train.jsonl"
  check timeout 420 env PYTHONUNBUFFERED=1 QUICK=1 "$py" bench/full_vocab.py --device cuda --bins "$work" \
    --tokenizers "$work/tokenizers" --data "$work/data/train.jsonl" --out "$out/full_vocab_gpu.json"
else
  echo "skipped: the bundle has no GSM8K text or no full_vocab_cost (scripts/build-cuda.sh --bundle)"
fi
fi

step "summary: each step's checks and figures, from the log above (the end of a call's output)"
# The lines that carry figures or verdicts, cut to 220 characters, their last 10,000 bytes: the
# tail of the output a lent machine sends back (12,000 characters) then holds every step's result
# even when a profile printed pages (the whole log is in $out).
grep -aE '^(=== |FAIL \(|bench-step |ratio ours|  peak allocated|  phases \(|  loss: |pytorch |ours [0-9]+ x [0-9]+: peak|\{"(impl|phases|compare|label)")' "$log" \
  | grep -avE '^=== summary' | cut -c1-220 | tail -c 10000
echo "checks passed: $(grep -ac '^PASS: ' "$log"), failed: $(grep -ac '^FAIL (' "$log")"

step "done"
[ $fail = 0 ] && echo "ALL CHECKS PASSED" || echo "SOME CHECKS FAILED"
rm -rf "$work"
exit $fail
