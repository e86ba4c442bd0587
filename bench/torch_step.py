"""PyTorch eager reference for the student training step (outside CI).

Runs the same step as `trainer bench-step`, which runs this script itself with `--python` (CPU
comparison) or writes the batch with `--write-batch BATCH.safetensors` (GPU check): the same
model directory, the same batch (read from the safetensors file the Rust side writes), the same loss (forward KL over
the teacher's top-k with a tail bucket, temperature 1, plus 0.1 x CE on the targets), AdamW
(lr 1e-4, wd 0.01), gradient-norm clipping at 1.0, and prints one JSON line: the median step
time, every timed step's time and the first (warm-up) step's loss, which the Rust side compares
with its own.

    python bench/torch_step.py MODEL_DIR BATCH.safetensors STEPS THREADS [DEVICE [DTYPE]]

DEVICE is cpu (default) or cuda; DTYPE f32 (default) or bf16. bf16 is mixed precision as the Rust
side does it: f32 parameters (the masters AdamW updates) and a bf16 forward/backward through
`torch.autocast`; the loss is computed in f32 from the logits either way.
"""
import json, math, statistics, sys, time
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

model_dir, batch_path = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
threads = int(sys.argv[4]) if len(sys.argv) > 4 else torch.get_num_threads()
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
dtype = sys.argv[6] if len(sys.argv) > 6 else "f32"
torch.set_num_threads(threads)
b = load_file(batch_path)
ids, targets, mask = (b["ids"].long().to(device), b["targets"].long().to(device),
                      b["mask"].float().to(device))
t_ids, t_lp = b["teacher_ids"].long().to(device), b["teacher_logprobs"].float().to(device)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
model.train()
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


def step():
    with autocast:
        logits = model(ids).logits  # [B, T, V]
    lp = torch.log_softmax(logits.float(), dim=-1)
    s_k = lp.gather(-1, t_ids)  # [B, T, k]
    s_tail = log1mexp(torch.logsumexp(s_k, -1).clamp(max=TAIL_MAX))
    t_tail = log1mexp(torch.logsumexp(t_lp, -1).clamp(max=TAIL_MAX))
    kl = (t_lp.exp() * (t_lp - s_k)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
    ce = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    n = mask.sum()
    loss = ((kl + 0.1 * ce) * mask).sum() / n
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
print(json.dumps({"impl": "pytorch-eager", "device": device, "dtype": dtype, "threads": threads,
                  "median_step_s": med, "tokens_per_s": ids.numel() / med, "trained_tokens": tokens,
                  "first_loss": first_loss, "last_loss": loss, "step_s": times}))
