"""Constants and assertion helpers shared by the test files."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import requests

#: The name every test server is started with (`--served-model-name`).
MODEL_NAME = "tiny"
#: The key of the server started with `--api-key`.
API_KEY = "secret"
#: Limits of the `limited_teacher` server.
LIMITED_MAX_K = 16
LIMITED_QUEUE_TOKENS = 64

#: Server (f32) against the f64 reference.
REF_ATOL = 1e-5
#: One route of the server against another: the same bits (scores are batch-invariant, and a
#: `max_tokens: 1` request scores its prompt with the plain request's forward; the JSON round trip
#: of an f32 is exact). The issue's 1e-6 is kept as the stated margin.
ROUTE_ATOL = 1e-6


def post(url: str, path: str, body, headers: Optional[dict] = None) -> requests.Response:
    """POSTs ``body`` as JSON (``body`` may be a ``str``/``bytes`` to send as is)."""
    h = {"Content-Type": "application/json", **(headers or {})}
    data = body if isinstance(body, (str, bytes)) else None
    if data is None:
        return requests.post(url + path, json=body, headers=h, timeout=60)
    return requests.post(url + path, data=data, headers=h, timeout=60)


def post_ok(url: str, path: str, body, headers: Optional[dict] = None):
    """POSTs JSON, asserts 200 and returns the decoded JSON answer."""
    r = post(url, path, body, headers)
    assert r.status_code == 200, (path, r.status_code, r.text[:2000])
    return r.json()


def native_topk(url: str, body: dict, headers: Optional[dict] = None) -> dict:
    """``POST /topk_logits`` as JSON; the decoded answer."""
    return post_ok(url, "/topk_logits", body, headers)


def assert_openai_error(r: requests.Response, status: int, param: Optional[str] = None,
                        contains: Optional[str] = None) -> dict:
    """Checks an error answer of the OpenAI-compatible routes:
    ``{"error": {"message", "type", "param", "code": status}}``; returns the ``error`` object."""
    assert r.status_code == status, (r.status_code, r.text[:2000])
    body = r.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == status, err
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def assert_topk_matches_ref(ids: Sequence[int], values: Sequence[float], ref_row: np.ndarray,
                            atol: float = REF_ATOL) -> None:
    """One row of top-k against the reference's row of log-probs (or values).

    Robust to the order of near-ties: the values must be sorted, equal the reference at the
    returned ids, and equal the reference's k largest values.
    """
    ids = np.asarray(ids, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    k = len(ids)
    assert values.shape == (k,)
    assert len(set(ids.tolist())) == k, "duplicate ids in a top-k row"
    assert np.all(np.diff(values) <= 0), values
    assert np.all(ids < ref_row.shape[0]), "an id beyond the valid vocabulary"
    np.testing.assert_allclose(values, ref_row[ids], rtol=0, atol=atol)
    best = np.sort(ref_row)[::-1][:k]
    np.testing.assert_allclose(values, best, rtol=0, atol=atol)


def true_rank_bounds(ref_row: np.ndarray, token: int, atol: float = REF_ATOL):
    """The 1-based rank of ``token`` in ``ref_row`` (number of entries ≥ its value), as an
    interval that absorbs f32-vs-f64 near-ties: ``(lo, hi)``."""
    t = ref_row[token]
    lo = int(np.sum(ref_row > t + atol)) + 1
    hi = int(np.sum(ref_row >= t - atol))
    return lo, hi
