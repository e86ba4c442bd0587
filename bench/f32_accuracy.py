"""How exact the f32 teacher's scores are (issue 49): the teacher at each SIMD level and
transformers in f32, each against an f64 forward of the same weights (transformers in f64), on a
real GGUF model and real text.

    cargo build --release -p xdistill-server --bin teacher
    python bench/f32_accuracy.py target/release/teacher FILE.gguf \
        /work/shared/data/gsm8k/train.jsonl [--rows 2] [--tokens 145] [--k 20] \
        [--simd avx512,avx2,baseline] [--threads 2]

Needs torch, transformers, numpy, msgpack and `gguf`. The text is GSM8K's questions and answers
(one stream cut into `--rows` rows of `--tokens` ids, tokenized with the teacher's own tokenizer);
the teacher loads the file with its default `--gguf-weights dequantize` (f32), transformers with
`gguf_file=` (dequantized to f32), the reference is that model cast to f64. Per side, over every
position: the worst absolute error of the top-k log-probs (at the side's own top-k ids, against
the f64 log-probs at those ids), of the target log-probs and of the logsumexps; one teacher per
`$XDISTILL_SIMD` level in `--simd`. Record the table in bench/README.md.
"""
import argparse, json, os, sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_teacher import Teacher, rows_of_text  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


class SimdTeacher(Teacher):
    """A teacher capped at one SIMD level (`$XDISTILL_SIMD`), returning the logsumexps too."""

    def __init__(self, binary, path, level, threads, k):
        old = os.environ.get("XDISTILL_SIMD")
        os.environ["XDISTILL_SIMD"] = level
        try:
            super().__init__(binary, path, "dequantize", threads, k)
        finally:
            if old is None:
                os.environ.pop("XDISTILL_SIMD")
            else:
                os.environ["XDISTILL_SIMD"] = old

    def score_all(self, ids):
        """(top-k ids [B, T-1, k], top-k log-probs, target log-probs [B, T-1], logsumexps)."""
        import msgpack
        import urllib.request
        body = json.dumps({"sequences": ids.tolist(), "k": self.k}).encode()
        r = urllib.request.Request(self.url + "/topk_logits", body, {
            "content-type": "application/json", "accept": "application/msgpack"})
        with urllib.request.urlopen(r, timeout=3600) as resp:
            out = msgpack.unpackb(resp.read(), raw=False)["results"]
        f = lambda res, key: np.frombuffer(res[key], "<f4")
        ids_ = np.stack([np.frombuffer(res["topk_ids"], "<u4").reshape(res["shape"]) for res in out])
        vals = np.stack([f(res, "topk_values").reshape(res["shape"]) for res in out])
        return ids_, vals, np.stack([f(res, "target_logprobs") for res in out]), \
            np.stack([f(res, "logsumexp") for res in out])


@torch.inference_mode()
def torch_scores(model, ids, vocab, k):
    """The same four outputs from transformers, in the model's dtype."""
    ids = torch.as_tensor(ids)
    logits = model(ids).logits[:, :-1, :vocab]
    lse = torch.logsumexp(logits, dim=-1)
    vals, idx = torch.topk(logits, k, dim=-1)
    tgt = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse
    return idx.numpy(), (vals - lse.unsqueeze(-1)).numpy(), tgt.numpy(), lse.numpy(), \
        (logits - lse.unsqueeze(-1)).numpy()


def errors(side, ref_lp, ref_tgt, ref_lse):
    """Worst |side − f64| of the top-k log-probs (at the side's ids), target log-probs, lses."""
    ids, vals, tgt, lse = side
    at = np.take_along_axis(ref_lp, ids.astype(np.int64), axis=-1)
    e = {"topk": float(np.abs(vals.astype(np.float64) - at).max()),
         "target": float(np.abs(tgt.astype(np.float64) - ref_tgt).max()),
         "logsumexp": float(np.abs(lse.astype(np.float64) - ref_lse).max())}
    e["worst"] = max(e.values())
    return e


def main():
    p = argparse.ArgumentParser()
    p.add_argument("teacher")
    p.add_argument("gguf")
    p.add_argument("gsm8k")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=145)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--simd", default="avx512,avx2,baseline")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    results = {}
    first = SimdTeacher(a.teacher, a.gguf, "avx512", a.threads, a.k)
    try:
        tok, vocab = first.tokenizer(), first.info["vocab_size"]
    finally:
        first.close()
    ids = rows_of_text(tok, a.gsm8k, a.rows, a.tokens)
    d, f = os.path.split(a.gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    f32 = torch_scores(model, ids, vocab, a.k)
    _, _, ref_tgt, ref_lse, ref_lp = torch_scores(model.double(), ids, vocab, a.k)
    del model
    results["transformers f32"] = errors(f32[:4], ref_lp, ref_tgt, ref_lse)
    for level in a.simd.split(","):
        t = SimdTeacher(a.teacher, a.gguf, level, a.threads, a.k)
        try:
            results[f"teacher XDISTILL_SIMD={level}"] = errors(
                t.score_all(ids), ref_lp, ref_tgt, ref_lse)
        finally:
            t.close()
    base = results["transformers f32"]["worst"]
    print(f"\n{ids.size - a.rows} positions ({a.rows} rows × {a.tokens} tokens of GSM8K text), "
          f"k = {a.k}; worst |error| against the f64 forward\n")
    print("| side | top-k log-probs | target log-probs | logsumexps | worst | vs transformers-f32 |")
    print("|---|---|---|---|---|---|")
    for n, e in results.items():
        print(f"| {n} | {e['topk']:.2e} | {e['target']:.2e} | {e['logsumexp']:.2e} "
              f"| {e['worst']:.2e} | {e['worst'] / base:.2f}× |")


if __name__ == "__main__":
    main()
