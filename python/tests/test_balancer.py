"""The Python client behind the documented HAProxy (`docker/haproxy.cfg`, moved to loopback as
tests/tests/balancer.rs does) in front of two real teachers, one of which is SIGKILLed while a
client loop is scoring through the balancer: every request must still be answered, with the
scores the surviving teacher gives directly (batch-invariant scores are bit-identical across
replicas).

Needs `haproxy` (scripts/install-haproxy.sh, which scripts/test.sh runs; this test runs it too
when haproxy is missing). Without it the test is skipped, except under `CI=true`, where it
fails.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from typing import List, Optional

import numpy as np
import pytest
import requests

from conftest import REPO, Teacher
from xdistill import SequenceScores, TeacherClient

#: Each replica holds every request this long waiting for company before scoring it, so that a
#: kill finds one in flight (the scores do not depend on it: batch-invariant mode).
HOLD_MS = 200
REQUESTS = 16


def _find_haproxy() -> Optional[str]:
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    return shutil.which("haproxy", path=path)


@pytest.fixture(scope="module")
def haproxy() -> str:
    found = _find_haproxy()
    if found is None:
        # Installs Debian's package when run as root (as CI is); fails fast otherwise.
        subprocess.run([str(REPO / "scripts" / "install-haproxy.sh")], capture_output=True,
                       stdin=subprocess.DEVNULL)
        found = _find_haproxy()
    if found is None:
        why = "haproxy is not installed and scripts/install-haproxy.sh could not install it"
        if os.environ.get("CI") == "true":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _haproxy_config(front: int, replicas: List[int], stats: str) -> str:
    """`docker/haproxy.cfg` with its front port and its upstreams moved to loopback, and a stats
    socket at `stats` (so that the test can wait for the health checks' verdicts)."""
    text = (REPO / "docker" / "haproxy.cfg").read_text()
    assert "bind :8000" in text and "server-template teacher" in text
    assert "global" in text.splitlines()
    out = []
    for line in text.splitlines():
        t = line.strip()
        if line == "global":
            out.append(line)
            out.append(f"    stats socket {stats} mode 600 level user")
        elif t == "bind :8000":
            out.append(f"    bind 127.0.0.1:{front}")
        elif t.startswith("server-template teacher"):
            out.extend(f"    server teacher{i} 127.0.0.1:{p} check" for i, p in enumerate(replicas))
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _metric(url: str, line_prefix: str) -> float:
    """The value of the first `/metrics` line that starts with `line_prefix` (0 if none)."""
    text = requests.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _replicas_up(stats: str) -> int:
    """Replicas of the `teachers` backend that HAProxy's health checks mark UP, from `show stat`
    on its stats socket (CSV; 0 while the socket is not there yet)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(stats)
            s.sendall(b"show stat\n")
            csv = b""
            while chunk := s.recv(65536):
                csv += chunk
    except OSError:
        return 0
    lines = csv.decode(errors="replace").splitlines()
    if not lines:
        return 0
    header = (lines[0][2:] if lines[0].startswith("# ") else lines[0]).split(",")
    try:
        px, sv, status = (header.index(n) for n in ("pxname", "svname", "status"))
    except ValueError:
        return 0
    rows = [line.split(",") for line in lines[1:]]
    return sum(1 for f in rows if len(f) > max(px, sv, status) and f[px] == "teachers"
               and f[sv].startswith("teacher") and f[status] == "UP")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_replica_killed_mid_run_behind_haproxy(model_dir, tmp_path, haproxy, caplog):
    caplog.set_level(logging.INFO, logger="xdistill")
    teachers = [Teacher(model_dir, ["--max-wait-ms", str(HOLD_MS)], tmp_path / f"replica{i}.log")
                for i in range(2)]
    lb: Optional[subprocess.Popen] = None
    lb_log = open(tmp_path / "haproxy.log", "wb")
    try:
        # 1. HAProxy in front of both, checked by `haproxy -c`.
        front = _free_port()
        cfg = tmp_path / "haproxy.cfg"
        stats = str(tmp_path / "haproxy.sock")
        cfg.write_text(_haproxy_config(front, [_port(t.url) for t in teachers], stats))
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        lb = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                              stdout=lb_log, stderr=lb_log)
        base = f"http://127.0.0.1:{front}"
        # Every replica marked UP by the health checks (rise 2 x inter 1 s), then the front.
        deadline = time.monotonic() + 30
        while _replicas_up(stats) < len(teachers):
            assert lb.poll() is None, (tmp_path / "haproxy.log").read_text(errors="replace")
            assert time.monotonic() < deadline, "HAProxy never marked both replicas UP"
            time.sleep(0.05)
        assert requests.get(base + "/health", timeout=5).status_code == 200

        # 2. Distinct requests (the affinity header spreads them over both replicas).
        victim, survivor = teachers
        with TeacherClient(survivor.url) as direct:
            vocab = direct.info()["vocab_size"]
        rng = np.random.default_rng(17)
        reqs = [[rng.integers(0, vocab, size=12).tolist(), rng.integers(0, vocab, size=7).tolist()]
                for _ in range(REQUESTS)]

        # 3. A client loop scores them through the balancer...
        client = TeacherClient(base, backoff_initial_s=0.1, backoff_max_s=1.0,
                               max_retry_wait_s=60.0)
        results: List[Optional[List[SequenceScores]]] = [None] * REQUESTS
        errors: List[BaseException] = []
        done = [0]

        def loop() -> None:
            try:
                for i, r in enumerate(reqs):
                    results[i] = client.score(r, k=4)
                    done[0] = i + 1
            except BaseException as e:  # noqa: BLE001 (reported by the test)
                errors.append(e)

        worker = threading.Thread(target=loop, daemon=True)
        worker.start()
        # ...and the victim is SIGKILLed while it holds one of them, after it answered others.
        ok_line = 'xdistill_request_total{route="/topk_logits",outcome="ok"}'
        killed_after: Optional[int] = None
        while worker.is_alive():
            if (_metric(victim.url, ok_line) >= 1
                    and _metric(victim.url, "xdistill_queue_sequences") > 0):
                victim.proc.kill()
                victim.proc.wait()
                killed_after = done[0]
                break
            time.sleep(0.01)
        worker.join(timeout=180)
        assert not worker.is_alive(), "the client loop did not finish"
        assert killed_after is not None, "the victim never held a request of the loop"
        assert killed_after < REQUESTS

        # 4. Every request was answered, with the surviving teacher's own scores.
        assert errors == [], errors
        with TeacherClient(survivor.url) as direct:
            for r, got in zip(reqs, results):
                assert got is not None
                want = direct.score(r, k=4)
                assert len(got) == len(want) == 2
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
                    np.testing.assert_array_equal(g.topk_values, w.topk_values)
                    np.testing.assert_array_equal(g.target_logprobs, w.target_logprobs)
                    np.testing.assert_array_equal(g.logsumexp, w.logsumexp)
        # The request the kill cut off failed through the balancer and was retried: HAProxy
        # answers 502, or (a request on a reused server connection) closes the client's
        # connection without an answer, so that the client retries.
        retries = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert retries, "no request was cut off by the kill"
        for m in retries:
            assert "failed: 502 " in m or "failed: no answer connection_error" in m, m
    finally:
        if lb is not None:
            lb.terminate()
            try:
                lb.wait(timeout=10)
            except subprocess.TimeoutExpired:
                lb.kill()
                lb.wait()
        lb_log.close()
        for t in teachers:
            t.stop()

