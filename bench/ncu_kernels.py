"""Kernel launches and GPU time per kernel from an `ncu --csv --metrics gpu__time_duration.sum`
log (one row per launch): how many kernels a forward or a training step launches, and which
take the time. Used by scripts/gpu-check.sh step p.

    python bench/ncu_kernels.py LOG.csv [--per N] [--top 25] [--label TEXT]

`--per N` divides counts and times by N (N steps or requests profiled). Prints a table and one
JSON line with the totals.
"""
import argparse, collections, csv, io, json, re

p = argparse.ArgumentParser()
p.add_argument("log")
p.add_argument("--per", type=float, default=1.0, help="divide counts and times by this")
p.add_argument("--top", type=int, default=25)
p.add_argument("--label", default="")
a = p.parse_args()

text = open(a.log, errors="replace").read()
# ncu writes its own "==PROF==" lines into the log too: the table starts at the "ID" header.
start = text.find('"ID"')
if start < 0:
    raise SystemExit(f"{a.log}: no ncu table (did the program launch any kernel?)")
rows = csv.DictReader(io.StringIO(text[start:]))
to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}
count = collections.Counter()
time_us = collections.Counter()
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r["Kernel Name"]
    # Templated C++ names: keep the function's name and the start of its arguments.
    name = re.sub(r"\s+", " ", name)[:90]
    value = float(r["Metric Value"].replace(",", ""))
    count[name] += 1
    time_us[name] += value * to_us.get(r.get("Metric Unit", "nsecond"), 1e-3)

raw_total = sum(time_us.values())
launches = sum(count.values()) / a.per
total = raw_total / a.per
print(f"{a.label}: {launches:.0f} launches, {total / 1e3:.2f} ms of kernel time"
      f" (per {a.per:g}), {len(count)} distinct kernels")
print(f"{'kernel':90} {'launches':>9} {'ms':>9} {'share':>6} {'us/launch':>10}")
for name, t in time_us.most_common(a.top):
    print(f"{name:90} {count[name] / a.per:9.0f} {t / a.per / 1e3:9.3f} {t / max(raw_total, 1e-9):6.1%}"
          f" {t / count[name]:10.1f}")
# The launches themselves: which kernels are launched most often.
print("most launched:", ", ".join(f"{n[:40]} x{c / a.per:.0f}" for n, c in count.most_common(8)))
print(json.dumps({"label": a.label, "launches": round(launches), "kernel_ms": round(total / 1e3, 3),
                  "distinct": len(count)}))
