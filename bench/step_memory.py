"""Peak memory of one student forward + backward against the sequence length, ours beside
PyTorch's careful step (outside CI; figures in bench/README.md and docs/cuda.md).

For each T, three processes on the same model directory and the same ids, each reporting its own
high-water mark: `train_pass_memory` (shared/examples) with `checkpoint` (layers recomputed,
attention in query blocks) and with `keep` (plain autograd, T² attention: the path before
checkpointing; skipped above --keep-max), and bench/torch_pass_memory.py (SDPA, gradient
checkpointing, chunked head under torch.utils.checkpoint). Prints a markdown table and the
slopes (MiB per 1k tokens) between consecutive lengths.

    cargo build --release -p xdistill-shared --example train_pass_memory
    python bench/step_memory.py MODEL_DIR --python target/hfenv/bin/python [--lens 512,1024,...]
"""
import argparse, json, os, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--python", default=sys.executable)
ap.add_argument("--lens", default="512,1024,2048,4096,8192")
ap.add_argument("--keep-max", type=int, default=4096)
ap.add_argument("--head-rows", type=int, default=512)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--bin", default="target/release/examples/train_pass_memory")
a = ap.parse_args()
env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
here = os.path.dirname(os.path.abspath(__file__))


def run(cmd):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(lines[-1])


rows = []
for t in map(int, a.lens.split(",")):
    r = {"T": t}
    r["checkpoint"] = run([a.bin, a.model, str(t), "checkpoint", str(a.head_rows)])
    if t <= a.keep_max:
        r["keep"] = run([a.bin, a.model, str(t), "keep", str(a.head_rows)])
    r["torch"] = run([a.python, os.path.join(here, "torch_pass_memory.py"), a.model, str(t),
                      str(a.head_rows), str(a.threads)])
    rows.append(r)
    print(json.dumps(r), file=sys.stderr, flush=True)


def cell(x):
    if x is None:
        return "—"
    if "error" in x:
        return "failed"
    return f"{x['peak_rss_mib']:.0f} MiB, {x['step_s']:.1f} s"


print("| T | ours, checkpointed | ours, plain autograd | PyTorch (SDPA + checkpointing + chunked head) |")
print("|---|---|---|---|")
for r in rows:
    print(f"| {r['T']} | {cell(r.get('checkpoint'))} | {cell(r.get('keep'))} | {cell(r.get('torch'))} |")
print()
print("Slope, MiB per 1k tokens (peak(T2) - peak(T1)) / (T2 - T1) * 1000:")
for key in ("checkpoint", "keep", "torch"):
    pts = [(r["T"], r[key]["peak_rss_mib"]) for r in rows if key in r and "peak_rss_mib" in r[key]]
    slopes = [f"{t1}->{t2}: {(p2 - p1) / (t2 - t1) * 1000:.0f}" for (t1, p1), (t2, p2) in zip(pts, pts[1:])]
    print(f"- {key}: " + ", ".join(slopes))
