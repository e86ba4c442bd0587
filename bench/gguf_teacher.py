"""A real GGUF teacher on CPU against transformers scoring the same file, the same real text and
the same thread count, alternating rounds (the GGUF twin of bench/cpu_teacher.py).

    cargo build --release -p xdistill-server --bin teacher
    PYTHONPATH=... python bench/gguf_teacher.py target/release/teacher FILE.gguf \
        /work/shared/data/gsm8k/train.jsonl [--threads 2] [--rows 64] [--tokens 256] \
        [--rounds 3] [--k 64] [--modes dequantize,quantized]

Needs torch, transformers, numpy, msgpack and `gguf` (transformers' GGUF loader). The text is
GSM8K's questions and answers ("question\\nanswer", one after another), tokenized with the
teacher's own tokenizer (`GET /tokenizer.json`) into one stream, cut into rows of `--tokens` ids;
every request is `--rows` fresh rows (the teacher runs with `--cache-bytes 0` anyway).

Both sides compute, for every position of the rows: the forward in f32, log-softmax, the top k
(ids and log-probs), the target's log-prob and the logsumexp. The teacher answers `/topk_logits`
over HTTP (MessagePack), timed end to end, once per `--modes` entry (`--gguf-weights MODE`:
`dequantize` keeps f32 dequantized weights, `quantized` keeps the matrices quantized and runs
candle's quantized matmuls); transformers loads the file with
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (weights dequantized to f32) and
scores in-process, with `torch.set_num_threads(--threads)`.

Reported: positions/s of each side (medians of the rounds; within a round the sides run one
after another on the same rows) and, when both modes run, the gap between them over the
warm-up request's positions: max and mean |target log-prob difference|, top-1 agreement and
the mean overlap of the top-5 and top-k sets. Record the table in bench/README.md.
"""
import argparse, json, os, socket, statistics, subprocess, sys, time, urllib.request

import msgpack
import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Teacher:
    """`teacher --model FILE.gguf --gguf-weights MODE` on loopback."""

    def __init__(self, binary, path, mode, threads, k):
        port = free_port()
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        args = [binary, "--model", path, "--port", str(port), "--cache-bytes", "0",
                "--max-queue-tokens", "1048576", "--max-batch-tokens", "16384"]
        if mode != "dequantize":  # the default: an older binary without the flag still runs
            args += ["--gguf-weights", mode]
        self.k = k
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"teacher ({mode}) exited")
            try:
                self.info = json.loads(get(self.url + "/v1/info", 2))
                break
            except Exception:
                if time.time() - t0 > 300:
                    raise RuntimeError("teacher did not start")
                time.sleep(0.2)
        self.load_s = time.time() - t0

    def tokenizer(self):
        return Tokenizer.from_str(get(self.url + "/tokenizer.json").decode())

    def score(self, ids):
        """(topk ids [B, T-1, k], top-k log-probs, target log-probs [B, T-1]) as numpy."""
        body = json.dumps({"sequences": ids.tolist(), "k": self.k}).encode()
        r = urllib.request.Request(self.url + "/topk_logits", body, {
            "content-type": "application/json", "accept": "application/msgpack"})
        with urllib.request.urlopen(r, timeout=3600) as resp:
            out = msgpack.unpackb(resp.read(), raw=False)["results"]
        ids_, vals, tgt = [], [], []
        for res in out:
            rows, k = res["shape"]
            ids_.append(np.frombuffer(res["topk_ids"], "<u4").reshape(rows, k))
            vals.append(np.frombuffer(res["topk_values"], "<f4").reshape(rows, k))
            tgt.append(np.frombuffer(res["target_logprobs"], "<f4"))
        return np.stack(ids_), np.stack(vals), np.stack(tgt)

    def close(self):
        self.proc.terminate()
        self.proc.wait()


class Torch:
    """transformers on the same GGUF file (dequantized to f32): the same outputs, in-process."""

    def __init__(self, path, vocab, k):
        t0 = time.time()
        d, f = os.path.split(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32).eval()
        self.load_s = time.time() - t0
        self.vocab, self.k = vocab, k

    @torch.inference_mode()
    def score(self, ids):
        ids = torch.as_tensor(ids)
        logits = self.model(ids).logits[:, :-1, :self.vocab].float()  # [B, T-1, V]
        lse = torch.logsumexp(logits, dim=-1)  # [B, T-1]
        vals, idx = torch.topk(logits, self.k, dim=-1)  # [B, T-1, k]
        lp = vals - lse.unsqueeze(-1)
        tgt = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse
        return idx.int().numpy(), lp.numpy(), tgt.numpy()


def rows_of_text(tok, jsonl, rows, tokens):
    """`rows` × `tokens` ids of GSM8K questions and answers, one stream cut into rows."""
    stream = []
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            stream += tok.encode(r["question"] + "\n" + r["answer"] + "\n\n").ids
            if len(stream) >= rows * tokens:
                break
    if len(stream) < rows * tokens:
        sys.exit(f"{jsonl} holds {len(stream)} tokens, {rows * tokens} wanted")
    return np.array(stream[:rows * tokens], dtype=np.int64).reshape(rows, tokens)


def gap(a, b, k):
    """How far side `b`'s scores are from side `a`'s over the same rows."""
    (ia, va, ta), (ib, vb, tb) = a, b
    d = np.abs(ta.astype(np.float64) - tb.astype(np.float64))
    ia, ib = ia.reshape(-1, k), ib.reshape(-1, k)
    top5 = [len(set(x[:5]) & set(y[:5])) / 5 for x, y in zip(ia, ib)]
    topk = [len(set(x) & set(y)) / k for x, y in zip(ia, ib)]
    return {"positions": int(d.size), "max_target": float(d.max()), "mean_target": float(d.mean()),
            "top1_equal": float(np.mean(ia[:, 0] == ib[:, 0])), "top5_overlap": float(np.mean(top5)),
            "topk_overlap": float(np.mean(topk))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("teacher")
    p.add_argument("gguf")
    p.add_argument("gsm8k")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--modes", default="dequantize", help="comma-separated --gguf-weights modes")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    sides = {}
    try:
        for m in modes:
            sides[f"teacher {m}"] = Teacher(a.teacher, a.gguf, m, a.threads, a.k)
        first = sides[f"teacher {modes[0]}"]
        tok, vocab = first.tokenizer(), first.info["vocab_size"]
        sides["transformers"] = Torch(a.gguf, vocab, a.k)
        print("load s: " + json.dumps({n: round(s.load_s, 1) for n, s in sides.items()}),
              file=sys.stderr, flush=True)
        data = rows_of_text(tok, a.gsm8k, a.rows * (a.rounds + 1), a.tokens)
        batches = [data[i * a.rows:(i + 1) * a.rows] for i in range(a.rounds + 1)]
        positions = a.rows * (a.tokens - 1)
        warm = {n: s.score(batches[0]) for n, s in sides.items()}  # warm-up; gaps from it
        runs = {n: [] for n in sides}
        for r, ids in enumerate(batches[1:]):
            # Alternate the order each round so neither side always runs first.
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for n in order:
                t0 = time.perf_counter()
                sides[n].score(ids)
                runs[n].append(positions / (time.perf_counter() - t0))
            print(f"round {r}: " + json.dumps({n: round(v[-1]) for n, v in runs.items()}),
                  file=sys.stderr, flush=True)
    finally:
        for s in sides.values():
            if isinstance(s, Teacher):
                s.close()
    med = {n: statistics.median(v) for n, v in runs.items()}
    print(f"\n{a.threads} threads each, {a.rounds} alternating rounds (medians) of "
          f"{a.rows} rows × {a.tokens} tokens of GSM8K text, k = {a.k}, f32 activations\n")
    print("| side | weights | positions/s | vs transformers | load (s) |")
    print("|---|---|---|---|---|")
    for n, s in sides.items():
        w = s.info["weights"] if isinstance(s, Teacher) else "GGUF dequantized to f32"
        print(f"| {n} | {w} | {med[n]:.0f} | {med[n] / med['transformers']:.2f}× "
              f"| {s.load_s:.1f} |")
    print()
    for n in sides:
        if n != "transformers":
            g = gap(warm["transformers"], warm[n], a.k)
            print(f"{n} vs transformers: {json.dumps(g)}")
    if len(modes) > 1:
        g = gap(warm[f"teacher {modes[0]}"], warm[f"teacher {modes[1]}"], a.k)
        print(f"teacher {modes[1]} vs teacher {modes[0]}: {json.dumps(g)}")


if __name__ == "__main__":
    main()
