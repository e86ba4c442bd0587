#!/usr/bin/env python3
"""The issue-33 probe: what careless or hostile clients cost a teacher, as its process sees it.

    python3 server/tests/probe/limits_probe.py TEACHER_BINARY MODEL_DIR

Starts the teacher (port 0, `ulimit -n 1024` as in the issue's probe, so that it holds at most
960 connections) and prints one line per figure:
  - declared: N connections each declare a 64 MiB body and send one byte (VmSize, VmRSS);
  - compat: one /v1/completions body of one-token prompts (status, seconds, VmHWM);
  - slow: 1,500 connections from 127.0.0.1 hold a body open; how many of 20 normal requests
    from 127.0.0.2 are answered 200 within 3 s each.
Standard library only; run it against two binaries to compare them.
"""

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import time

MIB = 1 << 20


def vm(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def start(binary, model, extra=()):
    cmd = f'ulimit -n 1024 && exec "$0" "$@"'
    p = subprocess.Popen(
        ["sh", "-c", cmd, binary, "--model", model, "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "error"},
        text=True,
    )
    for line in p.stdout:
        if line.startswith("listening on "):
            host, port = line.split()[-1].rsplit(":", 1)
            break
    else:
        raise SystemExit("the teacher printed no address")
    addr = (host, int(port))
    for _ in range(600):
        try:
            c = http.client.HTTPConnection(*addr, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p, addr
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("never healthy")


def post(addr, path, body, source=None, timeout=600):
    c = http.client.HTTPConnection(
        *addr, timeout=timeout, source_address=(source, 0) if source else None
    )
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    return r.status, data


def declared(binary, model, n):
    p, addr = start(binary, model, ["--body-timeout-secs", "120"])
    try:
        size0, rss0 = vm(p.pid, "VmSize"), vm(p.pid, "VmRSS")
        head = (
            "POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 * MIB}\r\n\r\n{{"
        ).encode()
        held = []
        for _ in range(n):
            s = socket.create_connection(addr)
            s.sendall(head)
            held.append(s)
        time.sleep(3)
        size1, rss1 = vm(p.pid, "VmSize"), vm(p.pid, "VmRSS")
        print(
            f"declared: {n} x 64 MiB declared, 1 byte sent: VmSize {size0 // MIB} -> "
            f"{size1 // MIB} MiB, VmRSS {rss0 // MIB} -> {rss1 // MIB} MiB",
            flush=True,
        )
        for s in held:
            s.close()
    finally:
        p.kill()
        p.wait()


def compat(binary, model, mib):
    p, addr = start(binary, model)
    try:
        post(addr, "/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 1}')
        hwm0 = vm(p.pid, "VmHWM")
        # Just under the size: 64 MiB of body is the default --max-body-bytes.
        n = (mib * MIB - 64) // 4
        body = b'{"max_tokens": 1, "prompt_logprobs": 1, "prompt": [[1]' + b",[1]" * (n - 1) + b"]}"
        t0 = time.time()
        status, data = post(addr, "/v1/completions", body)
        secs = time.time() - t0
        hwm1, rss1 = vm(p.pid, "VmHWM"), vm(p.pid, "VmRSS")
        kind = json.loads(data)["error"]["type"] if status != 200 else "ok"
        print(
            f"compat: {mib} MiB of one-token prompts: {status} {kind} in {secs:.1f} s, "
            f"VmHWM {hwm0 // MIB} -> {hwm1 // MIB} MiB, VmRSS after {rss1 // MIB} MiB",
            flush=True,
        )
    finally:
        p.kill()
        p.wait()


def slow(binary, model, n):
    p, addr = start(binary, model)
    try:
        head = (
            "POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 100000\r\n\r\n{"
        ).encode()
        held = []
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(addr)
            except BlockingIOError:
                pass
            held.append(s)
        time.sleep(1)
        for s in held:
            try:
                s.send(head)
            except OSError:
                pass
        ok = 0
        t0 = time.time()
        for _ in range(20):
            try:
                status, _ = post(
                    addr,
                    "/topk_logits",
                    b'{"sequences": [[1, 2, 3]], "k": 2}',
                    source="127.0.0.2",
                    timeout=3,
                )
                ok += status == 200
            except OSError:
                pass
        print(
            f"slow: {n} held bodies from 127.0.0.1: {ok} of 20 normal requests from "
            f"127.0.0.2 served (3 s each, {time.time() - t0:.0f} s in all)",
            flush=True,
        )
        for s in held:
            s.close()
    finally:
        p.kill()
        p.wait()


def main():
    binary, model = sys.argv[1], sys.argv[2]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    declared(binary, model, 900)
    compat(binary, model, int(os.environ.get("PROBE_COMPAT_MIB", "16")))
    slow(binary, model, 1500)


if __name__ == "__main__":
    main()
