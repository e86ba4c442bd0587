"""Data-parallel step time on this machine's CPU: 1, 2 and 4 `trainer sft` processes on loopback
(the TCP backend), the collectives' share of the step and the bytes each rank moves, peak RSS per
process, ZeRO-1 on and off, and the final weights' bytes compared across process counts.

    cargo build --release -p xdistill-trainer-cli
    python3 bench/data_parallel.py target/release "$(scripts/get-tokenizers.sh)" [STEPS]

Standard library only. The student is a random Qwen3 (hidden 256, 4 layers, tied embeddings) with
the real Qwen3 vocabulary (151,669 tokens, 39 M of its 43 M parameters in the embedding): the
gradient all-reduce moves its every f32. Each run trains SFT on the GSM8K sample: 8 records a
step, micro-batches of 1, `virtual_shards = 4`, so every process count adds the same numbers.
Every process gets `RAYON_NUM_THREADS = max(1, cores / N)` (no oversubscription). Prints one
table row per run (median over steps 2..STEPS); record it in bench/README.md.
"""
import json, os, statistics, subprocess, sys, tempfile, time, hashlib

from servers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_student(binary, tokenizers, out):
    subprocess.run(
        [binary, "init-model", "--arch", "qwen3", "--tokenizer",
         os.path.join(tokenizers, "qwen3", "tokenizer.json"), "--hidden-size", "256",
         "--layers", "4", "--heads", "4", "--kv-heads", "2", "--intermediate-size", "512",
         "--tie-embeddings", "--out", out],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


CONFIG = """
[policy]
model_name = "{student}"
max_total_sequence_length = 256
device = "cpu"
precision = "f32"
train_micro_batch_size = 1
[policy.optimizer]
lr = 1e-4
warmup_steps = 0
[policy.data_parallel]
virtual_shards = 4
zero = {zero}
timeout_s = 600
[data]
train_path = "{data}"
prompt_field = "question"
completion_field = "answer"
[distillation]
num_prompts_per_step = 8
max_num_steps = {steps}
val_at_start = false
val_at_end = false
val_period = 0
seed = 1
[checkpointing]
enabled = false
[logger]
progress_bar = false
"""


def run(binary, cfg, out, world):
    """Starts `world` ranks, waits for all; returns the peak RSS (MiB) of each."""
    threads = max(1, (os.cpu_count() or 1) // world)
    master, port = free_port(), free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["RAYON_NUM_THREADS"] = str(threads)
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                       XDISTILL_DIST_PORT=str(port))
        procs.append(subprocess.Popen(
            [binary, "sft", "--config", cfg, "--output", out], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    rss = []
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        err = p.stderr.read().decode(errors="replace")
        if status != 0:
            sys.exit(f"rank failed ({status}):\n{err[-3000:]}")
        rss.append(usage.ru_maxrss / 1024)
    return rss


def main():
    binaries, tokenizers = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    binary = os.path.join(binaries, "trainer")
    data = os.path.join(ROOT, "configs", "data", "gsm8k_sample.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        student = os.path.join(tmp, "student")
        init_student(binary, tokenizers, student)
        print(f"cpu cores: {os.cpu_count()}; {steps} steps of 8 records, virtual_shards = 4")
        print("| processes | ZeRO-1 | step s (median) | collective s | share | MB moved per rank per step | peak RSS per process, MiB | weights |")
        print("|---|---|---|---|---|---|---|---|")
        first = None
        for world, zero in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
            out = os.path.join(tmp, f"out{world}{zero}")
            cfg = os.path.join(tmp, f"cfg{world}{zero}.toml")
            with open(cfg, "w") as f:
                f.write(CONFIG.format(student=student, data=data, steps=steps,
                                      zero=str(zero).lower()))
            rss = run(binary, cfg, out, world)
            lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
            lines = [l for l in lines if l["split"] == "train"][1:]
            step = statistics.median(l["step_time_s"] for l in lines)
            coll = statistics.median(l["loss_parts"].get("dp/collective_s", 0.0) for l in lines)
            mb = statistics.median(l["loss_parts"].get("dp/bytes", 0.0) for l in lines) / 1e6
            digest = hashlib.sha256(
                open(os.path.join(out, "final", "model.safetensors"), "rb").read()).hexdigest()
            first = first or digest
            same = "same as 1 process" if digest == first else "DIFFERENT"
            print(f"| {world} | {'on' if zero else 'off'} | {step:.2f} | {coll:.3f} | "
                  f"{100 * coll / step:.0f}% | {mb:.0f} | {' / '.join(f'{r:.0f}' for r in rss)} | {same} |")


if __name__ == "__main__":
    main()
