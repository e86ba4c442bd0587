#!/usr/bin/env python3
"""Where scripts/test.sh's time went: its stages, every Rust test binary, the ten slowest tests.

Usage: test-report.py STAGES.tsv [JUNIT.xml ...]

STAGES.tsv has one `label<TAB>seconds<TAB>ok|failed` line per stage, in the order they ended,
and may have one `wall<TAB>seconds` line: the whole run's wall time (stages may overlap). The
JUnit files are nextest's (target/nextest/<profile>/junit.xml: one <testsuite> per test binary;
a crate's `integration` binary is reported per module, each one file of its tests/ folder) and
pytest's; a missing or unreadable one is left out. Prints to stdout; exits 0.
"""

import sys
import xml.etree.ElementTree as ET
from datetime import datetime


def stamp(s):
    """A JUnit timestamp as seconds (None when absent or unreadable)."""
    if not s:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def cases(path):
    """(run, suite, test, seconds, start, outcome, stderr) of each test case in a JUnit file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    run = path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    out = []
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            outcome = "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            name = case.get("classname") or suite.get("name") or "?"
            test = case.get("name", "?")
            # A crate's integration tests are one binary whose modules are its tests/ files:
            # report each module as the binary it used to be (`xdistill-server::scores`).
            if name.endswith("::integration") and "::" in test:
                module, test = test.split("::", 1)
                name = f"{name[:-len('integration')]}{module}"
            err = "".join((e.text or "") for e in case.iter("system-err"))
            err += "".join((e.text or "") for e in case.iter("system-out"))
            out.append((run, name, test, float(case.get("time") or 0.0),
                        stamp(case.get("timestamp")), outcome, err))
    return out


def main(argv):
    stages = []
    wall = None
    with open(argv[1]) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 2 and parts[0] == "wall":
                wall = float(parts[1])
            elif len(parts) == 3:
                stages.append((parts[0], float(parts[1]), parts[2]))
    runs = {}
    for path in argv[2:]:
        for c in cases(path):
            runs.setdefault(c[0], []).append(c)

    def counts(cs):
        n = {k: sum(1 for c in cs if c[5] == k) for k in ("passed", "failed", "skipped")}
        return ", ".join(f"{v} {k}" for k, v in n.items() if v)

    label_of = {"rust": "rust tests", "simd": "simd pass", "python": "python client"}
    print()
    print("Where the time went (wall seconds)")
    print(f"  {'stage':<44} {'seconds':>8}  result")
    for label, secs, status in stages:
        run = next((r for r, l in label_of.items() if label.startswith(l)), None)
        detail = counts(runs.get(run, [])) if run else ""
        print(f"  {label:<44} {secs:8.1f}  {status}{'  (' + detail + ')' if detail else ''}")
        if run in ("rust", "simd") and runs.get(run):
            by_binary = {}
            for c in runs[run]:
                by_binary.setdefault(c[1], []).append(c)
            rows = []
            for binary, cs in by_binary.items():
                starts = [c[4] for c in cs if c[4] is not None]
                ends = [c[4] + c[3] for c in cs if c[4] is not None]
                span = max(ends) - min(starts) if starts else sum(c[3] for c in cs)
                rows.append((sum(c[3] for c in cs), span, binary, len(cs)))
            rows.sort(reverse=True)
            print(f"    {'test binary':<42} {'span':>8} {'summed':>8}  tests"
                  "   (binaries run side by side: spans overlap)")
            for total, span, binary, n in rows:
                print(f"    {binary:<42} {span:8.1f} {total:8.1f}  {n}")
    # The whole run's wall time (stages may run beside each other: the sum would count twice).
    print(f"  {'total (wall)':<44} {wall if wall is not None else sum(s[1] for s in stages):8.1f}")

    every = [c for cs in runs.values() for c in cs if c[5] != "skipped"]
    every.sort(key=lambda c: -c[3])
    print()
    print("The ten slowest tests (seconds; several run at once)")
    for c in every[:10]:
        where = "" if c[0] == "rust" else f" [{label_of.get(c[0], c[0])}]"
        print(f"  {c[3]:8.1f}  {c[1]} {c[2]}{where}")

    skipped = sorted({line.strip() for cs in runs.values() for c in cs
                      for line in c[6].splitlines() if line.startswith("SKIPPED ")})
    if skipped:
        print()
        print("Skipped (Rust):")
        for line in skipped:
            print(f"  {line}")
    failed = [c for cs in runs.values() for c in cs if c[5] == "failed"]
    if failed:
        print()
        print("Failed tests:")
        for c in failed:
            print(f"  {label_of.get(c[0], c[0])}: {c[1]} {c[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
