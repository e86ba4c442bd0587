"""Teacher scoring on CPU against PyTorch + transformers doing the same work in-process, on the
same model directory and batches, same thread count, alternating rounds (the CPU twin of
bench/gpu_teacher.py).

    cargo build --release -p xdistill-server -p xdistill-trainer-cli
    python bench/cpu_teacher.py target/release "$(scripts/get-tokenizers.sh)" [--threads 2]
        [--rounds 3] [--requests 3] [--rss]

Both sides compute, for every position of B sequences × T tokens (fresh random ids each request,
so the teacher's cache never hits): the forward, log-softmax in f32, the top k = 64 (ids and
log-probs), the target's log-prob and the logsumexp. The teacher answers `/topk_logits` over HTTP
(MessagePack), run twice: with the fused LM head (`--lm-head fused`, the default) and with the
full logits (`--lm-head full`, the path before the fused head). Models: Qwen3 shapes with the real
Qwen3 vocabulary (151,669 ids), f32, written by `trainer init-model`.

Reported per model: positions/s of each side (medians of alternating rounds) and their ratios;
from the teacher's own /metrics, the share of the worker's time outside the forward (the scoring
pass; with the fused head the tile matmuls count as forward) and the scoring pass's ns per logit
(scoring seconds / (positions × vocabulary)). `--rss` (`--rss-only`: nothing else): the teacher's
RSS once loaded, and its peak RSS (VmHWM, reset after loading) while it scores one request of
8 × 2048 tokens, fused vs full, each in a fresh process. Prints a Markdown table;
record it in bench/teacher.md.
"""
import argparse, json, os, socket, statistics, subprocess, sys, tempfile, time, urllib.request

import msgpack
import torch
from transformers import AutoModelForCausalLM

K = 64
MODELS = {
    # name: (init-model shape, batch B × T)
    "hidden 128, 2 layers": (["--hidden-size", "128", "--layers", "2", "--heads", "4",
                              "--kv-heads", "2", "--intermediate-size", "256"], 8, 128),
    "hidden 1024, 4 layers": (["--hidden-size", "1024", "--layers", "4", "--heads", "16",
                               "--kv-heads", "8", "--intermediate-size", "3072"], 4, 128),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Teacher:
    """The `teacher` serving `model_dir` on loopback with `--lm-head lm_head`."""

    def __init__(self, bin_dir, model_dir, lm_head, threads):
        port = free_port()
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(
            [os.path.join(bin_dir, "teacher"), "--model", model_dir, "--port", str(port),
             "--lm-head", lm_head, "--cache-bytes", "0", "--max-queue-tokens", "65536",
             "--max-batch-tokens", "16384"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("teacher exited")
            try:
                if json.loads(get(self.url + "/v1/info", 2)).get("vocab_size"):
                    break
            except Exception:
                if time.time() - t0 > 300:
                    raise RuntimeError("teacher did not start")
                time.sleep(0.2)

    def score(self, ids):
        body = json.dumps({"sequences": ids.tolist(), "k": K}).encode()
        r = urllib.request.Request(self.url + "/topk_logits", body, {
            "content-type": "application/json", "accept": "application/msgpack"})
        with urllib.request.urlopen(r, timeout=1200) as resp:
            return msgpack.unpackb(resp.read(), raw=False)

    def worker_seconds(self):
        """(model, scoring) seconds so far, from /metrics: the forward and the LM head's
        matmul, then top-k and the cast/copy of the logits."""
        text = get(self.url + "/metrics").decode()
        val = {}
        for line in text.splitlines():
            name, _, v = line.partition(" ")
            val[name] = v
        phase = lambda p: float(val.get(f"xdistill_batch_{p}_duration_seconds_sum", 0))
        return (phase("forward") + phase("head"), phase("topk") + phase("copy"))

    def status_mib(self, field):
        """`VmRSS` / `VmHWM` (the peak since start or since `reset_peak`) in MiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024

    def reset_peak(self):
        """Lower VmHWM to the current RSS (Linux `clear_refs` 5): the load's own peak (the file
        read beside the weights being built) is then left out."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")

    def close(self):
        self.proc.terminate()
        self.proc.wait()


class Torch:
    """transformers on the same directory: the same five outputs, in-process."""

    def __init__(self, model_dir, vocab):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.vocab = vocab

    @torch.inference_mode()
    def score(self, ids):
        logits = self.model(ids).logits[:, :-1, :self.vocab].float()  # [B, T-1, V]
        lse = torch.logsumexp(logits, dim=-1)  # [B, T-1]
        vals, idx = torch.topk(logits, K, dim=-1)  # [B, T-1, k]
        lp = vals - lse.unsqueeze(-1)
        tgt = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse
        return idx.int(), lp, tgt, lse


def rate(side, reqs, positions):
    t0 = time.perf_counter()
    for ids in reqs:
        side.score(ids)
    return len(reqs) * positions / (time.perf_counter() - t0)


def bench_model(a, name, model_dir, b, t, vocab):
    gen = torch.Generator().manual_seed(0)
    fresh = lambda: torch.randint(0, vocab, (b, t), generator=gen)  # noqa: E731
    positions = b * (t - 1)
    sides = {"fused": Teacher(a.bin, model_dir, "fused", a.threads),
             "full": Teacher(a.bin, model_dir, "full", a.threads),
             "torch": Torch(model_dir, vocab)}
    try:
        for s in sides.values():  # warm-up
            s.score(fresh())
        before = {n: sides[n].worker_seconds() for n in ("fused", "full")}
        runs = {n: [] for n in sides}
        for _ in range(a.rounds):
            reqs = [fresh() for _ in range(a.requests)]
            for n, s in sides.items():
                runs[n].append(rate(s, reqs, positions))
        after = {n: sides[n].worker_seconds() for n in ("fused", "full")}
    finally:
        for n in ("fused", "full"):
            sides[n].close()
    med = {n: statistics.median(r) for n, r in runs.items()}
    scored = a.rounds * a.requests * positions
    split = {}
    for n in ("fused", "full"):
        fwd = after[n][0] - before[n][0]
        sc = after[n][1] - before[n][1]
        split[n] = (sc / (fwd + sc), sc * 1e9 / (scored * vocab))
    print(f"{name}: {json.dumps({'pos_per_s': {n: round(v) for n, v in med.items()}})}",
          file=sys.stderr, flush=True)
    return med, split


def peak_rss(a, model_dir, vocab, lm_head):
    """(RSS once loaded, peak RSS while scoring one 8 × 2048-token request) in MiB."""
    s = Teacher(a.bin, model_dir, lm_head, a.threads)
    try:
        loaded = s.status_mib("VmRSS")
        s.reset_peak()
        s.score(torch.randint(0, vocab, (8, 2048), generator=torch.Generator().manual_seed(1)))
        return loaded, s.status_mib("VmHWM")
    finally:
        s.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bin")
    p.add_argument("tokenizers")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--rss", action="store_true", help="peak RSS at an 8 × 2048-token batch")
    p.add_argument("--rss-only", action="store_true", help="only the RSS figures")
    p.add_argument("--only", help="run only the model whose name contains this")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = os.path.join(a.tokenizers, "qwen3", "tokenizer.json")
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (shape, b, t)) in enumerate(MODELS.items()):
            if a.only and a.only not in name:
                continue
            d = os.path.join(tmp, f"m{i}")
            subprocess.run([os.path.join(a.bin, "trainer"), "init-model", "--arch", "qwen3",
                            *shape, "--max-position-embeddings", "4096", "--init-std", "0.1",
                            "--seed", "1", "--tokenizer", tok, "--out", d],
                           check=True, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            vocab = 151_669
            rss = None
            if a.rss or a.rss_only:
                rss = {n: peak_rss(a, d, vocab, n) for n in ("full", "fused")}
                print(f"{name}: RSS loaded, peak scoring 8 x 2048 (MiB): {rss}", file=sys.stderr)
            if a.rss_only:
                continue
            med, split = bench_model(a, name, d, b, t, vocab)
            table.append((name, b, t, med, split, rss))
    print(f"\n{a.threads} threads each, {a.rounds} alternating rounds of {a.requests} requests "
          f"(medians), k = {K}, f32, Qwen3 vocabulary\n")
    print("| model | batch | teacher fused (pos/s) | teacher full | PyTorch | fused / PyTorch "
          "| full / PyTorch | scoring share fused / full | scoring ns per logit fused / full "
          "| RSS loaded; peak scoring 8 × 2048, full → fused |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, b, t, med, split, rss in table:
        r = (f"{rss['fused'][0]:.0f}; {rss['full'][1]:.0f} → {rss['fused'][1]:.0f} MiB"
             if rss else "—")
        print(f"| {name} | {b} × {t} | {med['fused']:.0f} | {med['full']:.0f} | {med['torch']:.0f} "
              f"| **{med['fused'] / med['torch']:.2f}×** | {med['full'] / med['torch']:.2f}× "
              f"| {split['fused'][0]:.1%} / {split['full'][0]:.1%} "
              f"| {split['fused'][1]:.2f} / {split['full'][1]:.2f} | {r} |")


if __name__ == "__main__":
    main()
