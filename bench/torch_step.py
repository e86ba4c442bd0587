"""PyTorch eager reference for the student training step (outside CI).

Runs the same step as `trainer bench-step`, which runs this script itself with `--python` (CPU
comparison) or writes the batch with `--write-batch BATCH.safetensors` (GPU check): the same
model directory, the same batch (read from the safetensors file the Rust side writes), the same loss (forward KL over
the teacher's top-k with a tail bucket, temperature 1, plus 0.1 x CE on the targets), AdamW
(lr 1e-4, wd 0.01), gradient-norm clipping at 1.0, and prints one JSON line: the median step
time, every timed step's time and the first (warm-up) step's loss, which the Rust side compares
with its own.

    python bench/torch_step.py MODEL_DIR BATCH.safetensors STEPS THREADS [DEVICE [DTYPE [MODE]]]

DEVICE is cpu (default) or cuda; DTYPE f32 (default) or bf16. MODE is `eager` (default: the
whole [B, T, V] logits at once), `careful`, the way memory-conscious PyTorch trainers run it:
SDPA attention, gradient checkpointing of every layer, and the LM head + loss in chunks of 512
positions under torch.utils.checkpoint (each chunk's logits recomputed in the backward), or
`liger`: eager with Liger's Triton kernels where they apply (`liger-kernel` from PyPI: its
RMSNorm, RoPE and SwiGLU patched into transformers' Qwen3/Llama/Mistral classes before the model
loads; its fused linear losses do not apply: they fuse a cross-entropy or a full-vocabulary
JSD with the head, and this loss is a top-k KL with a tail bucket). The JSON line carries the
peak memory: ru_maxrss on the CPU, max_memory_allocated on a GPU.

bf16 is mixed precision as the Rust side does it: f32 parameters (the masters AdamW updates)
and a bf16 forward/backward through `torch.autocast`; the loss is computed in f32 from the
logits either way.
"""
import json, math, statistics, sys, time
import resource
import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

model_dir, batch_path = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
threads = int(sys.argv[4]) if len(sys.argv) > 4 else torch.get_num_threads()
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
dtype = sys.argv[6] if len(sys.argv) > 6 else "f32"
mode = sys.argv[7] if len(sys.argv) > 7 else "eager"
assert mode in ("eager", "careful", "liger"), mode
torch.set_num_threads(threads)
b = load_file(batch_path)
ids, targets, mask = (b["ids"].long().to(device), b["targets"].long().to(device),
                      b["mask"].float().to(device))
t_ids, t_lp = b["teacher_ids"].long().to(device), b["teacher_logprobs"].float().to(device)
if mode == "liger":
    # Before the model loads: the patches replace transformers' classes and functions.
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        sys.exit(f"mode liger needs the liger-kernel package: {e}")
    arch = json.load(open(f"{model_dir}/config.json"))["model_type"]
    patch = getattr(liger, f"apply_liger_kernel_to_{arch}", None)
    if patch is None:
        sys.exit(f"liger-kernel has no patch for {arch}")
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
          fused_linear_cross_entropy=False)
model = AutoModelForCausalLM.from_pretrained(
    model_dir, dtype=torch.float32, **({"attn_implementation": "sdpa"} if mode == "careful" else {})
).to(device)
model.train()
if mode == "careful":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                          enabled=dtype == "bf16")


def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)


# The tail mass 1 - sum_K p is floored at 1e-6, as the Rust loss does (TAIL_FLOOR).
TAIL_MAX = math.log1p(-1e-6)


def log1mexp(x):
    # log(1 - exp(x)) for x < 0, stable
    return torch.where(x > -0.693, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def position_loss(logits, t_ids, t_lp, targets):
    """Per-position KD + 0.1 CE, [..., V] logits -> [...]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    s_k = lp.gather(-1, t_ids)  # [..., k]
    s_tail = log1mexp(torch.logsumexp(s_k, -1).clamp(max=TAIL_MAX))
    t_tail = log1mexp(torch.logsumexp(t_lp, -1).clamp(max=TAIL_MAX))
    kl = (t_lp.exp() * (t_lp - s_k)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
    ce = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return kl + 0.1 * ce


CHUNK = 512


def careful_loss():
    """The same loss with the head + loss in checkpointed chunks of positions."""
    with autocast:
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, T, H]
    head = lambda h, a, b, c, m: (position_loss(model.lm_head(h), a, b, c) * m).sum()
    total = hidden.new_zeros((), dtype=torch.float32)
    for p0 in range(0, hidden.shape[1], CHUNK):
        sl = slice(p0, p0 + CHUNK)
        with autocast:
            total = total + checkpoint(head, hidden[:, sl], t_ids[:, sl], t_lp[:, sl],
                                       targets[:, sl], mask[:, sl], use_reentrant=False)
    return total / mask.sum()


def step():
    if mode == "careful":
        loss = careful_loss()
    else:
        with autocast:
            logits = model(ids).logits  # [B, T, V]
        loss = (position_loss(logits, t_ids, t_lp, targets) * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


first_loss = step()  # warm-up, on the initial weights
times = []
for _ in range(steps):
    sync()
    t0 = time.perf_counter()
    loss = step()  # .item() waits for the device
    sync()
    times.append(time.perf_counter() - t0)
tokens = int(mask.sum().item())
med = statistics.median(times)
peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print(json.dumps({"impl": f"pytorch-{mode}", "device": device, "dtype": dtype, "threads": threads,
                  "peak_bytes": peak,
                  "median_step_s": med, "tokens_per_s": ids.numel() / med, "trained_tokens": tokens,
                  "first_loss": first_loss, "last_loss": loss, "step_s": times}))
