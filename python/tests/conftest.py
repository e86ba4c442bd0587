"""Fixtures: a tiny random Qwen3 model, real `teacher` processes serving it, and its f64 reference.

Binaries come from ``$XDISTILL_BIN_DIR`` (default ``<repo>/target/debug``); the Qwen3 tokenizer
from ``$XDISTILL_TOKENIZERS/qwen3/tokenizer.json`` (``scripts/get-tokenizers.sh`` finds it when
the variable is unset). Each server is started once per session with ``--port 0``; the port is
read from its ``listening on ADDR`` line and the fixture waits for ``GET /health`` to be 200.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import pytest
import requests
from tokenizers import Tokenizer

from helpers import API_KEY, LIMITED_MAX_K, LIMITED_QUEUE_TOKENS, MODEL_NAME
from reference import Reference

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


def _bin_dir() -> Path:
    return Path(os.environ.get("XDISTILL_BIN_DIR") or REPO / "target" / "debug")


def _binary(name: str) -> Path:
    path = _bin_dir() / name
    if not path.is_file():
        pytest.fail(
            f"{path} not found: build it (cargo build -p xdistill-server --bin teacher "
            f"-p xdistill-trainer-cli --bin trainer) or set XDISTILL_BIN_DIR",
            pytrace=False,
        )
    return path


def _clean_env() -> dict:
    """This process's environment without XDISTILL_* (the teacher reads its flags from them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("XDISTILL_")}


class Teacher:
    """One `teacher` process. ``url`` is its base URL once started; ``stop()`` ends it."""

    def __init__(self, model_dir: Path, extra_args: List[str], log_path: Path):
        cmd = [str(_binary("teacher")), "--model", str(model_dir), "--port", "0",
               "--served-model-name", MODEL_NAME, *extra_args]
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL, env=_clean_env())
        self.stdout_lines: List[str] = []
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        # Keep draining stdout for the whole life of the process so it never blocks on a pipe.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.url = self._wait_ready()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.stdout_lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _fail(self, why: str) -> None:
        self.stop()
        log = self.log_path.read_text(errors="replace")[-4000:]
        pytest.fail(f"{' '.join(self.cmd)}: {why}\nstdout: {self.stdout_lines[-20:]}\nstderr:\n{log}",
                    pytrace=False)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        addr = None
        # 1. The bound address, from stdout.
        while addr is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail("no `listening on` line in time")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self._fail(f"exited with {self.proc.wait()} before listening")
            elif line.startswith("listening on "):
                addr = line[len("listening on "):].strip()
        url = f"http://{addr}"
        # 2. Health: 200 once the model is loaded.
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"exited with {self.proc.returncode} while loading")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self._fail("/health not 200 in time")
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- model and references ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    """The real Qwen3 tokenizer.json the tiny model is built on."""
    root = os.environ.get("XDISTILL_TOKENIZERS")
    if not root:
        root = subprocess.run([str(REPO / "scripts" / "get-tokenizers.sh")], check=True,
                              capture_output=True, text=True).stdout.strip()
    path = Path(root) / "qwen3" / "tokenizer.json"
    assert path.is_file(), path
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer_path) -> Path:
    """A tiny random Qwen3 (hidden 32, 2 layers, GQA 4/2) on the real Qwen3 vocabulary, its
    LM head padded to a multiple of 128 rows so that padding must be excluded."""
    out = tmp_path_factory.mktemp("model") / "tiny-qwen3"
    subprocess.run(
        [str(_binary("trainer")), "init-model", "--arch", "qwen3",
         "--tokenizer", str(tokenizer_path), "--hidden-size", "32", "--layers", "2",
         "--heads", "4", "--kv-heads", "2", "--intermediate-size", "64",
         "--max-position-embeddings", "256", "--pad-vocab-to", "128",
         "--init-std", "0.1", "--seed", "7", "--out", str(out)],
        check=True, env=_clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    return out


@pytest.fixture(scope="session")
def ref(model_dir) -> Reference:
    """The independent f64 numpy forward of the tiny model."""
    return Reference(model_dir)


@pytest.fixture(scope="session")
def tok(model_dir) -> Tokenizer:
    """The `tokenizers` library on the model's tokenizer.json."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def seqs(tok, ref) -> List[List[int]]:
    """Test sequences: real text, random ids over the whole vocabulary (added tokens
    included), and the short edge cases (two tokens: one row; one token: no rows)."""
    rng = np.random.default_rng(3)
    text = tok.encode("The quick brown fox jumps over the lazy dog, twice.").ids
    rand = rng.integers(0, ref.n_valid, size=9).tolist()
    special = [151644, 872, 198, 9707, ref.n_valid - 1, 11, 1879, 151645]
    return [text, rand, special, [9707, 11], [42]]


# -- servers ----------------------------------------------------------------------------------


def _start(model_dir: Path, tmp_path_factory, name: str, extra: List[str]):
    log = tmp_path_factory.mktemp("logs") / f"{name}.stderr"
    t = Teacher(model_dir, extra, log)
    return t


@pytest.fixture(scope="session")
def teacher(model_dir, tmp_path_factory):
    """The default server (no key, default limits)."""
    t = _start(model_dir, tmp_path_factory, "teacher", [])
    yield t
    t.stop()


@pytest.fixture(scope="session")
def auth_teacher(model_dir, tmp_path_factory):
    """A server started with `--api-key secret`."""
    t = _start(model_dir, tmp_path_factory, "auth", ["--api-key", API_KEY])
    yield t
    t.stop()


@pytest.fixture(scope="session")
def limited_teacher(model_dir, tmp_path_factory):
    """A server with tight limits: `--max-k 16`, 64 queued tokens, 64 batch tokens."""
    t = _start(model_dir, tmp_path_factory, "limited",
               ["--max-k", str(LIMITED_MAX_K), "--max-queue-tokens", str(LIMITED_QUEUE_TOKENS),
                "--max-batch-tokens", str(LIMITED_QUEUE_TOKENS)])
    yield t
    t.stop()


@pytest.fixture(scope="session")
def base(teacher) -> str:
    """Base URL of the default server."""
    return teacher.url



@pytest.fixture(scope="session")
def bf16_teacher(model_dir, tmp_path_factory):
    """A server computing in bf16 (`--dtype bf16`): bf16 hidden states and head."""
    t = _start(model_dir, tmp_path_factory, "bf16", ["--dtype", "bf16"])
    yield t
    t.stop()
