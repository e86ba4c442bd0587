"""Exact full-vocabulary distillation: `TeacherClient.hidden_states` + `TeacherClient.head`
against a real teacher.

The log-probs the client computes from the hidden states and the head are checked against the
same server's `/topk_logits` answer (its top-k values and ids, target log-probs and logsumexps,
through `score`) and against the f64 numpy reference of the model; the head file against the
model's own weights. A local HTTP proxy in front of the teacher rewrites `/v1/info` and the
head's bytes and headers to check that a head with the wrong fingerprint is refused and that a
server without a head is named as such.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import struct
import threading
from pathlib import Path
from typing import Dict, List, Optional

import msgpack
import numpy as np
import pytest
import requests

from helpers import REF_ATOL
from xdistill import (HEAD_FINGERPRINT_HEADER, HeadFingerprintMismatch, HeadUnavailable,
                      HiddenStates, TeacherClient, TeacherError, TeacherHead, TeacherInfo)

#: The client's log-probs (f32 matmul and log-softmax in numpy) against the server's (its own
#: f32 kernels): the same values to f32 rounding of log-probs around -12.
F32_ATOL = 2e-5
TAUS = [1.0, 0.7]
K = 8


@pytest.fixture(scope="module")
def client(base):
    with TeacherClient(base) as c:
        yield c


@pytest.fixture(scope="module")
def head(client) -> TeacherHead:
    return client.head()


def _request_count(url: str, route: str, outcome: str = "ok") -> int:
    text = requests.get(url + "/metrics", timeout=10).text
    m = re.search(r'^xdistill_request_total\{route="%s",outcome="%s"\} (\d+)$'
                  % (re.escape(route), re.escape(outcome)), text, re.M)
    return int(m.group(1)) if m else 0


def _logsumexp(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1)
    return m + np.log(np.exp(z - m[..., None]).sum(axis=-1))


def _check_against_scores(lp: np.ndarray, s: List[int], start: int, scores, atol: float) -> None:
    """Full-vocabulary log-probs ``[rows, V]`` against one sequence's `score` answer."""
    rows = len(s) - 1 - start
    assert lp.shape[0] == rows == scores.rows
    # The server's top-k values at its ids, and they are the k largest of ours.
    np.testing.assert_allclose(np.take_along_axis(lp, scores.topk_ids.astype(np.int64), -1),
                               scores.topk_values, rtol=0, atol=atol)
    np.testing.assert_allclose(-np.sort(-lp, axis=-1)[:, :scores.k], scores.topk_values,
                               rtol=0, atol=atol)
    np.testing.assert_allclose(lp[np.arange(rows), np.asarray(s[start + 1:])],
                               scores.target_logprobs, rtol=0, atol=atol)


# -- info and routes --------------------------------------------------------------------------


def test_info_describes_the_full_vocab_routes(client, ref, head):
    info: TeacherInfo = client.info()
    fv = info["full_vocab"]
    assert fv["hidden_route"] == "/hidden_states" and fv["head_route"] == "/v1/head"
    assert fv["dtype"] == info["dtype"] == "f32"
    assert fv["hidden_size"] == ref.hidden == head.hidden_size
    assert fv["head_rows"] == info["logits_size"] == ref.cfg["vocab_size"] == head.head_rows
    assert fv["vocab_size"] == ref.n_valid == head.vocab_size < head.head_rows
    assert re.fullmatch(r"[0-9a-f]{64}", fv["head_fingerprint"])
    assert head.fingerprint == fv["head_fingerprint"]
    assert head.model == info["model_fingerprint"]
    assert head.architecture == info["architecture"]
    assert fv["bias"] is False and fv["logit_scale"] == 1.0 and fv["logit_softcap"] is None
    assert (head.tied, head.bias, head.logit_scale, head.logit_softcap) == (
        fv["tied"], None, 1.0, None)
    assert head.path is None and head.dtype == "f32"


def test_head_is_the_models_lm_head(head, ref):
    assert head.weight.dtype == np.float32
    assert head.weight.shape == ref.lm_head.shape
    # Served from the f32 tensor of model.safetensors: the same bits.
    np.testing.assert_array_equal(head.weight, ref.lm_head.astype(np.float32))


def test_head_file_is_safetensors_with_its_fingerprint(client, base, head, tmp_path):
    from safetensors.numpy import load_file

    r = requests.get(base + "/v1/head", timeout=60)
    assert r.status_code == 200
    fp = hashlib.sha256(r.content).hexdigest()
    assert fp == head.fingerprint == r.headers[HEAD_FINGERPRINT_HEADER]
    assert r.headers["ETag"] == f'"{fp}"'
    assert int(r.headers["Content-Length"]) == len(r.content) == client.info()["full_vocab"][
        "head_bytes"]
    (tmp_path / "h.safetensors").write_bytes(r.content)
    np.testing.assert_array_equal(load_file(str(tmp_path / "h.safetensors"))["weight"],
                                  head.weight)


def test_head_scales_that_make_every_logit_nan_are_refused(base, head):
    # The server's own file with its metadata changed: the header rewritten, the data as sent.
    from xdistill.client import _head_from_bytes

    body = requests.get(base + "/v1/head", timeout=60).content
    (n,) = struct.unpack("<Q", body[:8])
    header, data = json.loads(body[8:8 + n]), body[8 + n:]
    assert _head_from_bytes(body, head.fingerprint).logit_scale == 1.0
    for key, value in [("logit_scale", "NaN"), ("logit_scale", "inf"), ("logit_softcap", "0"),
                       ("logit_softcap", "nan")]:
        changed = json.loads(json.dumps(header))
        changed["__metadata__"][key] = value
        text = json.dumps(changed).encode()
        text += b" " * (-len(text) % 8)
        with pytest.raises(ValueError, match="logit_softcap"):
            _head_from_bytes(struct.pack("<Q", len(text)) + text + data, head.fingerprint)


def test_hidden_states_shapes_and_fingerprints(client, head, seqs):
    st = client.hidden_states(seqs)
    info = client.info()
    assert isinstance(st, HiddenStates) and len(st) == len(seqs)
    assert st.head_fingerprint == head.fingerprint
    assert st.model == info["model_fingerprint"]
    assert st.dtype == "f32" and st.hidden_size == head.hidden_size
    for s, h in zip(seqs, st):
        assert h.dtype == np.float32 and h.shape == (max(len(s) - 1, 0), head.hidden_size)
        assert np.all(np.isfinite(h))
        if len(h):
            # Final-norm states: RMS-normalised (times the norm's weight), not the raw residual.
            assert np.abs(h).max() < 100


# -- the exact log-probs ----------------------------------------------------------------------


@pytest.mark.parametrize("tau", TAUS)
def test_log_probs_equal_topk_logits(client, head, seqs, tau):
    st = client.hidden_states(seqs)
    scores = client.score(seqs, k=K, temperature=tau)
    checked = 0
    for s, h, sc in zip(seqs, st, scores):
        lp = head.log_probs(h, temperature=tau)
        assert lp.dtype == np.float32 and lp.shape == (len(h), head.vocab_size)
        if not len(h):
            continue
        _check_against_scores(lp, s, 0, sc, F32_ATOL)
        # logsumexp of z / tau, from the logits.
        np.testing.assert_allclose(_logsumexp(head.logits(h) / tau), sc.logsumexp, rtol=0,
                                   atol=F32_ATOL)
        # A distribution over the real vocabulary only (padding rows excluded).
        np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(-1), 1.0, atol=1e-4)
        checked += 1
    assert checked == 4


@pytest.mark.parametrize("tau", TAUS)
def test_log_probs_match_the_reference(client, head, seqs, ref, tau):
    st = client.hidden_states(seqs[:3])
    for s, h in zip(seqs, st):
        np.testing.assert_allclose(head.log_probs(h, tau), ref.logprobs(s, tau)[:-1], rtol=0,
                                   atol=REF_ATOL)


def test_temperature_changes_the_log_probs(client, head, seqs):
    # The parametrised checks above would pass with a temperature that is ignored only if the
    # two temperatures gave the same numbers: they do not.
    [h] = client.hidden_states([seqs[0]])
    assert np.abs(head.log_probs(h, 0.7) - head.log_probs(h)).max() > 0.01
    with pytest.raises(ValueError, match="temperature"):
        head.log_probs(h, 0.0)
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        head.log_probs(h[:, :5])


def test_log_probs_of_a_batch_of_rows(client, head, seqs):
    # Any leading shape: [B, rows, H] gives [B, rows, V].
    a, b = client.hidden_states([seqs[0][:6], seqs[1][:6]])
    both = head.log_probs(np.stack([a, b]))
    assert both.shape == (2, 5, head.vocab_size)
    np.testing.assert_allclose(both[1], head.log_probs(b), rtol=0, atol=1e-6)


def test_starts_per_sequence(client, head, seqs):
    full = client.hidden_states(seqs[:3])
    starts = [1, 0, 4]
    part = client.hidden_states(seqs[:3], starts=starts)
    scores = client.score(seqs[:3], k=K, starts=starts)
    for s, f, p, st, sc in zip(seqs, full, part, starts, scores):
        assert p.shape == (len(s) - 1 - st, head.hidden_size)
        np.testing.assert_allclose(p, f[st:], rtol=0, atol=1e-6)
        _check_against_scores(head.log_probs(p), s, st, sc, F32_ATOL)
    # `start` for every sequence; `starts` overrides it.
    same = client.hidden_states(seqs[:3], start=2)
    for s, f, p in zip(seqs, full, same):
        assert p.shape == (len(s) - 3, head.hidden_size)
        np.testing.assert_allclose(p, f[2:], rtol=0, atol=1e-6)
    over = client.hidden_states(seqs[:3], start=2, starts=starts)
    for p, q in zip(part, over):
        assert p.shape == q.shape


def test_refusals_name_the_field(client, seqs):
    with pytest.raises(TeacherError) as e:
        client.hidden_states([seqs[0], [10**8]])
    assert (e.value.status, e.value.type, e.value.field) == (422, "invalid_request",
                                                             "sequences[1][0]")
    with pytest.raises(TeacherError) as e:
        client.hidden_states(seqs[:2], starts=[0])
    assert e.value.status == 422 and e.value.field == "starts"
    with pytest.raises(ValueError, match="return_tensors"):
        client.hidden_states(seqs[:1], return_tensors="tf")  # type: ignore[call-overload]


# -- torch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", TAUS)
def test_torch_log_probs(client, head, seqs, tau):
    torch = pytest.importorskip("torch")
    st = client.hidden_states(seqs[:3], return_tensors="pt")
    ref_np = client.hidden_states(seqs[:3])
    assert st.dtype == "f32" and st.head_fingerprint == head.fingerprint
    scores = client.score(seqs[:3], k=K, temperature=tau)
    for s, t, n, sc in zip(seqs, st, ref_np, scores):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        np.testing.assert_array_equal(t.numpy(), n)
        lp = head.log_probs(t, tau)
        assert lp.dtype == torch.float32 and tuple(lp.shape) == (len(s) - 1, head.vocab_size)
        _check_against_scores(lp.numpy(), s, 0, sc, F32_ATOL)
        np.testing.assert_allclose(lp.numpy(), head.log_probs(n, tau), rtol=0, atol=1e-5)


# -- the head cache ---------------------------------------------------------------------------


def test_head_cache_downloads_once(client, base, head, tmp_path):
    cache = tmp_path / "heads"
    before = _request_count(base, "/v1/head")
    first = client.head(cache_dir=cache)
    assert _request_count(base, "/v1/head") == before + 1
    path = cache / f"{head.fingerprint}.safetensors"
    assert first.path == path and sorted(os.listdir(cache)) == [path.name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == head.fingerprint
    np.testing.assert_array_equal(first.weight, head.weight)
    mtime = path.stat().st_mtime_ns
    not_modified = _request_count(base, "/v1/head", "error")

    # Second call: the file is read; the server is only asked whether it is current (304).
    second = client.head(cache_dir=str(cache))
    assert _request_count(base, "/v1/head") == before + 1
    assert _request_count(base, "/v1/head", "error") == not_modified + 1
    assert path.stat().st_mtime_ns == mtime
    assert second.path == path and second.fingerprint == head.fingerprint
    np.testing.assert_array_equal(second.weight, head.weight)
    assert (second.vocab_size, second.tied, second.model) == (head.vocab_size, head.tied,
                                                              head.model)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_corrupt_cached_head_is_fetched_again(client, base, head, tmp_path, damage):
    cache = tmp_path / "heads"
    client.head(cache_dir=cache)
    path = cache / f"{head.fingerprint}.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # one bit of the weight
    elif damage == "truncate":
        data = data[:len(data) - 4]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    before = _request_count(base, "/v1/head")
    again = client.head(cache_dir=cache)
    assert _request_count(base, "/v1/head") == before + 1
    assert hashlib.sha256(path.read_bytes()).hexdigest() == head.fingerprint
    np.testing.assert_array_equal(again.weight, head.weight)
    assert sorted(os.listdir(cache)) == [path.name]


# -- fingerprints and missing heads, through a proxy -------------------------------------------


class _Proxy:
    """A local HTTP proxy in front of a teacher that can rewrite `/v1/info`'s `full_vocab`, the
    head's bytes and headers, and answer routes with 501 `head_unavailable`."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.info_fingerprint: Optional[str] = None  # replaces full_vocab.head_fingerprint
        self.drop_full_vocab = False
        self.flip_head_byte = False
        self.drop_head_headers = False
        self.no_head = False
        self.cut_heads = 0  # this many head answers break off half-way
        self.head_gets = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: Dict[str, str],
                      cut: bool = False) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if cut:  # half the body, then the connection closes
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                try:
                    self.wfile.write(body)
                except OSError:  # the client hung up (it refused what it had read)
                    self.close_connection = True

            def _unavailable(self) -> None:
                self._send(501, json.dumps({"error": {
                    "type": "head_unavailable", "message": "no head here", "field": None}}
                ).encode(), {"Content-Type": "application/json"})

            def do_GET(self) -> None:
                if self.path == "/v1/head":
                    proxy.head_gets += 1
                    if proxy.no_head:
                        return self._unavailable()
                hop = {k: v for k, v in self.headers.items() if k.lower() in (
                    "if-none-match", "accept")}
                r = requests.get(proxy.upstream + self.path, headers=hop, timeout=60)
                body = r.content
                headers = {k: v for k, v in r.headers.items()
                           if k.lower() in ("content-type", "etag",
                                            HEAD_FINGERPRINT_HEADER.lower())}
                if self.path == "/v1/info":
                    info = r.json()
                    if proxy.drop_full_vocab:
                        info.pop("full_vocab", None)
                    elif proxy.info_fingerprint is not None:
                        info["full_vocab"]["head_fingerprint"] = proxy.info_fingerprint
                    body = json.dumps(info).encode()
                elif self.path == "/v1/head":
                    if proxy.flip_head_byte and body:
                        b = bytearray(body)
                        b[-1] ^= 0x01
                        body = bytes(b)
                    if proxy.drop_head_headers:
                        headers = {k: v for k, v in headers.items()
                                   if k.lower() == "content-type"}
                    if proxy.cut_heads > 0 and r.status_code == 200:
                        proxy.cut_heads -= 1
                        return self._send(200, body, headers, cut=True)
                self._send(r.status_code, body if r.status_code != 304 else b"", headers)

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if proxy.no_head:
                    return self._unavailable()
                r = requests.post(proxy.upstream + self.path, data=data, timeout=60, headers={
                    "Content-Type": self.headers.get("Content-Type", "application/msgpack")})
                self._send(r.status_code, r.content,
                           {"Content-Type": r.headers.get("Content-Type", "")})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(base):
    p = _Proxy(base)
    yield p
    p.close()


def test_the_proxy_passes_the_head_through(proxy, head, tmp_path):
    # The refusals below come from what the proxy changes, not from the proxy itself.
    with TeacherClient(proxy.url) as c:
        got = c.head(cache_dir=tmp_path)
        np.testing.assert_array_equal(got.weight, head.weight)
        assert c.head(cache_dir=tmp_path).fingerprint == head.fingerprint
        [h] = c.hidden_states([[1, 2, 3]])
        assert h.shape == (2, head.hidden_size)
    assert proxy.head_gets == 2


def test_a_head_announced_with_another_fingerprint_is_refused(proxy, head, tmp_path):
    wrong = hashlib.sha256(b"another head").hexdigest()
    proxy.info_fingerprint = wrong
    with TeacherClient(proxy.url) as c:
        for cache in (None, tmp_path):
            with pytest.raises(HeadFingerprintMismatch) as e:
                c.head(cache_dir=cache)
            assert (e.value.expected, e.value.got) == (wrong, head.fingerprint)
            assert e.value.type == "head_fingerprint_mismatch"
            assert isinstance(e.value, TeacherError) and not e.value.retryable
    assert os.listdir(tmp_path) == []


def test_a_head_whose_bytes_do_not_hash_to_the_fingerprint_is_refused(proxy, head, tmp_path):
    proxy.flip_head_byte = True
    proxy.drop_head_headers = True  # only the body's hash can tell
    with TeacherClient(proxy.url, max_attempts=1) as c:
        for cache in (None, tmp_path):
            with pytest.raises(HeadFingerprintMismatch) as e:
                c.head(cache_dir=cache)
            assert e.value.expected == head.fingerprint != e.value.got
    assert os.listdir(tmp_path) == []  # neither the file nor a temporary one is left


def test_the_callers_fingerprint_is_checked(client, head):
    other = "0" * 64
    with pytest.raises(HeadFingerprintMismatch) as e:
        client.head(fingerprint=other)
    assert (e.value.expected, e.value.got) == (other, head.fingerprint)
    st = client.hidden_states([[1, 2, 3]])
    assert client.head(fingerprint=st.head_fingerprint).fingerprint == head.fingerprint
    with pytest.raises(ValueError, match="64 hex digits"):
        client.head(fingerprint="../../etc/passwd")


def test_the_fingerprint_is_checked_against_a_patched_info(client, head, monkeypatch, tmp_path):
    real = client.info()
    fake = json.loads(json.dumps(real))
    fake["full_vocab"]["head_fingerprint"] = head.fingerprint[::-1]
    monkeypatch.setattr(client, "info", lambda: fake)
    with pytest.raises(HeadFingerprintMismatch):
        client.head(cache_dir=tmp_path)


def test_head_bytes_past_the_heads_shape_are_refused(client, head, monkeypatch, tmp_path):
    # The download is bounded by head_bytes, so a peer's 10^12 beside a small head's shape is
    # refused before anything is fetched; the server's own figure passes.
    real = client.info()
    fv = real["full_vocab"]
    rows, width = fv["head_rows"], fv["hidden_size"]
    assert fv["head_bytes"] > rows * width * {"f32": 4, "bf16": 2, "f16": 2}[fv["dtype"]]
    for bad in [10**12, "many", None]:
        fake = json.loads(json.dumps(real))
        fake["full_vocab"]["head_bytes"] = bad
        monkeypatch.setattr(client, "info", lambda fake=fake: fake)
        with pytest.raises(TeacherError) as e:
            client.head(cache_dir=tmp_path)
        assert e.value.type == "malformed_answer" and "head_bytes" in e.value.message
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cache", [False, True])
def test_a_head_that_breaks_off_is_fetched_again(proxy, head, tmp_path, cache):
    proxy.cut_heads = 2
    with TeacherClient(proxy.url, backoff_initial_s=0.01, backoff_max_s=0.01) as c:
        got = c.head(cache_dir=tmp_path if cache else None)
    assert proxy.head_gets == 3 and proxy.cut_heads == 0
    np.testing.assert_array_equal(got.weight, head.weight)
    if cache:
        assert os.listdir(tmp_path) == [f"{head.fingerprint}.safetensors"]
    # With one attempt, the broken body is the error (retryable: no answer came whole).
    proxy.cut_heads = 1
    with TeacherClient(proxy.url, max_attempts=1) as c:
        with pytest.raises(TeacherError) as e:
            c.head(cache_dir=tmp_path / "other" if cache else None)
    assert e.value.type == "connection_error" and e.value.retryable
    if cache:
        assert os.listdir(tmp_path / "other") == []


def test_no_full_vocab_is_head_unavailable(proxy, tmp_path):
    proxy.drop_full_vocab = True
    with TeacherClient(proxy.url) as c:
        with pytest.raises(HeadUnavailable) as e:
            c.head(cache_dir=tmp_path)
        assert e.value.type == "head_unavailable"
    assert proxy.head_gets == 0


def test_501_head_unavailable_is_head_unavailable(proxy):
    proxy.no_head = True
    with TeacherClient(proxy.url, max_attempts=1) as c:
        with pytest.raises(HeadUnavailable) as e:
            c.hidden_states([[1, 2, 3]])
        assert (e.value.status, e.value.type) == (501, "head_unavailable")
    # The head route's 501, with full_vocab still in /v1/info.
    with TeacherClient(proxy.url, max_attempts=1) as c:
        with pytest.raises(HeadUnavailable) as e:
            c.head()
        assert e.value.status == 501


# -- a bf16 teacher ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16(bf16_teacher):
    with TeacherClient(bf16_teacher.url) as c:
        yield c


def _bf16_bits(raw: bytes) -> np.ndarray:
    """bf16 wire values as f32, decoded independently of the client (struct, not numpy views)."""
    n = len(raw) // 2
    return np.array([struct.unpack("<f", b"\x00\x00" + raw[2 * i:2 * i + 2])[0]
                     for i in range(n)], dtype=np.float32)


def test_bf16_states_are_bf16_exact(bf16, bf16_teacher, seqs):
    info = bf16.info()
    assert info["dtype"] == info["full_vocab"]["dtype"] == "bf16"
    st = bf16.hidden_states(seqs[:2])
    assert st.dtype == "bf16"
    raw = requests.post(bf16_teacher.url + "/hidden_states",
                        data=msgpack.packb({"sequences": seqs[:2]}),
                        headers={"Content-Type": "application/msgpack"}, timeout=60)
    assert raw.status_code == 200
    answer = msgpack.unpackb(raw.content, raw=False)
    for h, r in zip(st, answer["results"]):
        assert h.dtype == np.float32 and list(h.shape) == r["shape"]
        assert len(r["hidden"]) == h.size * 2
        assert np.all(h.view(np.uint32) & 0xFFFF == 0)  # exactly bf16 values
        np.testing.assert_array_equal(h.ravel(), _bf16_bits(r["hidden"]))


def test_bf16_head(bf16, ref):
    head = bf16.head()
    assert head.dtype == "bf16" and head.weight.dtype == np.float32
    assert np.all(head.weight.view(np.uint32) & 0xFFFF == 0)
    # The model's f32 weights rounded to bf16 (to nearest): within half a bf16 ulp.
    w = ref.lm_head.astype(np.float32)
    assert np.all(np.abs(head.weight - w) <= np.abs(w) * 2.0 ** -7 + 1e-30)
    assert not np.array_equal(head.weight, w)


@pytest.mark.parametrize("tau", TAUS)
def test_bf16_log_probs_equal_its_topk_logits(bf16, seqs, tau):
    head = bf16.head()
    st = bf16.hidden_states(seqs[:4])
    assert st.head_fingerprint == head.fingerprint
    scores = bf16.score(seqs[:4], k=K, temperature=tau)
    worst = 0.0
    for s, h, sc in zip(seqs, st, scores):
        # The teacher's bf16 matmul writes bf16 logits: rounded the same way, the same values.
        _check_against_scores(head.log_probs(h, tau), s, 0, sc, F32_ATOL)
        if len(h):
            unrounded = head.log_probs(h, tau, round_logits=False)
            got = np.take_along_axis(unrounded, sc.topk_ids.astype(np.int64), -1)
            worst = max(worst, float(np.abs(got - sc.topk_values).max()))
            # Without the rounding: within a bf16 ulp of the logits (|z| < 8 here), no closer.
            _check_against_scores(unrounded, s, 0, sc, 2 * 2.0 ** -5 / tau)
    assert worst > F32_ATOL


def test_bf16_torch_states_are_bf16_as_sent(bf16, seqs):
    torch = pytest.importorskip("torch")
    pt = bf16.hidden_states(seqs[:2], return_tensors="pt")
    npy = bf16.hidden_states(seqs[:2])
    head = bf16.head()
    for t, n in zip(pt, npy):
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.float().numpy(), n)
        # Unrounded: the same to f32 rounding. Rounded to bf16, a logit whose f32 sums (torch's
        # order vs numpy's) straddle a rounding boundary may land one bf16 ulp apart: rare.
        np.testing.assert_allclose(head.log_probs(t, round_logits=False).numpy(),
                                   head.log_probs(n, round_logits=False), rtol=0, atol=1e-5)
        d = np.abs(head.log_probs(t).numpy() - head.log_probs(n))
        assert d.max() <= 2.0 ** -6 and np.mean(d > 1e-5) < 1e-3, (d.max(), np.mean(d > 1e-5))
