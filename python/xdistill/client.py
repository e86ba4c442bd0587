"""HTTP client of the teacher's native protocol (``docs/protocol.md``).

Requests go out as MessagePack and answers come back as MessagePack whose numeric arrays are
little-endian binary blobs, decoded here with ``np.frombuffer`` (no per-element parsing).
The server is the validator: arguments are checked here only as far as needed to build a
request; every refusal comes back as a :class:`TeacherError` naming the offending field.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import msgpack
import numpy as np
import requests

#: The protocol version this client speaks (``/v1/info`` reports the server's). Version 2 added
#: ``k = 0`` and candidate ``ids``; everything else is version 1.
PROTOCOL_VERSION = 2

#: Longest single wait between retries, in seconds, whatever the backoff arrives at.
_MAX_SLEEP_S = 60.0

_MSGPACK = "application/msgpack"

#: Header with a stable hash of a request's sequences: a load balancer that hashes on it sends
#: the same text to the same teacher replica, whose cache then answers it (docs/protocol.md).
AFFINITY_HEADER = "X-Xdistill-Affinity"


def affinity_key(sequences: Sequence[Sequence[int]]) -> str:
    """The affinity key of a request: the first 16 hex digits of the SHA-256 of its sequences,
    each as its length then its ids, u32 little-endian (as the Rust clients compute it)."""
    h = hashlib.sha256()
    for s in sequences:
        ids = np.asarray(s, dtype="<u4")
        h.update(struct.pack("<I", len(ids)))
        h.update(ids.tobytes())
    return h.hexdigest()[:16]


class TeacherError(Exception):
    """A non-2xx answer from the teacher, or a request that could not be delivered.

    Attributes:
        status: the HTTP status (``None`` when no answer came back, e.g. the connection
            failed on every try).
        type: the error's ``type`` from the JSON body (``"invalid_request"``, ``"queue_full"``,
            ...), ``"connection_error"`` when no answer came back, ``"http_error"`` when the
            body was not the usual error JSON.
        message: the human-readable message.
        field: the request field the server refused (``"k"``, ``"sequences[0][3]"``, ...) or
            ``None``.
    """

    def __init__(self, status: Optional[int], type: str, message: str, field: Optional[str] = None):
        self.status = status
        self.type = type
        self.message = message
        self.field = field
        where = f" (field {field})" if field else ""
        super().__init__(f"{status if status is not None else 'no answer'} {type}: {message}{where}")

    @classmethod
    def from_response(cls, resp: requests.Response) -> "TeacherError":
        """Builds the error from an answer's ``{"error": {"type", "message", "field"}}`` body.

        The OpenAI-compatible routes name the field ``param`` instead; both are understood.
        """
        try:
            err = resp.json()["error"]
            if not isinstance(err, dict):
                raise TypeError("error is not an object")
            field = err.get("field", err.get("param"))
            return cls(resp.status_code, str(err.get("type", "http_error")),
                       str(err.get("message", "")), field)
        except (ValueError, KeyError, TypeError):
            text = resp.text[:500] if resp.content else resp.reason or ""
            return cls(resp.status_code, "http_error", text)


@dataclass
class SequenceScores:
    """The teacher's scores of one sequence.

    For a sequence of length ``S`` scored from ``start`` there are ``rows = S - 1 - start``
    rows; row ``r`` is the distribution at position ``start + r`` over the token at
    ``start + r + 1``.

    Arrays are numpy (``return_tensors="np"``) or torch tensors (``"pt"``):

    Attributes:
        topk_ids: ``[rows, k]`` token ids, sorted by descending value; ``uint32`` in numpy,
            ``int64`` in torch (ready for ``gather``).
        topk_values: ``[rows, k]`` float32 log-probs (or scaled logits with
            ``values="logits"``).
        target_logprobs: ``[rows]`` float32, log-prob of the actual next token.
        logsumexp: ``[rows]`` float32, ``log sum_v exp(z_v / temperature)``.
        ids_logprobs: ``[rows, m]`` float32 full-vocabulary log-probs at the candidate ids the
            request sent with ``ids=``, else ``None``.
    """

    topk_ids: Any
    topk_values: Any
    target_logprobs: Any
    logsumexp: Any
    ids_logprobs: Any = None

    @property
    def rows(self) -> int:
        """Number of scored positions."""
        return int(self.target_logprobs.shape[0])

    @property
    def k(self) -> int:
        """Top-k entries per row."""
        return int(self.topk_ids.shape[1])


def _int_list(x: Any) -> List[int]:
    """A 1-D sequence of ids (list, tuple, numpy array, torch tensor) as a list of ``int``."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(v) for v in x]


def _int_rows(x: Any) -> List[List[int]]:
    """A 2-D ``[rows][m]`` nested sequence of ids as lists of ``int``."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [_int_list(row) for row in x]


def _blob(buf: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A little-endian blob as a writable native-endian array of ``shape``."""
    native = np.dtype(dtype).newbyteorder("=")
    return np.frombuffer(buf, dtype).reshape(tuple(shape)).astype(native, copy=True)


def _import_torch():
    try:
        import torch  # noqa: WPS433 (optional dependency, imported on first use)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'return_tensors="pt" needs PyTorch: pip install torch (or use return_tensors="np")'
        ) from e
    return torch


class TeacherClient:
    """Client of one teacher server.

    Args:
        url: the server's base URL, e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer KEY`` (servers started with ``--api-key``).
        timeout: seconds to wait for each HTTP answer.
        max_retries: how many times a request is retried after an HTTP 503 (queue full, model
            loading) or a connection error / timeout, before the error is raised.
        backoff: first wait between retries, in seconds; doubled on each retry. A 503's
            ``Retry-After`` header, when given, is waited instead.

    The client keeps one ``requests.Session`` (connection reuse); use one client per thread.
    It is also a context manager that closes the session.
    """

    def __init__(self, url: str, api_key: Optional[str] = None, timeout: float = 60.0,
                 max_retries: int = 5, backoff: float = 0.5):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self._session = requests.Session()
        self._session.headers["User-Agent"] = "xdistill-python/0.1.0"
        if api_key is not None:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    # -- plumbing -------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the underlying HTTP session."""
        self._session.close()

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TeacherClient({self.url!r})"

    def _sleep_before_retry(self, attempt: int, resp: Optional[requests.Response]) -> None:
        """Waits before retry number ``attempt + 1``: ``Retry-After`` if the answer had one,
        else ``backoff * 2**attempt``."""
        delay = self.backoff * (2 ** attempt)
        if resp is not None:
            header = resp.headers.get("Retry-After")
            if header is not None:
                try:
                    delay = max(float(header), 0.0)
                except ValueError:
                    pass  # an HTTP date: keep the exponential backoff
        time.sleep(min(delay, _MAX_SLEEP_S))

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """Sends one request with retries; returns a 2xx answer or raises :class:`TeacherError`.

        Retried: HTTP 503 and connection errors / timeouts, up to ``max_retries`` times.
        Anything else that is not 2xx raises at once.
        """
        url = self.url + path
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                resp = self._session.request(method, url, timeout=self.timeout, **kwargs)
            except (requests.ConnectionError, requests.Timeout) as e:
                if last:
                    raise TeacherError(None, "connection_error", f"{method} {url}: {e}") from e
                self._sleep_before_retry(attempt, None)
                continue
            if resp.status_code == 503 and not last:
                self._sleep_before_retry(attempt, resp)
                continue
            if not 200 <= resp.status_code < 300:
                raise TeacherError.from_response(resp)
            return resp
        raise AssertionError("unreachable")  # the loop always returns or raises

    # -- routes ---------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]], k: int, start: int = 0,
              starts: Optional[Sequence[int]] = None, temperature: float = 1.0,
              ids: Optional[Sequence[Any]] = None, values: str = "logprobs",
              return_tensors: str = "np") -> List[SequenceScores]:
        """Scores token sequences: ``POST /topk_logits``.

        Args:
            sequences: token ids in the teacher's vocabulary, one list (or 1-D array/tensor) per
                sequence; lengths may differ.
            k: top-k entries per row (0 for only ``target_logprobs`` and ``logsumexp``).
            start: first position returned, for every sequence.
            starts: per-sequence first positions (overrides ``start``).
            temperature: the logits are divided by it before the softmax.
            ids: candidate ids to score exactly, one entry per sequence, each ``[rows][m]``
                (the same ``m`` for every row of a sequence; ``rows = S - 1 - start``). The
                answer's ``ids_logprobs[r][j]`` is the full-vocabulary log-prob of
                ``ids[i][r][j]`` at row ``r``.
            values: ``"logprobs"`` or ``"logits"`` (then ``topk_values`` holds ``z / temperature``).
            return_tensors: ``"np"`` for numpy arrays, ``"pt"`` for torch tensors (ids as int64).

        Returns:
            One :class:`SequenceScores` per sequence, in order.

        Raises:
            TeacherError: the server refused the request (``field`` names what it refused) or
                could not be reached within the retries.
        """
        if return_tensors not in ("np", "pt"):
            raise ValueError(f'return_tensors must be "np" or "pt", not {return_tensors!r}')
        if values not in ("logprobs", "logits"):
            raise ValueError(f'values must be "logprobs" or "logits", not {values!r}')
        seqs = [_int_list(s) for s in sequences]
        body: Dict[str, Any] = {
            "sequences": seqs,
            "k": int(k),
            "temperature": float(temperature),
            "start": int(start),
            "values": values,
        }
        if starts is not None:
            body["starts"] = _int_list(starts)
        if ids is not None:
            if len(ids) != len(seqs):
                raise ValueError(f"ids has {len(ids)} entries for {len(seqs)} sequences")
            body["ids"] = [_int_rows(per_seq) for per_seq in ids]
        torch = _import_torch() if return_tensors == "pt" else None

        resp = self._request(
            "POST", "/topk_logits",
            data=msgpack.packb(body, use_bin_type=True),
            headers={"Content-Type": _MSGPACK, "Accept": _MSGPACK,
                     AFFINITY_HEADER: affinity_key(seqs)},
        )
        answer = msgpack.unpackb(resp.content, raw=False)
        results = answer["results"]
        if len(results) != len(seqs):
            raise TeacherError(resp.status_code, "malformed_answer",
                               f"{len(results)} results for {len(seqs)} sequences")
        out = []
        for r in results:
            rows, kk = r["shape"]
            scores = SequenceScores(
                topk_ids=_blob(r["topk_ids"], "<u4", (rows, kk)),
                topk_values=_blob(r["topk_values"], "<f4", (rows, kk)),
                target_logprobs=_blob(r["target_logprobs"], "<f4", (rows,)),
                logsumexp=_blob(r["logsumexp"], "<f4", (rows,)),
                ids_logprobs=(_blob(r["ids_logprobs"], "<f4", r["ids_shape"])
                              if r.get("ids_shape") is not None else None),
            )
            if torch is not None:
                scores = SequenceScores(
                    topk_ids=torch.from_numpy(scores.topk_ids.astype(np.int64)),
                    topk_values=torch.from_numpy(scores.topk_values),
                    target_logprobs=torch.from_numpy(scores.target_logprobs),
                    logsumexp=torch.from_numpy(scores.logsumexp),
                    ids_logprobs=(None if scores.ids_logprobs is None
                                  else torch.from_numpy(scores.ids_logprobs)),
                )
            out.append(scores)
        return out

    def info(self) -> Dict[str, Any]:
        """The model and limits: ``GET /v1/info`` (``vocab_size``, ``logits_size``,
        ``max_seq_len``, ``protocol_version``, ``limits.max_k``, ...)."""
        return self._request("GET", "/v1/info").json()

    def tokenizer_json(self) -> str:
        """The teacher's ``tokenizer.json`` text, byte for byte: ``GET /tokenizer.json``."""
        return self._request("GET", "/tokenizer.json").content.decode("utf-8")

    def tokenizer(self):
        """The teacher's tokenizer as a ``tokenizers.Tokenizer`` (needs ``pip install tokenizers``)."""
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                "TeacherClient.tokenizer() needs the tokenizers package: pip install tokenizers"
            ) from e
        return Tokenizer.from_str(self.tokenizer_json())

    def health(self) -> bool:
        """Whether the server answers ``GET /health`` with 200 (model loaded); never raises."""
        try:
            return self._session.get(self.url + "/health", timeout=self.timeout).status_code == 200
        except requests.RequestException:
            return False
