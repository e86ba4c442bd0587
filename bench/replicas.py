"""Students per replica: N concurrent off-policy trainers against 1 and 3 teacher replicas behind
HAProxy (docker/haproxy.cfg with loopback addresses), and the latency the balancer adds.

    cargo build --release -p xdistill-server -p xdistill-trainer-cli
    python3 bench/replicas.py target/release "$(scripts/get-tokenizers.sh)"

Standard library only (HAProxy from scripts/install-haproxy.sh). The teacher is a random Qwen3 of
hidden 128 with the real Qwen3 vocabulary (151k); students are hidden-32 Qwen3s on the same
tokenizer, training 20 steps each on the GSM8K sample (4 prompts × ≤ 128 tokens a step, k = 20),
each with its own data seed. Teachers run with --cache-bytes 0 so every request is computed.
Prints, per (replicas, trainers): the teachers' scored positions/s over the run, the trainers'
median step time and median teacher round trip; then the round-trip p50/p99 of one small cached
request sent 300 times directly to a replica and through HAProxy. Record it in bench/teacher.md.
"""
import json, os, re, statistics, subprocess, sys, tempfile, time, urllib.request

from servers import free_port, healthy, start_teacher, wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, K = 20, 20


def get(url, timeout=5):
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def haproxy_config(front, ports):
    out = []
    for line in open(os.path.join(ROOT, "docker", "haproxy.cfg")).read().splitlines():
        t = line.strip()
        if t == "bind :8000":
            out.append(f"    bind 127.0.0.1:{front}")
        elif t.startswith("server-template teacher"):
            out += [f"    server teacher{i} 127.0.0.1:{p} check" for i, p in enumerate(ports)]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def scored(port):
    text = get(f"http://127.0.0.1:{port}/metrics")
    m = re.search(r"^xdistill_request_tokens_scored_total(?:\{[^}]*\})? ([0-9.e+]+)", text, re.M)
    return float(m.group(1)) if m else 0.0


def config(path, student, url, out, seed):
    data = os.path.join(ROOT, "configs", "data", "gsm8k_sample.jsonl")
    open(path, "w").write(f"""
[policy]
model_name = "{student}"
max_total_sequence_length = 128
train_micro_batch_size = 4
[policy.optimizer]
lr = 1e-3
[teacher]
urls = ["{url}"]
k = {K}
max_wait_s = 120.0
[loss]
kd = {{ type = "forward_kl" }}
[data]
train_path = "{data}"
prompt_field = "question"
completion_field = "answer"
truncate = true
[distillation]
num_prompts_per_step = 4
max_num_steps = {STEPS}
seed = {seed}
val_period = 0
val_at_start = false
val_at_end = false
[checkpointing]
enabled = false
checkpoint_dir = "{out}"
[logger]
progress_bar = false
""")


def run(bins, tmp, teacher, student, replicas, trainers):
    procs, ports = [], [free_port() for _ in range(replicas)]
    try:
        for p in ports:
            procs.append(start_teacher(bins, teacher, p, "--cache-bytes", "0"))
        for p in ports:
            wait(lambda: healthy(f"http://127.0.0.1:{p}"))
        front = free_port()
        cfg = os.path.join(tmp, f"haproxy-{replicas}.cfg")
        open(cfg, "w").write(haproxy_config(front, ports))
        procs.append(subprocess.Popen(["haproxy", "-db", "-f", cfg], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{front}"
        wait(lambda: healthy(url))
        time.sleep(2.5)  # every replica marked up
        outs, runs = [], []
        before = sum(scored(p) for p in ports)
        t0 = time.time()
        for i in range(trainers):
            out = os.path.join(tmp, f"run-{replicas}-{trainers}-{i}")
            path = out + ".toml"
            config(path, student, url, out, 100 + i)
            outs.append(out)
            runs.append(subprocess.Popen([f"{bins}/trainer", "off-policy", "--config", path],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         env={**os.environ, "RUST_LOG": "error"}))
        for r in runs:
            assert r.wait() == 0, "a trainer failed"
        wall = time.time() - t0
        positions = sum(scored(p) for p in ports) - before
        steps, rtts = [], []
        for out in outs:
            for line in open(os.path.join(out, "metrics.jsonl")):
                v = json.loads(line)
                if v.get("split") == "train" and v["step"] > 2:  # past warm-up
                    steps.append(v["step_time_s"])
                    rtts.append(v["teacher_latency_s"])
        return positions / wall, statistics.median(steps), statistics.median(rtts), url, ports
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def latency(url, n=300):
    body = json.dumps({"sequences": [[9707, 11, 1879, 0, 42, 7]], "k": 5}).encode()
    req = lambda: urllib.request.urlopen(urllib.request.Request(
        url + "/topk_logits", body, {"content-type": "application/json"}), timeout=10).read()
    req()  # computed once, cached after
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        req()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)]


def main():
    bins, tokenizers = sys.argv[1], sys.argv[2]
    tok = os.path.join(tokenizers, "qwen3", "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        teacher, student = os.path.join(tmp, "teacher"), os.path.join(tmp, "student")
        for out, args in [(teacher, ["--hidden-size", "128", "--layers", "2", "--init-std", "0.1"]),
                          (student, ["--hidden-size", "32", "--layers", "2"])]:
            subprocess.run([f"{bins}/trainer", "init-model", "--arch", "qwen3", "--tokenizer", tok,
                            "--out", out, *args], check=True, stderr=subprocess.DEVNULL)
        rows = []
        for replicas in (1, 3):
            for trainers in (1, 2, 4):
                pos, step, rtt, _, _ = run(bins, tmp, teacher, student, replicas, trainers)
                rows.append((replicas, trainers, pos, step, rtt))
                print(f"{replicas} replica(s), {trainers} trainer(s): {pos:.0f} pos/s, step {step * 1e3:.0f} ms, "
                      f"teacher round trip {rtt * 1e3:.0f} ms", file=sys.stderr)
        # Balancer latency: one replica, cached request, direct vs through HAProxy.
        port = free_port()
        t = start_teacher(bins, teacher, port)
        lb = None
        try:
            direct = f"http://127.0.0.1:{port}"
            wait(lambda: healthy(direct))
            front = free_port()
            cfg = os.path.join(tmp, "haproxy-latency.cfg")
            open(cfg, "w").write(haproxy_config(front, [port]))
            lb = subprocess.Popen(["haproxy", "-db", "-f", cfg], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
            via = f"http://127.0.0.1:{front}"
            wait(lambda: healthy(via))
            time.sleep(2.5)
            d50, d99 = latency(direct)
            b50, b99 = latency(via)
        finally:
            for p in (t, lb):
                if p:
                    p.terminate()
                    p.wait()
    print(f"\n{os.cpu_count()} cores; teacher Qwen3 hidden 128 × 2 layers, 151k vocabulary, f32, "
          f"--cache-bytes 0; students hidden 32, {STEPS} steps of 4 prompts × ≤ 128 tokens, k = {K}\n")
    print("| replicas | trainers | teacher positions/s | trainer step (median) | teacher round trip (median) |")
    print("|---|---|---|---|---|")
    for r, n, pos, step, rtt in rows:
        print(f"| {r} | {n} | {pos:.0f} | {step * 1e3:.0f} ms | {rtt * 1e3:.0f} ms |")
    print(f"\nCached request, 300 round trips: direct p50 {d50:.2f} ms, p99 {d99:.2f} ms; "
          f"through HAProxy p50 {b50:.2f} ms, p99 {b99:.2f} ms "
          f"(added: p50 {b50 - d50:+.2f} ms, p99 {b99 - d99:+.2f} ms)")


if __name__ == "__main__":
    main()
