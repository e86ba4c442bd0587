"""Teacher positions/s on CPU: a Qwen3-MoE-shaped model (8 experts, top-2) vs the dense Qwen3 with
the same active parameters, and each vs transformers on the same model, in one run.

    cargo build --release -p xdistill-server -p xdistill-trainer-cli
    python bench/moe_cpu.py target/release "$(scripts/get-tokenizers.sh)" [THREADS]

Needs torch and transformers (a venv). For each model: `trainer init-model` writes it, the
`teacher` serves it on loopback and answers `/topk_logits` (k = 20, log-probs, MessagePack off:
JSON) for R requests of B sequences × T tokens (fresh ids each time, so the cache never hits);
transformers runs forward + log_softmax + topk(20) on the same sequences with the same number
of threads. The two sides alternate rounds (medians reported), so both see the same load.
Prints one table; record it in bench/teacher.md.
"""
import json, os, socket, statistics, subprocess, sys, tempfile, time, urllib.request

import torch
from transformers import AutoModelForCausalLM

B, T, R, K, ROUNDS = 2, 256, 3, 20, 3
SHAPE = ["--hidden-size", "768", "--layers", "6", "--heads", "12", "--kv-heads", "4",
         "--head-dim", "64", "--max-position-embeddings", "1024", "--init-std", "0.02", "--seed", "1"]
MODELS = {
    # 8 experts of 768 → 2 active per token: 2 × 768 = 1536 active MLP width.
    "qwen3-moe 8 experts top-2": ["--arch", "qwen3-moe", "--intermediate-size", "1536",
                                  "--experts", "8", "--experts-per-tok", "2",
                                  "--moe-intermediate-size", "768"],
    "qwen3 dense, same active": ["--arch", "qwen3", "--intermediate-size", "1536"],
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError("teacher exited")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("teacher did not become healthy")


def batches(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (B, T), generator=g).tolist() for _ in range(R + 1)]


class Ours:
    """The `teacher` serving `model_dir` on loopback."""

    def __init__(self, bin_dir, model_dir):
        port = free_port()
        self.proc = subprocess.Popen(
            [os.path.join(bin_dir, "teacher"), "--model", model_dir, "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, self.proc)

    def score(self, seqs):
        body = json.dumps({"sequences": seqs, "k": K}).encode()
        r = urllib.request.Request(self.url + "/topk_logits", body, {"content-type": "application/json"})
        return json.load(urllib.request.urlopen(r, timeout=600))

    def close(self):
        self.proc.terminate()
        self.proc.wait()


class Theirs:
    """transformers on the same directory: forward + log_softmax + topk."""

    def __init__(self, model_dir):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()

    def score(self, seqs):
        with torch.no_grad():
            lp = torch.log_softmax(self.model(torch.tensor(seqs)).logits[:, :-1].float(), dim=-1)
            torch.topk(lp, K, dim=-1)

    def close(self):
        pass


def rate(side, reqs):
    """Positions/s over `reqs` (each request a fresh set of sequences)."""
    t0 = time.perf_counter()
    for seqs in reqs:
        side.score(seqs)
    return len(reqs) * B * (T - 1) / (time.perf_counter() - t0)


def main():
    bin_dir, tokenizers = sys.argv[1], sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else os.cpu_count()
    torch.set_num_threads(threads)
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    tok = os.path.join(tokenizers, "llama2", "tokenizer.json")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, args) in enumerate(MODELS.items()):
            d = os.path.join(tmp, f"m{i}")
            subprocess.run([os.path.join(bin_dir, "trainer"), "init-model", *SHAPE, *args,
                            "--tokenizer", tok, "--out", d], check=True, stderr=subprocess.DEVNULL)
            cfg = json.load(open(os.path.join(d, "config.json")))
            ours, theirs = Ours(bin_dir, d), Theirs(d)
            try:
                # Warm both, then alternate rounds so both sides see the same load; medians.
                warm = batches(cfg["vocab_size"], 1000 + i)[0]
                ours.score(warm), theirs.score(warm)
                a_runs, b_runs = [], []
                for rnd in range(ROUNDS):
                    reqs = batches(cfg["vocab_size"], 10 * i + rnd)[1:]
                    a_runs.append(rate(ours, reqs))
                    b_runs.append(rate(theirs, reqs))
            finally:
                ours.close()
            a, b = statistics.median(a_runs), statistics.median(b_runs)
            rows.append((name, a, b))
            print(f"{name}: xdistill {a:.0f} pos/s, transformers {b:.0f} pos/s", file=sys.stderr)
    print(f"\n{threads} threads, {ROUNDS} alternating rounds of {R} requests of {B} × {T} tokens "
          f"(medians), k = {K}, f32, CPU\n")
    print("| model | xdistill teacher (pos/s) | transformers (pos/s) | ratio |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f}× |")
    moe, dense = rows[0][1], rows[1][1]
    print(f"\nMoE / dense (same active parameters), xdistill: {moe / dense:.2f}×; "
          f"transformers: {rows[0][2] / rows[1][2]:.2f}×")


if __name__ == "__main__":
    main()
