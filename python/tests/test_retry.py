"""The client's retry policy, against a real local HTTP server that answers scripted statuses.

The policy is the trainer's (trainer/src/client/): 408/429/502/503/504 and connection errors
(refused, reset, timed out) are retried with jittered exponential backoff or the answer's
`Retry-After`, until `max_retry_wait_s` (or `max_attempts`); everything else fails at once.
The client's sleeps are recorded (the real sleep still runs) so that the delays can be compared
exactly with the formula fed by the same seeded RNG; the server's arrival times bound them from
the other side.
"""

from __future__ import annotations

import gzip
import http.server
import json
import logging
import random
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple, Union

import msgpack
import numpy as np
import pytest
import requests

import xdistill.client as xclient
from xdistill import (MAX_RETRY_AFTER_S, RETRYABLE_STATUSES, AnswerTooLarge, RetriesExhausted,
                      TeacherClient, TeacherError, backoff_delay, parse_retry_after)

#: Slack for scheduling on a loaded machine: a retry may arrive this much later than its delay.
LATE_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _canned_answer(request: bytes = b"") -> bytes:
    """A valid MessagePack answer with one sequence of 2 rows, k = 2 (and one candidate's
    log-prob a row when `request` sent candidate ids)."""
    le_u32 = lambda v: np.asarray(v, "<u4").tobytes()  # noqa: E731
    le_f32 = lambda v: np.asarray(v, "<f4").tobytes()  # noqa: E731
    result = {"shape": [2, 2], "topk_ids": le_u32([5, 7, 1, 2]),
              "topk_values": le_f32([-0.5, -1.5, -0.25, -2.0]),
              "target_logprobs": le_f32([-1.5, -3.0]), "logsumexp": le_f32([2.5, 3.5])}
    if request and "ids" in msgpack.unpackb(request, raw=False):
        result.update(ids_shape=[2, 1], ids_logprobs=le_f32([-4.0, -5.0]))
    return msgpack.packb({
        "k": 2, "values": "logprobs", "temperature": 1.0, "model": "canned",
        "results": [result],
    }, use_bin_type=True)


def _check_canned(scores) -> None:
    [g] = scores
    np.testing.assert_array_equal(g.topk_ids, [[5, 7], [1, 2]])
    np.testing.assert_array_equal(g.topk_values, np.asarray([[-0.5, -1.5], [-0.25, -2.0]], np.float32))
    np.testing.assert_array_equal(g.target_logprobs, np.asarray([-1.5, -3.0], np.float32))
    np.testing.assert_array_equal(g.logsumexp, np.asarray([2.5, 3.5], np.float32))


#: One scripted answer: an HTTP status with extra headers, "drop" (close the connection without
#: answering), ("stall", seconds) (answer 200 only after that long), "garbage" (200 with a
#: body that is not MessagePack), "endless" or "endless-400" (a chunked body of "x" that never
#: ends, until the client hangs up) or "huge" (200 declaring a terabyte, then nothing). 200 is
#: the canned score answer (JSON `{"protocol_version": 2}` to a GET). ("body", bytes) answers
#: 200 with those bytes, ("body", bytes, status) that status; ("encoded", coding, bytes,
#: status) answers that status with those bytes as `Content-Encoding: coding`.
Step = Union[int, Tuple[int, Dict[str, str]], str, Tuple[str, float], Tuple[str, bytes],
             Tuple[str, bytes, int], Tuple[str, str, bytes, int]]


class Scripted:
    """A local HTTP server answering `script[i]` to the i-th request (the canned 200 once the
    script is used up, or `after` when given). Records (headers, body, arrival time) of each."""

    def __init__(self, script: List[Step], after: Optional[Step] = None,
                 port: int = 0):
        self.script = list(script)
        self.after = after
        self.requests: List[Tuple[Dict[str, str], bytes, float]] = []
        self.written = 0  # bytes of endless bodies written
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                n = int(self.headers.get("Content-Length", 0) or 0)
                body = self.rfile.read(n) if n else b""
                with outer._lock:
                    i = len(outer.requests)
                    outer.requests.append((dict(self.headers), body, time.monotonic()))
                step = outer.script[i] if i < len(outer.script) else outer.after
                if step == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(step, tuple) and step[0] == "stall":
                    time.sleep(step[1])
                    step = None
                if isinstance(step, tuple) and step[0] == "encoded":
                    _, coding, payload, status = step
                    self._send(status, {"Content-Type": "application/msgpack",
                                        "Content-Encoding": coding}, payload)
                    return
                if isinstance(step, tuple) and step[0] == "body":
                    status = step[2] if len(step) > 2 else 200
                    self._send(status, {"Content-Type": "application/msgpack"}, step[1])
                    return
                if step is None and self.command == "GET":
                    self._send(200, {"Content-Type": "application/json"},
                               b'{"protocol_version": 2}')
                elif step is None:
                    self._send(200, {"Content-Type": "application/msgpack"},
                               _canned_answer(body))
                elif step in ("endless", "endless-400"):
                    self._endless(200 if step == "endless" else 400)
                elif step == "huge":
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 40))
                    self.end_headers()
                    time.sleep(2.0)
                    self.close_connection = True
                elif step == "garbage":
                    self._send(200, {"Content-Type": "application/msgpack"}, b"\xc1not msgpack")
                else:
                    status, headers = step if isinstance(step, tuple) else (step, {})
                    payload = (b'{"error": {"type": "scripted", "message": "status %d", '
                               b'"field": null}}' % status)
                    self._send(status, {"Content-Type": "application/json", **headers}, payload)

            def _send(self, status, headers, payload):
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the client went away (e.g. after its read timeout)

            def _endless(self, status):
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
                try:
                    while True:
                        self.wfile.write(chunk)
                        outer.written += len(chunk)
                except OSError:
                    self.close_connection = True  # the client hung up

            do_GET = do_POST = _answer  # noqa: N815 (http.server's naming)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False  # close() does not wait for a stalled answer
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def times(self) -> List[float]:
        return [t for _, _, t in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "Scripted":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def sleeps(monkeypatch) -> List[float]:
    """The delays the client sleeps between attempts, in order (the sleeps still happen)."""
    out: List[float] = []
    real = time.sleep

    def record(s: float) -> None:
        out.append(s)
        real(s)

    monkeypatch.setattr(xclient, "_sleep", record)
    return out


def _expected_delays(seed: int, n: int, initial: float, maximum: float) -> List[float]:
    rng = random.Random(seed)
    return [backoff_delay(i, initial, maximum, rng.random()) for i in range(n)]


def _assert_gaps(times: List[float], delays: List[float]) -> None:
    """Each retry arrived after its delay, and not much later."""
    gaps = np.diff(times)
    assert len(gaps) == len(delays), (gaps, delays)
    for g, d in zip(gaps, delays):
        assert d - 0.005 <= g <= d + LATE_S, (gaps, delays)


# -- the pure pieces (the same cases as trainer/src/client/retry.rs) ---------------------------


def test_backoff_doubles_caps_and_jitters_within_half():
    full = [round(backoff_delay(f, 0.1, 1.0, 1.0) * 1000) for f in range(6)]
    assert full == [100, 200, 400, 800, 1000, 1000]  # u = 1: no reduction
    assert backoff_delay(2, 0.1, 1.0, 0.0) == pytest.approx(0.2)  # u = 0: half
    assert backoff_delay(1000, 0.1, 1.0, 0.5) == pytest.approx(0.75)
    # u is clamped to [0, 1]; a negative failure count is the first retry's.
    assert backoff_delay(0, 0.1, 1.0, 7.0) == pytest.approx(0.1)
    assert backoff_delay(0, 0.1, 1.0, -3.0) == pytest.approx(0.05)
    assert backoff_delay(-1, 0.1, 1.0, 1.0) == pytest.approx(0.1)
    rng = random.Random(1)
    for f in range(12):
        cap = min(0.1 * 2 ** f, 1.0)
        for _ in range(50):
            assert 0.5 * cap <= backoff_delay(f, 0.1, 1.0, rng.random()) <= cap


def test_retry_after_seconds():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0.25 ") == 0.25
    assert parse_retry_after("0") == 0.0
    assert parse_retry_after("-1") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None  # HTTP dates: backoff
    assert parse_retry_after("1e9") == MAX_RETRY_AFTER_S == 86400.0
    for bad in (None, "", "soon", "inf", "nan", "1_0", "1e999", "0x10"):
        assert parse_retry_after(bad) is None, bad


def test_the_constructor_refuses_nonsense():
    for kwargs in ({"max_retry_wait_s": -1.0}, {"backoff_initial_s": 2.0, "backoff_max_s": 1.0},
                   {"max_attempts": 0}, {"timeout": 0.0}, {"max_retry_wait_s": float("inf")}):
        with pytest.raises(ValueError):
            TeacherClient("http://127.0.0.1:1", **kwargs)


def test_defaults_are_the_trainers():
    """`[teacher]` defaults of trainer/src/config.rs."""
    c = TeacherClient("http://127.0.0.1:1")
    assert (c.timeout, c.connect_timeout, c.max_retry_wait_s, c.max_attempts,
            c.backoff_initial_s, c.backoff_max_s) == (300.0, 10.0, 1800.0, None, 0.5, 30.0)
    assert RETRYABLE_STATUSES == {408, 429, 502, 503, 504}


# -- which answers are retried ----------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 429, 502, 503, 504])
def test_transient_statuses_are_retried(status, sleeps):
    with Scripted([status, status]) as srv:
        c = TeacherClient(srv.url, api_key="k1", backoff_initial_s=0.01, backoff_max_s=0.02,
                          max_retry_wait_s=30)
        _check_canned(c.score([[1, 2, 3]], k=2, ids=[[[4], [5]]], starts=[0]))
        assert len(srv.requests) == 3 and len(sleeps) == 2
        # The retried request is the same request.
        bodies = {body for _, body, _ in srv.requests}
        assert len(bodies) == 1
        headers = {k.lower(): v for k, v in srv.requests[-1][0].items()}
        assert headers["content-type"] == headers["accept"] == "application/msgpack"
        assert headers["authorization"] == "Bearer k1"
        assert len(headers["x-xdistill-affinity"]) == 16
        req = msgpack.unpackb(bodies.pop(), raw=False)
        assert req["sequences"] == [[1, 2, 3]] and req["k"] == 2 and req["starts"] == [0]
        assert req["ids"] == [[[4], [5]]] and req["values"] == "logprobs"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 415, 422, 500, 501, 505])
def test_other_statuses_fail_at_once(status, sleeps):
    with Scripted([status], after=503) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01, max_retry_wait_s=30)
        with pytest.raises(TeacherError) as e:
            c.score([[1, 2, 3]], k=2)
        assert type(e.value) is TeacherError
        assert e.value.status == status and e.value.type == "scripted"
        assert e.value.message == f"status {status}"
        assert len(srv.requests) == 1 and sleeps == []


def test_gets_are_retried_too(sleeps):
    with Scripted([502, 504]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01, backoff_max_s=0.02)
        assert c.info()["protocol_version"] == 2
        assert len(srv.requests) == 3 and len(sleeps) == 2


def test_a_malformed_answer_is_not_retried(sleeps):
    with Scripted(["garbage"]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01)
        with pytest.raises(TeacherError) as e:
            c.score([[1, 2, 3]], k=2)
        assert e.value.status == 200 and e.value.type == "malformed_answer"
        assert len(srv.requests) == 1 and sleeps == []


def _answer(**change) -> bytes:
    """The canned answer with its one result's fields changed (None: removed)."""
    a = msgpack.unpackb(_canned_answer(), raw=False)
    for key, v in change.items():
        if v is None:
            a["results"][0].pop(key, None)
        else:
            a["results"][0][key] = v
    return msgpack.packb(a, use_bin_type=True)


def test_answers_are_checked_against_the_request(sleeps):
    """An answer of other rows, more than k entries, or candidate log-probs nobody asked for is
    a malformed answer, never data of another shape; so are numbers no shape can hold, JSON
    nested past Python's recursion limit, and an info that is not an object."""
    le = lambda n: np.zeros(n, "<f4").tobytes()  # noqa: E731
    bad = [
        _answer(shape=[0, 0], topk_ids=b"", topk_values=b"", target_logprobs=b"", logsumexp=b""),
        _answer(shape=[-1, 2]),  # numpy would infer the -1
        _answer(shape=[1, 4], target_logprobs=le(1), logsumexp=le(1)),  # 4 entries, k = 2
        _answer(shape=[float("inf"), 2]),
        _answer(ids_shape=[2, 1], ids_logprobs=le(2)),  # no ids were sent
    ]
    for body in bad:
        with Scripted([("body", body)]) as srv:
            with pytest.raises(TeacherError) as e:
                TeacherClient(srv.url).score([[1, 2, 3]], k=2)
            assert (e.value.status, e.value.type) == (200, "malformed_answer"), body
    # Candidates were sent: their shape must come back, [rows, m].
    ids = [[[4], [6]]]
    for shape in [None, [2, 2], [1, 2]]:
        body = _answer(ids_shape=shape, ids_logprobs=le(4))
        with Scripted([("body", body)]) as srv:
            with pytest.raises(TeacherError) as e:
                TeacherClient(srv.url).score([[1, 2, 3]], k=2, ids=ids)
            assert e.value.type == "malformed_answer", shape
    with Scripted([("body", _answer(ids_shape=[2, 1], ids_logprobs=le(2)))]) as srv:
        [s] = TeacherClient(srv.url).score([[1, 2, 3]], k=2, ids=ids)
        assert s.ids_logprobs.shape == (2, 1)
    # /hidden_states: the rows asked for, a positive width.
    for shape, width in [([1, 2], 2), ([2, 0], 0)]:
        body = msgpack.packb({"dtype": "f32", "hidden_size": width, "model": "m",
                              "head_fingerprint": "f" * 64,
                              "results": [{"shape": shape, "hidden": le(shape[0] * shape[1])}]},
                             use_bin_type=True)
        with Scripted([("body", body)]) as srv:
            with pytest.raises(TeacherError) as e:
                TeacherClient(srv.url).hidden_states([[1, 2, 3]])
            assert e.value.type == "malformed_answer", shape
    # /v1/info: a JSON object, or a malformed answer (not a list handed on, not a RecursionError).
    for body in [b"[]", b"5", b"[" * 100_000, b"\xff"]:
        with Scripted([("body", body)]) as srv:
            with pytest.raises(TeacherError) as e:
                TeacherClient(srv.url).info()
            assert e.value.type == "malformed_answer", body[:8]
    # An error body nested past the recursion limit is still the server's status.
    with Scripted([("body", b"[" * 60_000, 400)]) as srv:
        with pytest.raises(TeacherError) as e:
            TeacherClient(srv.url).score([[1, 2, 3]], k=2)
        assert (e.value.status, e.value.type) == (400, "http_error")


def test_compressed_answers_are_refused_unread(sleeps):
    """The client asks for answers as sent, and refuses a compressed one without inflating
    it: here gzip over gzip of 64 MiB of zeros, 10,000 times smaller than its content, which a
    client that inflated would read (urllib3 before 2.6 bounds neither a chunk's expansion nor
    a chain of encodings). A 2xx answer is malformed; an error answer keeps its status, so a
    compressed 503 is still retried."""
    bomb = gzip.compress(gzip.compress(bytes(64 << 20), 1), 1)
    assert len(bomb) < (64 << 20) // 10_000
    for coding in ["gzip, gzip", "GZIP", "deflate", "br"]:
        with Scripted([("encoded", coding, bomb, 200)]) as srv:
            c = TeacherClient(srv.url, backoff_initial_s=0.01)
            with pytest.raises(TeacherError) as e:
                c.score([[1, 2, 3]], k=2)
            assert (e.value.status, e.value.type) == (200, "malformed_answer"), coding
            assert f"Content-Encoding: {coding.lower()}" in e.value.message
            assert srv.requests[0][0].get("Accept-Encoding") == "identity"
            assert len(srv.requests) == 1 and sleeps == []
    with Scripted([("encoded", "gzip", bomb, 503)]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01)
        _check_canned(c.score([[1, 2, 3]], k=2))
        assert len(srv.requests) == 2 and len(sleeps) == 1
    with Scripted([("encoded", "gzip", bomb, 400)]) as srv:
        with pytest.raises(TeacherError) as e:
            TeacherClient(srv.url).info()
        assert (e.value.status, e.value.type) == (400, "http_error")
        assert "not read" in e.value.message
    # "identity" is an answer as sent.
    with Scripted([("encoded", "identity", _canned_answer(), 200)]) as srv:
        _check_canned(TeacherClient(srv.url).score([[1, 2, 3]], k=2))


def test_head_fingerprints_are_whole_hex_strings():
    """A fingerprint is 64 hex digits and nothing after them (it names the head's cached file):
    a trailing newline from the server is a malformed answer, from the caller a ValueError;
    neither is taken for a fingerprint that merely does not match."""
    def info(fp: str) -> bytes:
        return json.dumps({"full_vocab": {"head_fingerprint": fp, "head_rows": 4,
                                          "hidden_size": 2, "head_bytes": 200,
                                          "dtype": "f32"}}).encode()
    fp = "ab" * 32
    with Scripted([("body", info(fp + "\n"))]) as srv:
        with pytest.raises(TeacherError) as e:
            TeacherClient(srv.url).head()
        assert (e.value.status, e.value.type) == (200, "malformed_answer")
        assert "head_fingerprint" in e.value.message
    for given in [fp + "\n", fp[:-1], "../" + fp[3:]]:
        with Scripted([("body", info(fp))]) as srv:
            with pytest.raises(ValueError, match="64 hex digits"):
                TeacherClient(srv.url).head(fingerprint=given)


def test_a_redirect_loop_is_a_teacher_error_at_once(sleeps):
    """requests' own errors that another attempt would meet again (a redirect loop, a redirect
    to a scheme it cannot follow) are a TeacherError, not retried."""
    for location in ["/loop", "foo://elsewhere"]:
        with Scripted([], after=(302, {"Location": location})) as srv:
            with pytest.raises(TeacherError) as e:
                TeacherClient(srv.url, backoff_initial_s=0.01).score([[1, 2, 3]], k=2)
            assert e.value.type == "bad_answer", location
            assert sleeps == []


def test_a_non_ascii_content_length_is_not_a_crash():
    """`"²".isdigit()` is true and `int("²")` a ValueError: a declared length is read only when
    it is ASCII digits."""
    from xdistill.client import _read_capped

    class Answer:
        status_code, url = 200, "http://t/x"
        request = type("R", (), {"method": "GET"})()

        def __init__(self, length: str):
            self.headers = {"Content-Length": length}

        def iter_content(self, n: int):
            yield b"abc"

    assert _read_capped(Answer("\u00b2"), 10) == b"abc"
    with pytest.raises(AnswerTooLarge):
        _read_capped(Answer("11"), 10)


def test_answers_without_end_are_cut_at_the_requests_limit(sleeps):
    """An answer longer than any answer to its request can be (a body without end, a declared
    terabyte) is an AnswerTooLarge at the request's limit, not retried and not the caller's
    memory filling; an error answer without end is read for its start only."""
    with Scripted(["endless", "endless"]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01)
        with pytest.raises(AnswerTooLarge) as e:
            c.score([[1, 2, 3]], k=2)
        assert (e.value.status, e.value.type) == (200, "answer_too_large")
        # The limit follows the request: 2 rows of k = 2 are far under a megabyte.
        assert "longer than" in e.value.message and len(srv.requests) == 1 and sleeps == []
        with pytest.raises(AnswerTooLarge):
            c.info()
        time.sleep(0.2)
        written = srv.written
        time.sleep(0.3)
        assert srv.written == written, "the server still writes: the client did not hang up"
        assert written < 64 << 20
    with Scripted(["huge"]) as srv:
        t0 = time.monotonic()
        with pytest.raises(AnswerTooLarge):
            TeacherClient(srv.url).tokenizer_json()
        assert time.monotonic() - t0 < 1.5, "the declared length was not refused up front"
    with Scripted(["endless-400"]) as srv:
        with pytest.raises(TeacherError) as e:
            TeacherClient(srv.url).score([[1, 2, 3]], k=2)
        assert (e.value.status, e.value.type, e.value.message) == (400, "http_error", "x" * 500)


def test_a_dropped_connection_is_retried(sleeps):
    """The server closes the connection without answering (what a dying replica does)."""
    with Scripted(["drop", "drop"]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01, backoff_max_s=0.02)
        _check_canned(c.score([[1, 2, 3]], k=2))
        assert len(srv.requests) == 3 and len(sleeps) == 2


def test_a_read_timeout_is_retried(sleeps):
    """As in the trainer's client: a timed-out attempt is retried (scoring is idempotent; the
    server drops the queued work of a client that went away)."""
    with Scripted([("stall", 2.0)]) as srv:
        c = TeacherClient(srv.url, timeout=0.3, backoff_initial_s=0.01, backoff_max_s=0.02)
        t0 = time.monotonic()
        _check_canned(c.score([[1, 2, 3]], k=2))
        assert len(srv.requests) == 2 and len(sleeps) == 1
        assert time.monotonic() - t0 < 2.0, "the second attempt did not wait for the first"


def test_a_refused_connection_is_retried_until_the_server_comes_up(sleeps):
    port = _free_port()
    holder: List[Scripted] = []
    starter = threading.Timer(0.6, lambda: holder.append(Scripted([], port=port)))
    starter.start()
    try:
        c = TeacherClient(f"http://127.0.0.1:{port}", backoff_initial_s=0.05,
                          backoff_max_s=0.2, max_retry_wait_s=30)
        _check_canned(c.score([[1, 2, 3]], k=2))
        assert len(sleeps) >= 2
    finally:
        starter.join()
        for s in holder:
            s.close()


# -- delays -----------------------------------------------------------------------------------


def test_backoff_is_jittered_exponential_and_reproducible(sleeps):
    initial, maximum, seed = 0.04, 0.2, 7
    with Scripted([503] * 6) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=initial, backoff_max_s=maximum,
                          rng=random.Random(seed))
        _check_canned(c.score([[1, 2, 3]], k=2))
        want = _expected_delays(seed, 6, initial, maximum)
        assert sleeps == want  # exactly the formula with the seeded draws
        for f, d in enumerate(sleeps):  # within [cap / 2, cap] of min(initial * 2^f, max)
            cap = min(initial * 2 ** f, maximum)
            assert 0.5 * cap <= d <= cap
        assert len(set(sleeps)) == len(sleeps), "no jitter"
        _assert_gaps(srv.times, want)
    # Another seed, other delays: the jitter comes from the RNG.
    assert _expected_delays(8, 6, initial, maximum) != want


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_honoured(status, sleeps):
    with Scripted([(status, {"Retry-After": "0.3"}), (status, {"Retry-After": "1"})]) as srv:
        # A backoff far from the server's delays, so that only Retry-After explains them.
        c = TeacherClient(srv.url, backoff_initial_s=5.0, backoff_max_s=5.0)
        _check_canned(c.score([[1, 2, 3]], k=2))
        assert sleeps == [0.3, 1.0]
        _assert_gaps(srv.times, sleeps)


def test_an_http_date_retry_after_falls_back_to_the_backoff(sleeps):
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    with Scripted([(503, {"Retry-After": date}), (503, {"Retry-After": "-3"})]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.05, backoff_max_s=1.0,
                          rng=random.Random(3))
        _check_canned(c.score([[1, 2, 3]], k=2))
        assert sleeps == _expected_delays(3, 2, 0.05, 1.0)


def test_the_total_wait_is_respected(sleeps):
    budget, initial, maximum, seed = 1.0, 0.05, 0.3, 11
    with Scripted([], after=503) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=initial, backoff_max_s=maximum,
                          max_retry_wait_s=budget, rng=random.Random(seed))
        t0 = time.monotonic()
        with pytest.raises(RetriesExhausted) as e:
            c.score([[1, 2, 3]], k=2)
        took = time.monotonic() - t0
    err = e.value
    attempts = len(srv.requests)
    # It slept the formula's delays in order, gave up instead of the next one (which would have
    # ended past the budget), and never slept past the budget.
    want = _expected_delays(seed, attempts, initial, maximum)
    assert sleeps == want[:attempts - 1]
    assert sum(sleeps) <= budget
    assert err.attempts == attempts >= 4
    assert err.waited_s + want[attempts - 1] > budget
    assert budget - maximum <= took <= budget + LATE_S
    assert srv.times[-1] - srv.times[0] <= budget
    # The error carries the last answer, and says how many tries it made.
    assert err.status == 503 and err.type == "scripted" and err.last.status == 503
    assert isinstance(err, TeacherError)
    assert f"gave up after {attempts} attempts" in str(err) and "503" in str(err)


def test_a_retry_after_beyond_the_total_wait_gives_up_at_once(sleeps):
    with Scripted([(503, {"Retry-After": "60"})]) as srv:
        c = TeacherClient(srv.url, max_retry_wait_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(RetriesExhausted) as e:
            c.score([[1, 2, 3]], k=2)
        assert time.monotonic() - t0 < 2.0 and sleeps == []
        assert e.value.attempts == 1 and len(srv.requests) == 1


def test_max_attempts_caps_the_tries(sleeps):
    with Scripted([], after=502) as srv:
        c = TeacherClient(srv.url, max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.01)
        with pytest.raises(RetriesExhausted) as e:
            c.info()
        assert len(srv.requests) == 3 and len(sleeps) == 2
        assert e.value.attempts == 3 and e.value.status == 502
        assert "gave up after 3 attempts" in str(e.value)


def test_giving_up_on_connection_errors_names_the_cause(sleeps):
    c = TeacherClient(f"http://127.0.0.1:{_free_port()}", backoff_initial_s=0.05,
                      backoff_max_s=0.1, max_retry_wait_s=0.5, timeout=2)
    with pytest.raises(RetriesExhausted) as e:
        c.score([[1, 2]], k=1)
    err = e.value
    assert err.status is None and err.type == "connection_error"
    assert isinstance(err.__cause__, requests.ConnectionError)
    assert err.attempts == len(sleeps) + 1 >= 3
    assert "gave up after" in str(err) and "connection_error" in str(err)


def test_each_retry_is_logged(caplog, sleeps):
    caplog.set_level(logging.INFO, logger="xdistill")
    with Scripted([504]) as srv:
        c = TeacherClient(srv.url, backoff_initial_s=0.01, backoff_max_s=0.01)
        c.score([[1, 2, 3]], k=2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "attempt 1 failed" in warnings[0] and "504" in warnings[0]
    assert any("succeeded after 2 attempts" in r.getMessage() for r in caplog.records)
