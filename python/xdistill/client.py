"""HTTP client of the teacher's native protocol (``docs/protocol.md``).

Requests go out as MessagePack and answers come back as MessagePack whose numeric arrays are
little-endian binary blobs, decoded here with ``np.frombuffer`` (no per-element parsing).
The server is the validator: arguments are checked here only as far as needed to build a
request; every refusal comes back as a :class:`TeacherError` naming the offending field.

Transient failures (connection errors, timeouts, HTTP 408/429/502/503/504) are retried with the
same policy as the trainer's Rust client (``trainer/src/client/``); see :class:`TeacherClient`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import re
import struct
import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Dict, FrozenSet, Iterable, List, Literal, Optional, Protocol,
                    Sequence, SupportsInt, Tuple, Type, TypedDict, TypeVar, Union, cast, overload,
                    runtime_checkable)

import msgpack
import numpy as np
import numpy.typing as npt
import requests

if TYPE_CHECKING:  # optional dependencies, imported on first use at run time
    import tokenizers
    import torch

#: The protocol version this client speaks (``/v1/info`` reports the server's). Version 2 added
#: ``k = 0`` and candidate ``ids``; everything else is version 1.
PROTOCOL_VERSION = 2

_MSGPACK = "application/msgpack"

#: Header with a stable hash of a request's sequences: a load balancer that hashes on it sends
#: the same text to the same teacher replica, whose cache then answers it (docs/protocol.md).
AFFINITY_HEADER = "X-Xdistill-Affinity"

#: HTTP statuses that are retried: request timeout, too many requests, bad gateway, service
#: unavailable, gateway timeout (what a teacher answers while busy or loading, and what a load
#: balancer answers while a replica dies). Every other non-2xx status fails at once.
RETRYABLE_STATUSES: FrozenSet[int] = frozenset({408, 429, 502, 503, 504})

#: Longest ``Retry-After`` taken literally (a day); longer values are capped.
MAX_RETRY_AFTER_S = 86_400.0

#: Defaults of the retry policy: the trainer's ``[teacher]`` defaults (``trainer/src/config.rs``).
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_MAX_RETRY_WAIT_S = 1800.0
DEFAULT_BACKOFF_INITIAL_S = 0.5
DEFAULT_BACKOFF_MAX_S = 30.0

_log = logging.getLogger("xdistill")

#: How the client waits between attempts (the tests wrap it to record the delays).
_sleep = time.sleep

_S = TypeVar("_S", bound=np.generic)


@runtime_checkable
class SupportsToList(Protocol):
    """An array-like with ``tolist()``: a numpy array or a torch tensor."""

    def tolist(self) -> object: ...


#: One sequence of token ids: a list/tuple of ints, a 1-D numpy array or torch tensor.
TokenIds = Union[Sequence[int], SupportsToList]
#: Candidate ids of one sequence, ``[rows][m]``: nested lists, a 2-D array or tensor.
CandidateIds = Union[Sequence[Sequence[int]], Sequence[SupportsToList], SupportsToList]


def affinity_key(sequences: Sequence[TokenIds]) -> str:
    """The affinity key of a request: the first 16 hex digits of the SHA-256 of its sequences,
    each as its length then its ids, u32 little-endian (as the Rust clients compute it)."""
    h = hashlib.sha256()
    for s in sequences:
        ids = np.asarray(s, dtype="<u4")
        h.update(struct.pack("<I", len(ids)))
        h.update(ids.tobytes())
    return h.hexdigest()[:16]


# -- retry policy (pure pieces; the same formulas as trainer/src/client/retry.rs) -------------


def backoff_delay(failures: int, initial: float, maximum: float, u: float) -> float:
    """Seconds to wait before the retry that follows ``failures`` earlier failures (0 for the
    first retry): ``min(initial * 2**failures, maximum)`` scaled by ``0.5 + 0.5 * u`` for
    jitter (``u`` uniform in [0, 1], clamped), so many clients do not retry in lockstep."""
    exp = initial * 2.0 ** min(max(failures, 0), 62)
    return min(exp, maximum) * (0.5 + 0.5 * min(max(u, 0.0), 1.0))


#: A decimal number, as Rust's ``f64::from_str`` reads it (without its ``inf``/``nan`` forms).
_DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """A ``Retry-After`` header as seconds: delta-seconds (``"3"``; decimals accepted), capped at
    :data:`MAX_RETRY_AFTER_S`. ``None`` for a missing, negative or unparsable value, and for the
    HTTP-date form, which is not supported (the caller then uses its backoff)."""
    if value is None:
        return None
    v = value.strip()
    if not _DECIMAL.match(v):
        return None
    secs = float(v)
    if not math.isfinite(secs) or secs < 0:
        return None
    return min(secs, MAX_RETRY_AFTER_S) + 0.0  # "-0" is 0


# -- errors -----------------------------------------------------------------------------------


class TeacherError(Exception):
    """A non-2xx answer from the teacher, or a request that could not be delivered.

    Attributes:
        status: the HTTP status (``None`` when no answer came back, e.g. the connection
            failed).
        type: the error's ``type`` from the JSON body (``"invalid_request"``, ``"queue_full"``,
            ...), ``"connection_error"`` when no answer came back, ``"http_error"`` when the
            body was not the usual error JSON.
        message: the human-readable message.
        field: the request field the server refused (``"k"``, ``"sequences[0][3]"``, ...) or
            ``None``.
    """

    status: Optional[int]
    type: str
    message: str
    field: Optional[str]

    def __init__(self, status: Optional[int], type: str, message: str,
                 field: Optional[str] = None):
        self.status = status
        self.type = type
        self.message = message
        self.field = field
        where = f" (field {field})" if field else ""
        super().__init__(f"{status if status is not None else 'no answer'} {type}: {message}{where}")

    @property
    def retryable(self) -> bool:
        """Whether another attempt may succeed: no answer came back, or the status is one of
        :data:`RETRYABLE_STATUSES`."""
        return self.status is None or self.status in RETRYABLE_STATUSES

    @classmethod
    def from_response(cls, resp: requests.Response) -> TeacherError:
        """Builds the error from an answer's ``{"error": {"type", "message", "field"}}`` body.

        The OpenAI-compatible routes name the field ``param`` instead; both are understood.
        """
        try:
            body: object = resp.json()
            if not isinstance(body, dict):
                raise TypeError("the body is not an object")
            err = body["error"]
            if not isinstance(err, dict):
                raise TypeError("error is not an object")
            field = err.get("field", err.get("param"))
            return cls(resp.status_code, str(err.get("type", "http_error")),
                       str(err.get("message", "")), None if field is None else str(field))
        except (ValueError, KeyError, TypeError):
            text = resp.text[:500].strip() if resp.content else ""
            return cls(resp.status_code, "http_error", text or resp.reason or "")


class RetriesExhausted(TeacherError):
    """A request that kept failing with retryable errors until the client gave up: after
    ``max_attempts`` attempts, or when the next retry would start later than
    ``max_retry_wait_s`` after the first attempt.

    ``status``, ``type``, ``message`` and ``field`` are the last error's (``status`` is
    ``None`` when that was a connection error or timeout, whose ``requests`` exception is then
    this error's ``__cause__``).

    Attributes:
        attempts: how many attempts were made.
        waited_s: seconds from the first attempt to giving up.
        last: the last attempt's error.
    """

    attempts: int
    waited_s: float
    last: TeacherError

    def __init__(self, what: str, attempts: int, waited_s: float, last: TeacherError):
        super().__init__(last.status, last.type, last.message, last.field)
        self.attempts = attempts
        self.waited_s = waited_s
        self.last = last
        self.args = (f"{what}: gave up after {attempts} attempt{'s' if attempts != 1 else ''} "
                     f"over {waited_s:.1f} s; last error: {last}",)


# -- answers ----------------------------------------------------------------------------------


@dataclass
class SequenceScores:
    """The teacher's scores of one sequence, as numpy arrays (``return_tensors="np"``).

    For a sequence of length ``S`` scored from ``start`` there are ``rows = S - 1 - start``
    rows; row ``r`` is the distribution at position ``start + r`` over the token at
    ``start + r + 1``.

    Attributes:
        topk_ids: ``[rows, k]`` ``uint32`` token ids, sorted by descending value.
        topk_values: ``[rows, k]`` float32 log-probs (or scaled logits with
            ``values="logits"``).
        target_logprobs: ``[rows]`` float32, log-prob of the actual next token.
        logsumexp: ``[rows]`` float32, ``log sum_v exp(z_v / temperature)``.
        ids_logprobs: ``[rows, m]`` float32 full-vocabulary log-probs at the candidate ids the
            request sent with ``ids=``, else ``None``.
    """

    topk_ids: npt.NDArray[np.uint32]
    topk_values: npt.NDArray[np.float32]
    target_logprobs: npt.NDArray[np.float32]
    logsumexp: npt.NDArray[np.float32]
    ids_logprobs: Optional[npt.NDArray[np.float32]] = None

    @property
    def rows(self) -> int:
        """Number of scored positions."""
        return int(self.target_logprobs.shape[0])

    @property
    def k(self) -> int:
        """Top-k entries per row."""
        return int(self.topk_ids.shape[1])


@dataclass
class TorchSequenceScores:
    """The scores of one sequence as torch tensors (``return_tensors="pt"``): the fields of
    :class:`SequenceScores`, with ``topk_ids`` as ``int64`` (ready for ``gather``) and the
    values as float32."""

    topk_ids: torch.Tensor
    topk_values: torch.Tensor
    target_logprobs: torch.Tensor
    logsumexp: torch.Tensor
    ids_logprobs: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        """Number of scored positions."""
        return int(self.target_logprobs.shape[0])

    @property
    def k(self) -> int:
        """Top-k entries per row."""
        return int(self.topk_ids.shape[1])


class InfoLimits(TypedDict):
    """``/v1/info``'s ``limits`` (``max_sequences`` and ``max_answer_bytes`` are 0 from servers
    older than protocol 2)."""

    max_k: int
    max_seq_len: int
    max_batch_tokens: int
    max_queue_tokens: int
    max_body_bytes: int
    max_wait_ms: int
    max_sequences: int
    max_answer_bytes: int


class _InfoV1(TypedDict):
    protocol_version: int
    server_version: str
    architecture: str
    model_type: str
    vocab_size: int
    logits_size: int
    max_seq_len: int
    dtype: str
    device: str
    tokenizer_sha256: str
    model_fingerprint: str
    limits: InfoLimits


class TeacherInfo(_InfoV1, total=False):
    """The body of ``GET /v1/info`` (docs/protocol.md). The keys of this class itself are
    absent from servers older than protocol 2."""

    rope_theta: float
    rope_scaling: str
    sliding_window: Optional[int]
    sliding_layers: int
    host_simd: str
    lm_head: str
    batch_invariant: bool


# -- request building and answer decoding -----------------------------------------------------


def _to_int(v: object) -> int:
    return int(cast(SupportsInt, v))


def _items(x: object) -> Iterable[object]:
    """The elements of a sequence, array or tensor (``tolist()`` when it has one)."""
    if isinstance(x, SupportsToList):
        x = x.tolist()
    if not isinstance(x, Iterable):
        raise TypeError(f"expected a sequence of token ids, got {type(x).__name__}")
    return cast(Iterable[object], x)


def _int_list(x: object) -> List[int]:
    """A 1-D sequence of ids (list, tuple, numpy array, torch tensor) as a list of ``int``."""
    return [_to_int(v) for v in _items(x)]


def _int_rows(x: object) -> List[List[int]]:
    """A 2-D ``[rows][m]`` nested sequence of ids as lists of ``int``."""
    return [_int_list(row) for row in _items(x)]


def _blob(buf: object, dtype: Type[_S], shape: Sequence[int]) -> npt.NDArray[_S]:
    """A little-endian blob as a writable native-endian array of ``shape``."""
    if not isinstance(buf, bytes):
        raise TypeError(f"expected a binary blob, got {type(buf).__name__}")
    little = np.dtype(dtype).newbyteorder("<")
    return np.frombuffer(buf, little).reshape(tuple(shape)).astype(dtype, copy=True)


def _import_torch() -> object:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'return_tensors="pt" needs PyTorch: pip install torch (or use return_tensors="np")'
        ) from e
    return torch


def _decode_scores(r: Dict[str, object]) -> SequenceScores:
    shape = _int_list(r["shape"])
    if len(shape) != 2:
        raise ValueError(f"shape {shape} is not [rows, k]")
    rows, kk = shape
    ids_shape = r.get("ids_shape")
    return SequenceScores(
        topk_ids=_blob(r["topk_ids"], np.uint32, (rows, kk)),
        topk_values=_blob(r["topk_values"], np.float32, (rows, kk)),
        target_logprobs=_blob(r["target_logprobs"], np.float32, (rows,)),
        logsumexp=_blob(r["logsumexp"], np.float32, (rows,)),
        ids_logprobs=(None if ids_shape is None
                      else _blob(r["ids_logprobs"], np.float32, _int_list(ids_shape))),
    )


def _to_torch(s: SequenceScores) -> TorchSequenceScores:
    import torch

    return TorchSequenceScores(
        topk_ids=torch.from_numpy(s.topk_ids.astype(np.int64)),
        topk_values=torch.from_numpy(s.topk_values),
        target_logprobs=torch.from_numpy(s.target_logprobs),
        logsumexp=torch.from_numpy(s.logsumexp),
        ids_logprobs=None if s.ids_logprobs is None else torch.from_numpy(s.ids_logprobs),
    )


#: ``requests`` exceptions after which another attempt may succeed: the connection was refused,
#: reset or timed out (connect or read), or the body broke off. The Rust client retries every
#: transport failure alike (scoring is idempotent; a server drops the queued work of a client
#: that went away).
_RETRYABLE_EXCEPTIONS: Tuple[Type[requests.RequestException], ...] = (
    requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ContentDecodingError,
)


class TeacherClient:
    """Client of one teacher server (or of a load balancer in front of several).

    Args:
        url: the server's base URL, e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer KEY`` (servers started with ``--api-key``).
        timeout: seconds to wait for an answer (``requests``' read timeout: the longest silence
            while waiting for or reading the answer, which includes the teacher's queueing and
            compute time).
        connect_timeout: seconds to wait for the TCP connection.
        max_retry_wait_s: how long one call keeps retrying: no retry starts later than this
            many seconds after the call's first attempt (an attempt already running is not cut
            short). ``0`` means a single attempt.
        max_attempts: optional cap on attempts per call (``None``: only ``max_retry_wait_s``
            limits them).
        backoff_initial_s: the first retry's delay before jitter; it doubles per failure...
        backoff_max_s: ...up to this cap.
        rng: the source of the jitter (a seeded ``random.Random`` makes the delays
            reproducible); a private ``random.Random()`` by default.

    Retries: connection errors (refused, reset, connect or read timeout, a broken body) and the
    statuses in :data:`RETRYABLE_STATUSES` (408, 429, 502, 503, 504) are retried; every other
    non-2xx answer raises :class:`TeacherError` at once. Before retry ``n`` (``n = 1`` for the
    first) the client waits the answer's ``Retry-After`` seconds when it has a valid one, else
    ``min(backoff_initial_s * 2**(n-1), backoff_max_s) * (0.5 + 0.5 * u)`` with ``u`` uniform
    in [0, 1). When that wait would end more than ``max_retry_wait_s`` after the first attempt
    started, or ``max_attempts`` attempts have failed, it raises :class:`RetriesExhausted`
    (a :class:`TeacherError` with the last error's status and type) at once. Each retry is
    logged as a warning on the ``xdistill`` logger. This is the trainer's policy
    (docs/protocol.md, "Retries"); the defaults are its ``[teacher]`` defaults.

    The client keeps one ``requests.Session`` (connection reuse); use one client per thread.
    It is also a context manager that closes the session.
    """

    def __init__(self, url: str, api_key: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT_S, *,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 max_retry_wait_s: float = DEFAULT_MAX_RETRY_WAIT_S,
                 max_attempts: Optional[int] = None,
                 backoff_initial_s: float = DEFAULT_BACKOFF_INITIAL_S,
                 backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
                 rng: Optional[random.Random] = None):
        for name, v in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0 seconds, not {v!r}")
        for name, v in (("max_retry_wait_s", max_retry_wait_s),
                        ("backoff_initial_s", backoff_initial_s),
                        ("backoff_max_s", backoff_max_s)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0 seconds, not {v!r}")
        if backoff_max_s < backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.url: str = url.rstrip("/")
        self.api_key: Optional[str] = api_key
        self.timeout: float = timeout
        self.connect_timeout: float = connect_timeout
        self.max_retry_wait_s: float = max_retry_wait_s
        self.max_attempts: Optional[int] = max_attempts
        self.backoff_initial_s: float = backoff_initial_s
        self.backoff_max_s: float = backoff_max_s
        self._rng = rng if rng is not None else random.Random()
        self._session = requests.Session()
        self._session.headers["User-Agent"] = "xdistill-python/0.1.0"
        if api_key is not None:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    # -- plumbing -------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the underlying HTTP session."""
        self._session.close()

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TeacherClient({self.url!r})"

    def _attempt(self, method: str, url: str, data: Optional[bytes],
                 headers: Optional[Dict[str, str]]) -> Tuple[Optional[requests.Response],
                                                             Optional[TeacherError],
                                                             Optional[float]]:
        """One attempt: (2xx answer, None, None) or (None, error, Retry-After seconds)."""
        try:
            resp = self._session.request(method, url, data=data, headers=headers,
                                         timeout=(self.connect_timeout, self.timeout))
        except _RETRYABLE_EXCEPTIONS as e:
            err = TeacherError(None, "connection_error", f"{method} {url}: {e}")
            err.__cause__ = e
            return None, err, None
        if 200 <= resp.status_code < 300:
            return resp, None, None
        return None, TeacherError.from_response(resp), parse_retry_after(
            resp.headers.get("Retry-After"))

    def _request(self, method: str, path: str, data: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None) -> requests.Response:
        """Sends a request with the retry policy of the class docstring; returns a 2xx answer or
        raises :class:`TeacherError` (:class:`RetriesExhausted` when retries ran out)."""
        url = self.url + path
        what = f"{method} {url}"
        start = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            resp, err, retry_after = self._attempt(method, url, data, headers)
            if resp is not None:
                if attempts > 1:
                    _log.info("%s: succeeded after %d attempts (%.1f s)", what, attempts,
                              time.monotonic() - start)
                return resp
            assert err is not None
            if not err.retryable:
                raise err
            delay = retry_after if retry_after is not None else backoff_delay(
                attempts - 1, self.backoff_initial_s, self.backoff_max_s, self._rng.random())
            elapsed = time.monotonic() - start
            if ((self.max_attempts is not None and attempts >= self.max_attempts)
                    or elapsed + delay > self.max_retry_wait_s):
                raise RetriesExhausted(what, attempts, elapsed, err) from err.__cause__
            _log.warning("%s: attempt %d failed: %s; retrying in %.1f s (waited %.1f s of %.0f s)",
                         what, attempts, err, delay, elapsed, self.max_retry_wait_s)
            _sleep(delay)

    # -- routes ---------------------------------------------------------------------------

    @overload
    def score(self, sequences: Sequence[TokenIds], k: int, start: int = 0,
              starts: Optional[TokenIds] = None, temperature: float = 1.0,
              ids: Optional[Sequence[CandidateIds]] = None,
              values: Literal["logprobs", "logits"] = "logprobs",
              return_tensors: Literal["np"] = "np") -> List[SequenceScores]: ...

    @overload
    def score(self, sequences: Sequence[TokenIds], k: int, start: int = 0,
              starts: Optional[TokenIds] = None, temperature: float = 1.0,
              ids: Optional[Sequence[CandidateIds]] = None,
              values: Literal["logprobs", "logits"] = "logprobs", *,
              return_tensors: Literal["pt"]) -> List[TorchSequenceScores]: ...

    def score(self, sequences: Sequence[TokenIds], k: int, start: int = 0,
              starts: Optional[TokenIds] = None, temperature: float = 1.0,
              ids: Optional[Sequence[CandidateIds]] = None,
              values: Literal["logprobs", "logits"] = "logprobs",
              return_tensors: Literal["np", "pt"] = "np",
              ) -> Union[List[SequenceScores], List[TorchSequenceScores]]:
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
            return_tensors: ``"np"`` for :class:`SequenceScores` of numpy arrays, ``"pt"`` for
                :class:`TorchSequenceScores` of torch tensors (ids as int64).

        Returns:
            One :class:`SequenceScores` (or :class:`TorchSequenceScores`) per sequence, in order.

        Raises:
            TeacherError: the server refused the request (``field`` names what it refused).
            RetriesExhausted: it could not be answered within the retry policy.
        """
        if return_tensors not in ("np", "pt"):
            raise ValueError(f'return_tensors must be "np" or "pt", not {return_tensors!r}')
        if values not in ("logprobs", "logits"):
            raise ValueError(f'values must be "logprobs" or "logits", not {values!r}')
        seqs = [_int_list(s) for s in sequences]
        body: Dict[str, object] = {
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
        if return_tensors == "pt":
            _import_torch()

        packed: bytes = msgpack.packb(body, use_bin_type=True)
        resp = self._request(
            "POST", "/topk_logits", data=packed,
            headers={"Content-Type": _MSGPACK, "Accept": _MSGPACK,
                     AFFINITY_HEADER: affinity_key(seqs)},
        )
        try:
            answer: object = msgpack.unpackb(resp.content, raw=False)
            if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
                raise TypeError("no `results` list")
            results = cast(List[Dict[str, object]], answer["results"])
            if len(results) != len(seqs):
                raise ValueError(f"{len(results)} results for {len(seqs)} sequences")
            scores = [_decode_scores(r) for r in results]
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            raise TeacherError(resp.status_code, "malformed_answer", str(e)) from e
        if return_tensors == "pt":
            return [_to_torch(s) for s in scores]
        return scores

    def info(self) -> TeacherInfo:
        """The model and limits: ``GET /v1/info`` (``vocab_size``, ``logits_size``,
        ``max_seq_len``, ``protocol_version``, ``limits["max_k"]``, ...)."""
        return cast(TeacherInfo, self._request("GET", "/v1/info").json())

    def tokenizer_json(self) -> str:
        """The teacher's ``tokenizer.json`` text, byte for byte: ``GET /tokenizer.json``."""
        return self._request("GET", "/tokenizer.json").content.decode("utf-8")

    def tokenizer(self) -> tokenizers.Tokenizer:
        """The teacher's tokenizer as a ``tokenizers.Tokenizer`` (needs ``pip install tokenizers``)."""
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                "TeacherClient.tokenizer() needs the tokenizers package: pip install tokenizers"
            ) from e
        return Tokenizer.from_str(self.tokenizer_json())

    def health(self) -> bool:
        """Whether the server answers ``GET /health`` with 200 (model loaded); never raises and
        never retries."""
        try:
            r = self._session.get(self.url + "/health",
                                  timeout=(self.connect_timeout, self.timeout))
            return r.status_code == 200
        except requests.RequestException:
            return False
