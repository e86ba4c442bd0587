#!/usr/bin/env python3
"""The scarce-label scenario's probe runs (issue 16), one after another, and their table.

    python3 bench/demo_probes.py [TRAINER] [--only NAME ...] [--table-only]

TRAINER defaults to target/release/trainer (`teacher` must sit beside it). Every probe is a
`trainer demo` run (scarce scenario only, unless it says otherwise) with its own flags, written to runs/probes/NAME/; all probes
share the teacher cached in runs/probes/teacher (built by the first probe that needs it, so
the first run takes the teacher's build time too). A probe whose summary.json exists is not run
again (delete its folder to redo it). The table printed at the end is what docs/demo.md quotes.

The list is the whole search: the issue bounds it to a few dozen runs, scripted here.
"""

import json
import os
import subprocess
import sys
import time

# name: flags of `trainer demo` (--scenario scarce unless a probe names its scenarios). Each
# probe changes one or two things from the defaults of its round, spelled out so that a probe
# means the same run whatever today's defaults are (today: 100 labelled problems, 150 steps per
# method at lr 3e-3, a 300-step warm-up, the plain teacher).
PROBES = {
    # Round 1, on an earlier build (the corrected teacher and lr 1e-3 were the defaults then).
    "demo": ["--scenario", "both", "--teacher-data", "corrected", "--lr", "1e-3"],
    "steps_450": ["--steps", "450", "--teacher-data", "corrected", "--lr", "1e-3"],
    "plain_teacher_450": ["--teacher-data", "plain", "--steps", "450", "--lr", "1e-3"],
    # Round 2: the plain teacher; what limits on-policy's climb (lr 1e-3 unless named).
    "lr_2e-3": ["--lr", "2e-3"],
    "lr_3e-3": ["--lr", "3e-3"],
    "lr_5e-3": ["--lr", "5e-3"],
    "warmup_100": ["--warmup-steps", "100", "--lr", "1e-3"],
    "warmup_0": ["--warmup-steps", "0", "--lr", "1e-3"],
    "labelled_50": ["--labelled", "50", "--lr", "1e-3"],
    "labelled_200": ["--labelled", "200", "--lr", "1e-3"],
    # Round 3, at lr 3e-3 (round 2's best, now the default): the corrected teacher, other draws
    # of the 100 labelled problems (the noise of one run), a longer budget, the rollouts'
    # temperature, label shares.
    "corrected_teacher": ["--lr", "3e-3", "--teacher-data", "corrected"],
    "label_seed_1": ["--lr", "3e-3", "--label-seed", "1"],
    "label_seed_2": ["--lr", "3e-3", "--label-seed", "2"],
    "label_seed_3": ["--lr", "3e-3", "--label-seed", "3"],
    "lr_3e-3_steps_450": ["--lr", "3e-3", "--steps", "450"],
    "rollout_t_0.3": ["--lr", "3e-3", "--rollout-temperature", "0.3"],
    "rollout_t_0.7": ["--lr", "3e-3", "--rollout-temperature", "0.7"],
    "labelled_50_lr3": ["--lr", "3e-3", "--labelled", "50"],
    "labelled_200_lr3": ["--lr", "3e-3", "--labelled", "200"],
    # Round 4: more draws of the labels (round 3 found them to matter most), and the budget at
    # 300 steps for the default draw and for the best one.
    "label_seed_4": ["--lr", "3e-3", "--label-seed", "4"],
    "label_seed_5": ["--lr", "3e-3", "--label-seed", "5"],
    "lr_3e-3_steps_300": ["--lr", "3e-3", "--steps", "300"],
    "label_seed_1_steps_300": ["--lr", "3e-3", "--label-seed", "1", "--steps", "300"],
}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runs", "probes")


def run(trainer, name, flags):
    out = os.path.join(OUT, name)
    if os.path.isfile(os.path.join(out, "summary.json")):
        return
    os.makedirs(out, exist_ok=True)
    shared = os.path.join(OUT, "teacher")
    os.makedirs(shared, exist_ok=True)
    link = os.path.join(out, "teacher")
    if not os.path.islink(link):
        os.symlink(shared, link)
    scenario = [] if "--scenario" in flags else ["--scenario", "scarce"]
    # The full preset: the settings the probe tables of docs/demo.md were measured with.
    cmd = [trainer, "demo", "--task", "arithmetic", "--full", "--output", out] + scenario + flags
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    with open(os.path.join(out, "stdout.txt"), "w") as f:
        subprocess.run(cmd, check=True, stdout=f)
    print(f"   {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def fmt(x):
    return "never" if x is None else str(x)


def table(names):
    head = (
        "| probe | flags | teacher | after mistake (clean) | init | SFT | off-policy | on-policy "
        "| steps to 90% T: SFT / off / on | on / SFT | goal |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in names:
        path = os.path.join(OUT, name, "summary.json")
        if not os.path.isfile(path):
            continue
        s = json.load(open(path))
        sc = s["scarce"]
        g = sc["goal"]
        m = s["teacher_after_mistake"]
        ratio = g["on_policy_over_sft"]
        print(
            f"| {name} | {' '.join(PROBES[name]) or '(defaults)'} "
            f"| {s['teacher']['accuracy']:.3f} "
            f"| {m['after_mistake_top1']:.3f} ({m['clean_top1']:.3f}) "
            f"| {sc['student_init']['accuracy']:.2f} | {sc['sft']['accuracy']:.2f} "
            f"| {sc['off_policy']['accuracy']:.2f} | {sc['on_policy']['accuracy']:.2f} "
            f"| {fmt(g['sft_steps'])} / {fmt(g['off_policy_steps'])} / {fmt(g['on_policy_steps'])} "
            f"| {'∞' if ratio is None else f'{ratio:.2f}'} | {'met' if g['met'] else 'not met'} |"
        )


def main():
    args = sys.argv[1:]
    trainer = os.path.join(ROOT, "target", "release", "trainer")
    if args and not args[0].startswith("--"):
        trainer = args.pop(0)
    names = list(PROBES)
    if "--only" in args:
        names = [a for a in args[args.index("--only") + 1 :] if not a.startswith("--")]
        unknown = [n for n in names if n not in PROBES]
        if unknown:
            sys.exit(f"unknown probe(s) {unknown}; known: {list(PROBES)}")
    if "--table-only" not in args:
        if not os.path.isfile(trainer):
            sys.exit(f"{trainer}: not found (cargo build --release first)")
        for name in names:
            run(trainer, name, PROBES[name])
    table(names)


if __name__ == "__main__":
    main()
