"""The Python client (`xdistill.TeacherClient`) against a real teacher.

Every value is checked against an independent one: the JSON native route of the same server
(the client speaks MessagePack), or the f64 numpy reference of the model (`reference.py`).
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np
import pytest

from helpers import (API_KEY, LIMITED_MAX_K, LIMITED_QUEUE_TOKENS, REF_ATOL, ROUTE_ATOL,
                     assert_topk_matches_ref, native_topk)
from xdistill import (PROTOCOL_VERSION, RetriesExhausted, SequenceScores, TeacherClient,
                      TeacherError, TorchSequenceScores)


@pytest.fixture(scope="module")
def client(base):
    with TeacherClient(base) as c:
        yield c


def _rows(s, start):
    return max(len(s) - 1 - start, 0)


# -- info, tokenizer, health ------------------------------------------------------------------


def test_info_reports_protocol_2_and_the_valid_vocabulary(client, ref, model_dir):
    info = client.info()
    assert info["protocol_version"] == PROTOCOL_VERSION == 2
    # Only the tokenizer's ids are valid; the LM head is padded beyond them (--pad-vocab-to 128).
    assert info["vocab_size"] == ref.n_valid
    assert info["logits_size"] == ref.cfg["vocab_size"] > ref.n_valid
    assert info["max_seq_len"] == 256


def test_tokenizer_json_is_the_model_file(client, model_dir, tok):
    assert client.tokenizer_json() == (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    t = client.tokenizer()
    assert t.encode("hello world").ids == tok.encode("hello world").ids


def test_tokenizer_without_the_package_names_the_install(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        client.tokenizer()


def test_health(client):
    assert client.health() is True
    assert TeacherClient(f"http://127.0.0.1:{_free_port()}", timeout=2).health() is False


# -- scores -----------------------------------------------------------------------------------


def test_score_equals_the_json_route(client, base, seqs):
    k = 5
    got = client.score(seqs, k=k)
    want = native_topk(base, {"sequences": seqs, "k": k})["results"]
    assert len(got) == len(seqs)
    for s, g, w in zip(seqs, got, want):
        rows = _rows(s, 0)
        assert isinstance(g, SequenceScores)
        assert g.rows == rows and g.k == k
        assert g.topk_ids.dtype == np.uint32 and g.topk_ids.shape == (rows, k)
        for name in ("topk_values", "target_logprobs", "logsumexp"):
            assert getattr(g, name).dtype == np.float32
        assert g.topk_values.shape == (rows, k)
        assert g.target_logprobs.shape == g.logsumexp.shape == (rows,)
        assert g.ids_logprobs is None
        np.testing.assert_array_equal(g.topk_ids, np.asarray(w["topk_ids"], np.uint32).reshape(rows, k))
        np.testing.assert_allclose(g.topk_values, np.asarray(w["topk_values"]).reshape(rows, k),
                                   rtol=0, atol=ROUTE_ATOL)
        np.testing.assert_allclose(g.target_logprobs, w["target_logprobs"], rtol=0, atol=ROUTE_ATOL)
        np.testing.assert_allclose(g.logsumexp, w["logsumexp"], rtol=0, atol=ROUTE_ATOL)


def test_score_matches_the_reference(client, seqs, ref):
    k = 8
    for s, g in zip(seqs, client.score(seqs, k=k)):
        if len(s) < 2:
            continue
        lp = ref.logprobs(s)
        for r in range(len(s) - 1):
            assert_topk_matches_ref(g.topk_ids[r], g.topk_values[r], lp[r])
        np.testing.assert_allclose(g.target_logprobs, ref.targets(s), rtol=0, atol=REF_ATOL)
        np.testing.assert_allclose(g.logsumexp, ref.logsumexp(s)[:-1], rtol=0, atol=REF_ATOL)


def test_temperature(client, seqs, ref):
    tau = 0.7
    s = seqs[0]
    [g] = client.score([s], k=4, temperature=tau)
    lp = ref.logprobs(s, tau)
    for r in range(len(s) - 1):
        assert_topk_matches_ref(g.topk_ids[r], g.topk_values[r], lp[r])
    np.testing.assert_allclose(g.target_logprobs, ref.targets(s, tau), rtol=0, atol=REF_ATOL)
    np.testing.assert_allclose(g.logsumexp, ref.logsumexp(s, tau)[:-1], rtol=0, atol=REF_ATOL)


def test_values_logits(client, seqs, ref):
    tau = 0.7
    s = seqs[1]
    [g] = client.score([s], k=4, temperature=tau, values="logits")
    z = ref.logits(s) / tau
    for r in range(len(s) - 1):
        assert_topk_matches_ref(g.topk_ids[r], g.topk_values[r], z[r])
    # target_logprobs stay log-probs whatever `values` says.
    np.testing.assert_allclose(g.target_logprobs, ref.targets(s, tau), rtol=0, atol=REF_ATOL)


def test_k0_returns_only_targets_and_logsumexp(client, base, seqs, ref):
    got = client.score(seqs, k=0)
    want = native_topk(base, {"sequences": seqs, "k": 0})["results"]
    for s, g, w in zip(seqs, got, want):
        rows = _rows(s, 0)
        assert g.topk_ids.shape == g.topk_values.shape == (rows, 0)
        assert g.k == 0 and g.rows == rows
        # JSON: `[rows][0]`, one empty list per row.
        assert w["topk_ids"] == [[] for _ in range(rows)]
        assert w["topk_values"] == [[] for _ in range(rows)]
        np.testing.assert_allclose(g.target_logprobs, w["target_logprobs"], rtol=0, atol=ROUTE_ATOL)
        if rows:
            np.testing.assert_allclose(g.target_logprobs, ref.targets(s), rtol=0, atol=REF_ATOL)
            np.testing.assert_allclose(g.logsumexp, ref.logsumexp(s)[:-1], rtol=0, atol=REF_ATOL)


def test_start_and_per_sequence_starts(client, base, seqs, ref):
    use = [seqs[0], seqs[1], seqs[2], seqs[3]]
    starts = [3, 0, len(seqs[2]) - 1, 1]  # the last two give zero rows
    got = client.score(use, k=3, starts=starts)
    want = native_topk(base, {"sequences": use, "k": 3, "starts": starts})["results"]
    for s, st, g, w in zip(use, starts, got, want):
        rows = _rows(s, st)
        assert g.rows == rows and g.topk_ids.shape == (rows, 3)
        np.testing.assert_array_equal(g.topk_ids, np.asarray(w["topk_ids"], np.uint32).reshape(rows, 3))
        np.testing.assert_allclose(g.target_logprobs, ref.targets(s)[st:], rtol=0, atol=REF_ATOL)
        lp = ref.logprobs(s)
        for r in range(rows):
            assert_topk_matches_ref(g.topk_ids[r], g.topk_values[r], lp[st + r])
    # A scalar `start` applies to every sequence.
    [a, b] = client.score([seqs[0], seqs[1]], k=2, start=2)
    assert a.rows == len(seqs[0]) - 3 and b.rows == len(seqs[1]) - 3
    np.testing.assert_allclose(b.target_logprobs, ref.targets(seqs[1])[2:], rtol=0, atol=REF_ATOL)


def _candidates(s, start, m, n_valid, rng):
    """`[rows][m]` candidate ids: the actual next token, then random ids."""
    rows = _rows(s, start)
    out = rng.integers(0, n_valid, size=(rows, m))
    if rows:
        out[:, 0] = s[start + 1:]
    return out


def test_ids_logprobs_gather_the_reference(client, base, seqs, ref):
    rng = np.random.default_rng(11)
    tau = 0.7
    use = [seqs[0], seqs[1], seqs[3]]
    starts = [1, 0, 0]
    ms = [6, 1, 3]  # m may differ between sequences
    cand = [_candidates(s, st, m, ref.n_valid, rng) for s, st, m in zip(use, starts, ms)]
    # `values="logits"` must not change ids_logprobs: always full-vocabulary log-probs.
    got = client.score(use, k=2, starts=starts, temperature=tau, ids=cand, values="logits")
    want = native_topk(base, {"sequences": use, "k": 2, "starts": starts, "temperature": tau,
                              "values": "logits", "ids": [c.tolist() for c in cand]})["results"]
    for s, st, c, g, w in zip(use, starts, cand, got, want):
        rows = _rows(s, st)
        assert g.ids_logprobs is not None and g.ids_logprobs.dtype == np.float32
        assert g.ids_logprobs.shape == c.shape == (rows, c.shape[1])
        lp = ref.logprobs(s, tau)
        expect = lp[st + np.arange(rows)[:, None], c]
        np.testing.assert_allclose(g.ids_logprobs, expect, rtol=0, atol=REF_ATOL)
        np.testing.assert_allclose(g.ids_logprobs, np.asarray(w["ids_logprobs"]).reshape(c.shape),
                                   rtol=0, atol=ROUTE_ATOL)
        # Column 0 is the actual token: it equals target_logprobs.
        np.testing.assert_allclose(g.ids_logprobs[:, 0], g.target_logprobs, rtol=0, atol=ROUTE_ATOL)


def test_ids_with_k0(client, seqs, ref):
    s = seqs[2]
    rng = np.random.default_rng(5)
    c = _candidates(s, 0, 4, ref.n_valid, rng)
    [g] = client.score([s], k=0, ids=[c])
    assert g.topk_ids.shape == (len(s) - 1, 0)
    expect = ref.logprobs(s)[np.arange(len(s) - 1)[:, None], c]
    np.testing.assert_allclose(g.ids_logprobs, expect, rtol=0, atol=REF_ATOL)


def test_inputs_may_be_numpy_arrays(client, seqs):
    a = client.score([np.asarray(seqs[0], dtype=np.int64)], k=3)[0]
    b = client.score([seqs[0]], k=3)[0]
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)


def test_return_tensors_pt(client, seqs):
    torch = pytest.importorskip("torch")
    [g] = client.score([seqs[0]], k=3, return_tensors="pt")
    [n] = client.score([seqs[0]], k=3)
    assert isinstance(g, TorchSequenceScores) and g.rows == n.rows and g.k == n.k == 3
    assert g.topk_ids.dtype == torch.int64 and g.topk_values.dtype == torch.float32
    assert np.array_equal(g.topk_ids.numpy(), n.topk_ids.astype(np.int64))
    assert np.array_equal(g.target_logprobs.numpy(), n.target_logprobs)


def test_return_tensors_pt_without_torch_names_the_install(client, seqs, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="pip install torch"):
        client.score([seqs[0]], k=3, return_tensors="pt")


# -- errors -----------------------------------------------------------------------------------


def test_refusals_are_teacher_errors_naming_the_field(client, seqs, ref):
    with pytest.raises(TeacherError) as e:
        client.score([seqs[0], [1, 2, ref.n_valid]], k=3)
    assert e.value.status == 422 and e.value.type == "invalid_request"
    assert e.value.field == "sequences[1][2]"
    with pytest.raises(TeacherError) as e:
        client.score([seqs[0]], k=3, temperature=0.0)
    assert e.value.status == 422 and e.value.field == "temperature"


def test_too_large_request_is_413_and_not_retried(limited_teacher, seqs):
    c = TeacherClient(limited_teacher.url, max_attempts=3, backoff_initial_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(TeacherError) as e:
        c.score([list(range(1000, 1000 + LIMITED_QUEUE_TOKENS + 10))], k=1)
    assert e.value.status == 413 and e.value.type == "request_too_large"
    assert not isinstance(e.value, RetriesExhausted)
    assert time.monotonic() - t0 < 5.0, "a 413 must not be retried"
    with pytest.raises(TeacherError) as e:
        c.score([seqs[0]], k=LIMITED_MAX_K + 1)
    assert e.value.status == 422 and e.value.field == "k"
    # Within the limits it serves.
    [g] = c.score([seqs[0]], k=LIMITED_MAX_K)
    assert g.topk_ids.shape == (len(seqs[0]) - 1, LIMITED_MAX_K)


def test_api_key(auth_teacher, seqs):
    with pytest.raises(TeacherError) as e:
        TeacherClient(auth_teacher.url, max_attempts=1).score([seqs[0]], k=2)
    assert e.value.status == 401 and e.value.type == "unauthorized"
    assert not isinstance(e.value, RetriesExhausted)
    with pytest.raises(TeacherError) as e:
        TeacherClient(auth_teacher.url, api_key="wrong", max_attempts=1).info()
    assert e.value.status == 401
    c = TeacherClient(auth_teacher.url, api_key=API_KEY)
    [g] = c.score([seqs[0]], k=2)
    assert g.rows == len(seqs[0]) - 1
    assert c.info()["protocol_version"] == 2
    assert TeacherClient(auth_teacher.url).health() is True  # /health needs no key


# -- helpers --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_affinity_key_matches_the_rust_clients():
    """The same key as `xdistill_shared::protocol::affinity_key` (its unit test pins the byte
    layout: per sequence its length, then its ids, u32 little-endian)."""
    import hashlib
    import struct

    from xdistill import affinity_key

    want = hashlib.sha256(struct.pack("<IIII", 3, 1, 2, 3)).hexdigest()[:16]
    assert affinity_key([[1, 2, 3]]) == want
    assert affinity_key([np.array([1, 2, 3], dtype=np.int64)]) == want
    assert affinity_key([[1, 2], [3]]) != want
