"""Teacher throughput on a GPU: the `teacher` server (HTTP, MessagePack answers) against PyTorch +
transformers doing the same work in-process (forward, log-softmax in f32, `torch.topk`, the target
log-prob and logsumexp, the [N, k] results copied to the host), on the same model and batches.

    python bench/gpu_teacher.py --model DIR --url http://127.0.0.1:8000 [--batch 8 --seq-len 512
        --k 64 --requests 24 --clients 4 --dtype bf16]

Prints one JSON line per side, one with where the server's time went (forward, LM head, top-k,
device-to-host copy, encoding, the worker's other work and its idle time, from `/metrics`), and
one comparing the answers of the first batch (both in the same dtype, so differences are the
rounding of two bf16 implementations).
"""
import argparse, json, time, threading, urllib.request
import numpy as np
import msgpack
import torch
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--url", required=True)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq-len", type=int, default=512)
p.add_argument("--k", type=int, default=64)
p.add_argument("--requests", type=int, default=24, help="batches per side (after one warm-up)")
p.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients")
p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
p.add_argument("--no-torch", action="store_true",
               help="only the teacher (PyTorch's side was measured by an earlier call)")
p.add_argument("--label", default="", help="a tag for the teacher's lines (e.g. its mode)")
a = p.parse_args()

# Valid ids as the server counts them (the tokenizer's; LM-head rows beyond are padding, excluded
# on both sides).
with urllib.request.urlopen(f"{a.url}/v1/info", timeout=60) as r:
    info = json.loads(r.read())
vocab = info["vocab_size"]
assert info["device"].startswith("cuda"), f"teacher runs on {info['device']}"
rng = np.random.default_rng(0)
batches = [rng.integers(0, vocab, size=(a.batch, a.seq_len), dtype=np.int64)
           for _ in range(a.requests + 1)]
scored = a.batch * (a.seq_len - 1)  # positions scored per batch (row p predicts token p + 1)
tdt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]

# ---- PyTorch -------------------------------------------------------------------------------
# transformers with PyTorch's fused attention (SDPA), as a production PyTorch scorer runs.
model = None if a.no_torch else AutoModelForCausalLM.from_pretrained(
    a.model, dtype=tdt, attn_implementation="sdpa").cuda().eval()


@torch.inference_mode()
def torch_score(ids_np):
    ids = torch.from_numpy(ids_np).cuda()
    logits = model(ids).logits[:, :-1, :vocab]  # [B, T-1, V]
    lse = torch.logsumexp(logits.float(), dim=-1)  # [B, T-1]
    vals, idx = torch.topk(logits, a.k, dim=-1)  # [B, T-1, k] (order of logits = of log-probs)
    lp = vals.float() - lse.unsqueeze(-1)
    tgt = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).float() - lse
    return idx.int().cpu(), lp.cpu(), tgt.cpu(), lse.cpu()


if model is not None:
    ref = torch_score(batches[0])  # warm-up; kept for the comparison
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches[1:]:
        torch_score(b)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    torch_tps = a.requests * scored / dt
    print(json.dumps({"impl": "pytorch+transformers (sdpa)", "dtype": a.dtype, "batch": a.batch,
                      "seq_len": a.seq_len, "k": a.k, "scored_tokens_per_s": round(torch_tps),
                      "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}),
          flush=True)
    del model
    torch.cuda.empty_cache()


# ---- teacher server -------------------------------------------------------------------------
def post(ids_np):
    body = json.dumps({"sequences": ids_np.tolist(), "k": a.k}).encode()
    req = urllib.request.Request(f"{a.url}/topk_logits", data=body, headers={
        "content-type": "application/json", "accept": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return msgpack.unpackb(r.read(), raw=False)


def arr(blob, dtype, shape):
    return np.frombuffer(blob, dtype=dtype).reshape(shape)


first = post(batches[0])  # warm-up; kept for the comparison
todo = list(range(1, a.requests + 1))
lock = threading.Lock()


def client():
    while True:
        with lock:
            if not todo:
                return
            i = todo.pop()
        post(batches[i])


PHASES = ("forward", "head", "topk", "copy")


def server_seconds():
    """Seconds the server has spent so far in each phase (its /metrics sums; each phase ends
    with a device synchronisation), its batches' wall time and its requests' durations."""
    with urllib.request.urlopen(f"{a.url}/metrics", timeout=60) as r:
        val = dict(line.split(" ", 1) for line in r.read().decode().splitlines()
                   if line and not line.startswith("#"))
    get = lambda name: float(val.get(name, 0))
    out = {p: get(f"xdistill_batch_{p}_duration_seconds_sum") for p in PHASES}
    out["encode"] = get("xdistill_response_encode_duration_seconds_sum")
    out["batches"] = get("xdistill_batch_duration_seconds_sum")
    out["requests"] = get("xdistill_request_duration_seconds_sum")
    return out


threads = [threading.Thread(target=client) for _ in range(a.clients)]
before = server_seconds()
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join()
dt = time.perf_counter() - t0
after = server_seconds()
ours_tps = a.requests * scored / dt
spent = {name: after[name] - before[name] for name in after}
print(json.dumps({"impl": "xdistill-teacher", "label": a.label, "dtype": a.dtype, "batch": a.batch,
                  "seq_len": a.seq_len, "k": a.k, "clients": a.clients,
                  "scored_tokens_per_s": round(ours_tps)}), flush=True)
# Where the server's time went: each phase's share of the run's wall time (the worker is one
# thread, so its phases add up to at most 1; encoding runs on other threads, beside it).
print(json.dumps({"phases": "xdistill-teacher", "label": a.label, "wall_s": round(dt, 3),
                  **{f"{p}_share": round(spent[p] / dt, 4) for p in PHASES + ("encode",)},
                  "worker_other_share": round((spent["batches"] - sum(spent[p] for p in PHASES)) / dt, 4),
                  "worker_idle_share": round(1 - spent["batches"] / dt, 4)}), flush=True)

# ---- agreement on the first batch -----------------------------------------------------------
if a.no_torch:
    raise SystemExit(0)
res = first["results"]
top1 = overlap = 0
lse_err = tgt_err = 0.0
n = 0
for s, r in enumerate(res):
    rows, k = r["shape"]
    ids = arr(r["topk_ids"], "<u4", (rows, k))
    lse = arr(r["logsumexp"], "<f4", (rows,))
    tgt = arr(r["target_logprobs"], "<f4", (rows,))
    t_ids = ref[0][s].numpy()
    for p in range(rows):
        top1 += int(ids[p, 0] == t_ids[p, 0])
        overlap += len(set(ids[p].tolist()) & set(t_ids[p].tolist()))
        n += 1
    lse_err = max(lse_err, float(np.abs(lse - ref[3][s].numpy()).max()))
    tgt_err = max(tgt_err, float(np.abs(tgt - ref[2][s].numpy()).max()))
print(json.dumps({"compare": "first batch", "positions": n, "top1_agreement": round(top1 / n, 4),
                  "topk_overlap": round(overlap / (n * a.k), 4), "max_abs_logsumexp_diff": lse_err,
                  "max_abs_target_logprob_diff": tgt_err,
                  "teacher_vs_torch_throughput": round(ours_tps / torch_tps, 3)}), flush=True)
