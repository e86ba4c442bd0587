"""Kernel launches and GPU time per kernel from an `ncu --csv --metrics gpu__time_duration.sum`
log (one row per launch): how many kernels a forward or a training step launches, and which
take the time. Used by scripts/gpu-check.sh step p.

    python bench/ncu_kernels.py LOG.csv [--per N] [--top 25] [--label TEXT]

`--per N` divides counts and times by N (N steps or requests profiled). Prints a table and one
JSON line with the totals.

`--phases`: the launches of a run with `XDISTILL_PHASE_MARKS=on` carry empty kernels named
`xd_phase_NAME` where each phase begins (`xdistill_shared::profiling`); each launch belongs to
the last mark before it (`none`: outside any phase, or before the first mark). Prints each
phase's launches and kernel time with its largest kernels, and one JSON line per phase. The
marks themselves are left out of every count.
"""
import argparse, collections, csv, io, json, re

p = argparse.ArgumentParser()
p.add_argument("log")
p.add_argument("--per", type=float, default=1.0, help="divide counts and times by this")
p.add_argument("--top", type=int, default=25)
p.add_argument("--label", default="")
p.add_argument("--phases", action="store_true", help="split by the xd_phase_* marks")
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
# Per phase (with --phases): launches and time per kernel.
phase_count = collections.defaultdict(collections.Counter)
phase_us = collections.defaultdict(collections.Counter)
phase = "none"
marks = 0
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r["Kernel Name"]
    # Templated C++ names: keep the function's name and the start of its arguments.
    name = re.sub(r"\s+", " ", name)[:90]
    mark = re.fullmatch(r"xd_phase_(\w+)", name.split("(")[0].strip())
    if mark:
        phase = mark.group(1)
        marks += 1
        continue
    value = float(r["Metric Value"].replace(",", ""))
    us = value * to_us.get(r.get("Metric Unit", "nsecond"), 1e-3)
    count[name] += 1
    time_us[name] += us
    phase_count[phase][name] += 1
    phase_us[phase][name] += us

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
if a.phases:
    if marks == 0:
        raise SystemExit(f"{a.log}: no xd_phase_* marks (run with XDISTILL_PHASE_MARKS=on)")
    print(f"{a.label}: by phase ({marks / a.per:.0f} marks per {a.per:g} left out)")
    print(f"{'phase':12} {'launches':>9} {'ms':>9} {'share':>6}  largest kernels (ms)")
    order = sorted(phase_us, key=lambda ph: -sum(phase_us[ph].values()))
    for ph in order:
        t = sum(phase_us[ph].values())
        n = sum(phase_count[ph].values())
        top = ", ".join(f"{k[:40]} x{phase_count[ph][k] / a.per:.0f} {v / a.per / 1e3:.3f}"
                        for k, v in phase_us[ph].most_common(4))
        print(f"{ph:12} {n / a.per:9.0f} {t / a.per / 1e3:9.3f} {t / max(raw_total, 1e-9):6.1%}  {top}")
    for ph in order:
        print(json.dumps({"label": a.label, "phase": ph,
                          "launches": round(sum(phase_count[ph].values()) / a.per),
                          "kernel_ms": round(sum(phase_us[ph].values()) / a.per / 1e3, 6)}))
