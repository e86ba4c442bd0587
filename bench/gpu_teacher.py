"""Teacher throughput on a GPU: the `teacher` server (HTTP, MessagePack answers) against PyTorch +
transformers doing the same work in-process (forward, log-softmax in f32, `torch.topk`, the target
log-prob and logsumexp, the [N, k] results copied to the host), on the same model and batches.

    python bench/gpu_teacher.py --model DIR --url http://127.0.0.1:8000 [--batch 8 --seq-len 512
        --k 64 --requests 24 --clients 4 --dtype bf16 --mixed-lengths]

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
p.add_argument("--mixed-lengths", action="store_true",
               help="each sequence of its own length, uniform in [seq-len/4, seq-len] (a new mix "
                    "every batch, as a teacher serving dataset text sees): what per-shape "
                    "compilation (cuDNN's graphs) costs shows here, never at one fixed length")
a = p.parse_args()

# Valid ids as the server counts them (the tokenizer's; LM-head rows beyond are padding, excluded
# on both sides).
with urllib.request.urlopen(f"{a.url}/v1/info", timeout=60) as r:
    info = json.loads(r.read())
vocab = info["vocab_size"]
assert info["device"].startswith("cuda"), f"teacher runs on {info['device']}"
rng = np.random.default_rng(0)


def lengths():
    if not a.mixed_lengths:
        return [a.seq_len] * a.batch
    return rng.integers(max(2, a.seq_len // 4), a.seq_len + 1, size=a.batch).tolist()


# Each batch: a list of rows (1-d int64 arrays), of one length or mixed.
batches = [[rng.integers(0, vocab, size=n, dtype=np.int64) for n in lengths()]
           for _ in range(a.requests + 1)]
# Positions scored (row p predicts token p + 1), per timed batch.
scored = [sum(len(r) - 1 for r in b) for b in batches]
timed = sum(scored[1:])
tdt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]

# ---- PyTorch -------------------------------------------------------------------------------
# transformers with PyTorch's fused attention (SDPA), as a production PyTorch scorer runs.
model = None if a.no_torch else AutoModelForCausalLM.from_pretrained(
    a.model, dtype=tdt, attn_implementation="sdpa").cuda().eval()


@torch.inference_mode()
def torch_score(rows):
    """Rows right-padded to the longest (with an attention mask where lengths differ), as a
    transformers user batches them; every position computed, the real ones returned per row."""
    t = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), t), dtype=torch.int64)
    mask = torch.zeros((len(rows), t), dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.from_numpy(r)
        mask[i, :len(r)] = 1
    ids = ids.cuda()
    same = all(len(r) == t for r in rows)
    out = model(ids) if same else model(ids, attention_mask=mask.cuda())
    logits = out.logits[:, :-1, :vocab]  # [B, T-1, V]
    lse = torch.logsumexp(logits.float(), dim=-1)  # [B, T-1]
    vals, idx = torch.topk(logits, a.k, dim=-1)  # [B, T-1, k] (order of logits = of log-probs)
    lp = vals.float() - lse.unsqueeze(-1)
    tgt = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).float() - lse
    idx, lp, tgt, lse = idx.int().cpu(), lp.cpu(), tgt.cpu(), lse.cpu()
    return [(idx[i, :len(r) - 1], lp[i, :len(r) - 1], tgt[i, :len(r) - 1], lse[i, :len(r) - 1])
            for i, r in enumerate(rows)]


if model is not None:
    ref = torch_score(batches[0])  # warm-up; kept for the comparison
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches[1:]:
        torch_score(b)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    torch_tps = timed / dt
    print(json.dumps({"impl": "pytorch+transformers (sdpa)", "dtype": a.dtype, "batch": a.batch,
                      "seq_len": a.seq_len, "mixed_lengths": a.mixed_lengths, "k": a.k,
                      "scored_tokens_per_s": round(torch_tps),
                      "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}),
          flush=True)
    del model
    torch.cuda.empty_cache()


# ---- teacher server -------------------------------------------------------------------------
def post(rows):
    body = json.dumps({"sequences": [r.tolist() for r in rows], "k": a.k}).encode()
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
ours_tps = timed / dt
spent = {name: after[name] - before[name] for name in after}
print(json.dumps({"impl": "xdistill-teacher", "label": a.label, "dtype": a.dtype, "batch": a.batch,
                  "seq_len": a.seq_len, "mixed_lengths": a.mixed_lengths, "k": a.k,
                  "clients": a.clients,
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
    t_ids, _, t_tgt, t_lse = (x.numpy() for x in ref[s])
    for p in range(rows):
        top1 += int(ids[p, 0] == t_ids[p, 0])
        overlap += len(set(ids[p].tolist()) & set(t_ids[p].tolist()))
        n += 1
    lse_err = max(lse_err, float(np.abs(lse - t_lse).max()))
    tgt_err = max(tgt_err, float(np.abs(tgt - t_tgt).max()))
print(json.dumps({"compare": "first batch", "positions": n, "top1_agreement": round(top1 / n, 4),
                  "topk_overlap": round(overlap / (n * a.k), 4), "max_abs_logsumexp_diff": lse_err,
                  "max_abs_target_logprob_diff": tgt_err,
                  "teacher_vs_torch_throughput": round(ours_tps / torch_tps, 3)}), flush=True)
