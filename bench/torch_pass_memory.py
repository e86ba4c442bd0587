"""PyTorch's careful student forward + backward at one sequence length, for the memory
comparison in bench/step_memory.py (outside CI).

The same step as `shared/examples/train_pass_memory.rs`: one row of T ids from the same LCG,
next-token cross-entropy, f32 weights, done the way careful PyTorch trainers do it: SDPA
attention, gradient checkpointing of every decoder layer, and the LM head + loss in chunks of
HEAD_ROWS positions under torch.utils.checkpoint (each chunk's [n, V] logits recomputed in the
backward instead of kept). Prints one JSON line with the peak RSS (ru_maxrss) and the step time.

    python bench/torch_pass_memory.py MODEL_DIR T [HEAD_ROWS [THREADS]]
"""
import json, resource, sys, time
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM


def rss_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


model_dir, t = sys.argv[1], int(sys.argv[2])
head_rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
if len(sys.argv) > 4:
    torch.set_num_threads(int(sys.argv[4]))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
model.train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.config.use_cache = False
v = model.config.vocab_size
s, ids = 7, []
for _ in range(t):
    s = (s * 6364136223846793005 + 1) % (1 << 64)
    ids.append((s >> 33) % v)
ids = torch.tensor([ids])
base = rss_mib("VmRSS")
start = time.perf_counter()
hidden = model.model(input_ids=ids).last_hidden_state[0]  # [T, H]
head = model.lm_head
n = t - 1


def chunk_loss(h, tgt):
    return F.cross_entropy(head(h).float(), tgt, reduction="sum")


loss = 0.0
total = torch.zeros(())
for r0 in range(0, n, head_rows):
    r = min(head_rows, n - r0)
    total = total + checkpoint(chunk_loss, hidden[r0:r0 + r], ids[0, r0 + 1:r0 + 1 + r], use_reentrant=False)
total = total / n
total.backward()
step_s = time.perf_counter() - start
print(json.dumps({"impl": "pytorch", "seq_len": t, "mode": "sdpa+checkpoint+chunked-head",
                  "head_rows": head_rows, "base_rss_mib": round(base, 1),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "step_s": round(step_s, 3), "loss": round(total.item(), 6)}))
