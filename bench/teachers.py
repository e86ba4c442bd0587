"""Step time with 1, 2 and 3 teachers: an off-policy trainer against N teacher servers, every
teacher asked at once (the step should wait for the slowest teacher, not the sum).

    cargo build --release -p xdistill-server -p xdistill-trainer-cli
    python3 bench/teachers.py target/release "$(scripts/get-tokenizers.sh)"

Standard library only (STEPS=N in the environment changes the run length). Teachers: random Llama-2-vocabulary models (hidden 256 × 2 layers, each
its own seed) served with --cache-bytes 0, so every request is computed; the student: hidden 64 ×
2 layers on the same tokenizer. Each run trains STEPS steps of 8 GSM8K prompts × ≤ 128 tokens
with k = 16, in two modes:
- ensemble: every record scored by every teacher (top-k, then each teacher's log-probs at the
  union of the top-k sets: two rounds of N parallel requests);
- route: records split evenly across the teachers by a `domain` field (N parallel requests).
Prints, per (mode, N), medians over the steps after the first two: step time, the step's teacher
round trip (all its requests), and from each server's own /metrics the mean time of one of its
requests: the round trip against the slowest server's and against their sum. Record it in
bench/teachers.md.
"""
import json, os, re, statistics, subprocess, sys, tempfile, time, urllib.request

from servers import free_port, healthy, start_teacher, wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, K, PROMPTS = int(os.environ.get("STEPS", 24)), 16, 8
NAMES = ["a", "b", "c"]


def duration(port):
    """(sum of request seconds, request count) of one server's /topk_logits requests."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    num = lambda name: float(re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)", text, re.M).group(1))
    return num("xdistill_request_duration_seconds_sum"), num("xdistill_request_duration_seconds_count")


def routed_data(path, n):
    """The GSM8K sample with record i naming teacher NAMES[i % n] in `domain`."""
    src = os.path.join(ROOT, "configs", "data", "gsm8k_sample.jsonl")
    with open(path, "w") as f:
        for i, line in enumerate(l for l in open(src) if l.strip()):
            v = json.loads(line)
            v["domain"] = NAMES[i % n]
            f.write(json.dumps(v) + "\n")


def config(path, student, ports, mode, data, out):
    teachers = "".join(f"""
[[teachers]]
name = "{NAMES[i]}"
urls = ["http://127.0.0.1:{p}"]
k = {K}
max_wait_s = 120.0
""" for i, p in enumerate(ports))
    routing = 'teacher_field = "domain"\ndefault_teacher = "a"\n' if mode == "route" else ""
    open(path, "w").write(f"""
[policy]
model_name = "{student}"
max_total_sequence_length = 128
train_micro_batch_size = 8
[policy.optimizer]
lr = 1e-3
{teachers}
[loss]
kd = {{ type = "forward_kl" }}
[data]
train_path = "{data}"
prompt_field = "question"
completion_field = "answer"
truncate = true
{routing}
[distillation]
teachers = "{mode}"
num_prompts_per_step = {PROMPTS}
max_num_steps = {STEPS}
val_period = 0
val_at_start = false
val_at_end = false
[checkpointing]
enabled = false
checkpoint_dir = "{out}"
[logger]
progress_bar = false
""")


def run(bins, tmp, teachers, student, mode, n):
    data = os.path.join(tmp, f"routed-{n}.jsonl")
    routed_data(data, n)
    ports = [free_port() for _ in range(n)]
    procs = []
    try:
        for t, p in zip(teachers, ports):
            procs.append(start_teacher(bins, t, p, "--cache-bytes", "0"))
        for p in ports:
            wait(lambda: healthy(f"http://127.0.0.1:{p}"))
        out = os.path.join(tmp, f"run-{mode}-{n}")
        cfg = out + ".toml"
        config(cfg, student, ports, mode, data, out)
        subprocess.run([f"{bins}/trainer", "off-policy", "--config", cfg], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "RUST_LOG": "error"})
        steps, rtts = [], []
        for line in open(os.path.join(out, "metrics.jsonl")):
            v = json.loads(line)
            if v.get("split") == "train" and v["step"] > 2:
                steps.append(v["step_time_s"])
                rtts.append(v["teacher_latency_s"])
        # Per server: mean seconds of one request (the runs' requests are all alike).
        per = [s / max(c, 1) for s, c in (duration(p) for p in ports)]
        rounds = 2 if (mode == "ensemble" and n > 1) else 1
        return statistics.median(steps), statistics.median(rtts), max(per) * rounds, sum(per) * rounds
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def main():
    bins, tokenizers = sys.argv[1], sys.argv[2]
    tok = os.path.join(tokenizers, "llama2", "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        teachers = [os.path.join(tmp, f"teacher{i}") for i in range(3)]
        student = os.path.join(tmp, "student")
        for i, t in enumerate(teachers):
            subprocess.run([f"{bins}/trainer", "init-model", "--arch", "llama", "--tokenizer", tok,
                            "--out", t, "--hidden-size", "256", "--layers", "2", "--init-std", "0.1",
                            "--seed", str(10 + i)], check=True, stderr=subprocess.DEVNULL)
        subprocess.run([f"{bins}/trainer", "init-model", "--arch", "llama", "--tokenizer", tok,
                        "--out", student, "--hidden-size", "64", "--layers", "2"], check=True,
                       stderr=subprocess.DEVNULL)
        print(f"{os.cpu_count()} cores; teachers Llama hidden 256 × 2 layers (32k vocabulary, f32, "
              f"--cache-bytes 0); student hidden 64 × 2; {STEPS} steps of {PROMPTS} prompts × ≤ 128 "
              f"tokens, k = {K}; medians over steps 3..{STEPS}\n")
        # One untimed run first: the first run of a session measured 30-50% slower (cold caches).
        run(bins, tmp, teachers[:1], student, "route", 1)
        print("| mode | teachers | step | teacher round trip | slowest server | sum of servers |")
        print("|---|---|---|---|---|---|")
        for mode in ("ensemble", "route"):
            for n in (1, 2, 3):
                step, rtt, slowest, total = run(bins, tmp, teachers[:n], student, mode, n)
                print(f"| {mode} | {n} | {step * 1e3:.0f} ms | {rtt * 1e3:.0f} ms | "
                      f"{slowest * 1e3:.0f} ms | {total * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
