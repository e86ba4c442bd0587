"""PyTorch reference for an on-policy rollout's generation (outside CI): the tokens/s of
transformers' `generate` on the same model and prompts as `trainer eval --samples 0` (issue 47
item 7), for `scripts/gpu-check.sh` step r.

    python bench/torch_rollout.py MODEL_DIR PROMPTS.jsonl ROWS NEW_TOKENS [DEVICE [DTYPE]]

The first ROWS records of the JSONL (GSM8K's `question`, or `prompt`) in the template `trainer
eval` uses (`Q: {question}\nA:`), left-padded into one batch, greedy, exactly NEW_TOKENS new
tokens per row (min = max, so an early EOS does not shorten the run), with the KV cache. One
warm-up run of 8 tokens, then the timed one. Prints one JSON line: rows, generated tokens,
seconds, tokens/s, peak device memory (MiB).
"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

model_dir, prompts_path = sys.argv[1], sys.argv[2]
rows, new_tokens = int(sys.argv[3]), int(sys.argv[4])
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[6] if len(sys.argv) > 6 else "f32"]

prompts = []
for line in open(prompts_path):
    if line.strip():
        r = json.loads(line)
        prompts.append(r["prompt"] if "prompt" in r else f"Q: {r['question'].strip()}\nA:")
    if len(prompts) == rows:
        break
tok = PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json")
tok.pad_token = tok.pad_token or tok.eos_token or tok.convert_ids_to_tokens(0)
tok.padding_side = "left"
batch = tok(prompts, return_tensors="pt", padding=True).to(device)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run(n):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=tok.pad_token_id)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out.shape[1] - batch["input_ids"].shape[1], time.perf_counter() - t0


run(8)
if device.startswith("cuda"):
    torch.cuda.reset_peak_memory_stats()
made, secs = run(new_tokens)
peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
print(json.dumps({"rows": len(prompts), "prompt_tokens": int(batch["input_ids"].shape[1]),
                  "generated_tokens": made * len(prompts), "seconds": round(secs, 3),
                  "tokens_per_s": round(made * len(prompts) / secs, 1), "peak_mib": peak}))
