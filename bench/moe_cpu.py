"""Teacher positions/s on CPU: a Qwen3-MoE-shaped model (8 experts, top-2) vs the dense Qwen3 with
the same active parameters, and each vs transformers on the same model, in one run.

    cargo build --release -p xdistill-server -p xdistill-trainer
    python bench/moe_cpu.py target/release "$(scripts/get-tokenizers.sh)" [THREADS]

Needs torch and transformers (a venv). For each model: `trainer init-model` writes it, the
`teacher` serves it on loopback and answers `/topk_logits` (k = 20, log-probs, MessagePack off:
JSON) for R requests of B sequences × T tokens (fresh ids each time, so the cache never hits);
transformers runs forward + log_softmax + topk(20) on the same sequences with the same number
of threads. Prints one table; record it in bench/teacher.md.
"""
import json, os, socket, subprocess, sys, tempfile, time, urllib.request

import torch
from transformers import AutoModelForCausalLM

B, T, R, K = 2, 256, 4, 20
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


def ours(bin_dir, model_dir, reqs):
    port = free_port()
    proc = subprocess.Popen([os.path.join(bin_dir, "teacher"), "--model", model_dir, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        def post(seqs):
            body = json.dumps({"sequences": seqs, "k": K}).encode()
            r = urllib.request.Request(url + "/topk_logits", body, {"content-type": "application/json"})
            return json.load(urllib.request.urlopen(r, timeout=600))
        post(reqs[0])  # warm-up
        t0 = time.perf_counter()
        for seqs in reqs[1:]:
            post(seqs)
        return R * B * (T - 1) / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait()


def transformers_rate(model_dir, reqs):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    def run(seqs):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor(seqs)).logits[:, :-1].float(), dim=-1)
            torch.topk(lp, K, dim=-1)
    run(reqs[0])
    t0 = time.perf_counter()
    for seqs in reqs[1:]:
        run(seqs)
    return R * B * (T - 1) / (time.perf_counter() - t0)


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
            reqs = batches(cfg["vocab_size"], i)
            a = ours(bin_dir, d, reqs)
            b = transformers_rate(d, reqs)
            rows.append((name, a, b))
            print(f"{name}: xdistill {a:.0f} pos/s, transformers {b:.0f} pos/s", file=sys.stderr)
    print(f"\n{threads} threads, {R} requests of {B} × {T} tokens, k = {K}, f32, CPU\n")
    print("| model | xdistill teacher (pos/s) | transformers (pos/s) | ratio |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f}× |")
    moe, dense = rows[0][1], rows[1][1]
    print(f"\nMoE / dense (same active parameters), xdistill: {moe / dense:.2f}×; "
          f"transformers: {rows[0][2] / rows[1][2]:.2f}×")


if __name__ == "__main__":
    main()
