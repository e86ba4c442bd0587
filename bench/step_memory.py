"""Peak memory of one student training step against the sequence length, ours beside PyTorch's
careful step (outside CI; figures in bench/README.md and docs/cuda.md).

Two harnesses, each process reporting its own high-water mark:
- `--pass-only`: `train_pass_memory` (shared/examples) with `checkpoint` (layers recomputed,
  attention in query blocks), `selective` (all but the attention core kept, attention in query
  blocks) and `keep` (plain autograd: T² attention), against
  bench/torch_pass_memory.py (SDPA + gradient checkpointing + chunked head), next-token CE only.
- default: the full step of `trainer bench-step` (forward, LM head + KD/CE loss, backward,
  clipping, AdamW) at batch 1 under /usr/bin/time, for each `--trainer NAME=BINARY[:FLAGS]`
  (e.g. a build from before checkpointing, and today's with `--activation-checkpointing on`),
  against bench/torch_step.py in `careful` mode on the same batch (`--write-batch`).

Prints a markdown table and the slopes (MiB per 1k tokens) between consecutive lengths.

    cargo build --release -p xdistill-trainer-cli
    python bench/step_memory.py MODEL_DIR --python target/hfenv/bin/python \
        --trainer before=/tmp/trainer-before --trainer after=target/release/trainer:--activation-checkpointing=on
"""
import argparse, json, os, re, subprocess, sys, tempfile

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--python", default=sys.executable)
ap.add_argument("--lens", default="512,1024,2048,4096,8192")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--pass-only", action="store_true")
ap.add_argument("--keep-max", type=int, default=4096, help="longest T for plain autograd / before")
ap.add_argument("--head-rows", type=int, default=512)
ap.add_argument("--bin", default="target/release/examples/train_pass_memory")
ap.add_argument("--trainer", action="append", default=[], help="NAME=BINARY[:FLAG,FLAG]")
a = ap.parse_args()
env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
here = os.path.dirname(os.path.abspath(__file__))
tmp = tempfile.mkdtemp(prefix="step_memory.")


def run(cmd, timed=False):
    if timed:
        cmd = ["/usr/bin/time", "-f", "PEAK_KB %M"] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        return {"error": (text.strip().splitlines() or ["?"])[-1][:160]}
    r = {}
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if lines:
        r = json.loads(lines[-1])
    if timed:
        r["peak_rss_mib"] = int(re.search(r"PEAK_KB (\d+)", text).group(1)) / 1024
        m = re.search(r"median_ms=([\d.]+)", text)
        if m:
            r["step_s"] = float(m.group(1)) / 1000
    if "peak_bytes" in r:
        r["peak_rss_mib"] = r["peak_bytes"] / 2**20
        r["step_s"] = r["median_step_s"]
    return r


def pass_row(t):
    r = {m: run([a.bin, a.model, str(t), m, str(a.head_rows)]) for m in ("checkpoint", "selective")}
    if t <= a.keep_max:
        r["keep"] = run([a.bin, a.model, str(t), "keep", str(a.head_rows)])
    r["torch"] = run([a.python, os.path.join(here, "torch_pass_memory.py"), a.model, str(t),
                      str(a.head_rows), str(a.threads)])
    return r


def step_row(t):
    r = {}
    batch = os.path.join(tmp, f"batch{t}.safetensors")
    for spec in a.trainer:
        name, rest = spec.split("=", 1)
        binary, _, flags = rest.partition(":")
        if name == "before" and t > a.keep_max:
            continue
        cmd = [binary, "bench-step", "--model", a.model, "--batch", "1", "--seq-len", str(t),
               "--steps", "1", "--dtype", "f32", "--write-batch", batch]
        r[name] = run(cmd + [f for f in flags.split(",") if f], timed=True)
    if os.path.exists(batch):
        r["torch"] = run([a.python, os.path.join(here, "torch_step.py"), a.model, batch, "1",
                          str(a.threads), "cpu", "f32", "careful"])
    return r


rows = []
for t in map(int, a.lens.split(",")):
    r = {"T": t, **(pass_row(t) if a.pass_only else step_row(t))}
    rows.append(r)
    print(json.dumps(r), file=sys.stderr, flush=True)

keys = [k for k in rows[0] if k != "T"] if rows else []


def cell(x):
    if x is None:
        return "—"
    if "error" in x:
        return "failed: " + x["error"][:60]
    return f"{x['peak_rss_mib']:.0f} MiB, {x.get('step_s', float('nan')):.1f} s"


print("| T | " + " | ".join(keys) + " |")
print("|---|" + "---|" * len(keys))
for r in rows:
    print(f"| {r['T']} | " + " | ".join(cell(r.get(k)) for k in keys) + " |")
print()
print("Slope, MiB per 1k tokens, (peak(T2) - peak(T1)) / (T2 - T1) * 1000:")
for key in keys:
    pts = [(r["T"], r[key]["peak_rss_mib"]) for r in rows if "peak_rss_mib" in r.get(key, {})]
    slopes = [f"{t1}->{t2}: {(p2 - p1) / (t2 - t1) * 1000:.0f}" for (t1, p1), (t2, p2) in zip(pts, pts[1:])]
    print(f"- {key}: " + ", ".join(slopes))
