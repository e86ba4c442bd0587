"""What the benchmark scripts share to run real `teacher` servers on loopback (standard library
only): a free port, a health probe, waiting for a condition, starting a teacher."""
import socket, subprocess, time, urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url):
    try:
        return urllib.request.urlopen(url + "/health", timeout=2).status == 200
    except Exception:
        return False


def wait(pred, limit=120):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > limit:
            raise RuntimeError("timed out")
        time.sleep(0.1)


def start_teacher(bins, model, port, *extra):
    """A `teacher` on 127.0.0.1:port serving `model` (not yet healthy: `wait` for it)."""
    return subprocess.Popen([f"{bins}/teacher", "--model", model, "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
