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
import json
import logging
import math
import os
import random
import re
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterable, Iterator, List,
                    Literal, Mapping, Optional, Protocol, Sequence, SupportsInt, Tuple, Type,
                    TypedDict, TypeVar, Union, cast, overload, runtime_checkable)

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
_T = TypeVar("_T")

#: Header of ``/hidden_states`` and ``/v1/head`` answers with the head's SHA-256 fingerprint.
HEAD_FINGERPRINT_HEADER = "X-Xdistill-Head-Fingerprint"

#: Bytes read at a time while a head streams in.
_HEAD_CHUNK = 1 << 20
#: Bytes a head file may hold besides its tensors (its length prefix and JSON header: a few
#: hundred as the server writes them), as the Rust client allows.
_HEAD_HEADER_BYTES = 1 << 20


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
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _head_file_limit(fv: Mapping[str, Any], where: str) -> int:
    """The most bytes ``/v1/head`` may send: ``full_vocab``'s ``head_bytes``, which may exceed
    the tensors of the head's stated shape by a header at most. A download is bounded by it, so
    a peer's ``head_bytes`` of 10^12 beside a small shape is refused before anything is fetched."""
    rows, width, n = fv.get("head_rows"), fv.get("hidden_size"), fv.get("head_bytes")
    elem = _WIRE_SIZES.get(str(fv.get("dtype")), 4)

    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not (whole(rows) and whole(width) and whole(n)):
        raise TeacherError(200, "malformed_answer",
                           f"{where}: full_vocab's head_rows, hidden_size and head_bytes must be "
                           f"whole numbers, not {rows!r}, {width!r}, {n!r}")
    rows, width, n = cast(int, rows), cast(int, width), cast(int, n)
    tensors = rows * width * elem + (rows * elem if fv.get("bias") else 0)
    if n > tensors + _HEAD_HEADER_BYTES:
        raise TeacherError(200, "malformed_answer",
                           f"{where}: head_bytes {n} exceed the {tensors} bytes of a "
                           f"[{rows}, {width}] {fv.get('dtype')} head by more than a header")
    return n


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """A ``Retry-After`` header as seconds: delta-seconds (``"3"``; decimals accepted), capped at
    :data:`MAX_RETRY_AFTER_S`. ``None`` for a missing, negative or unparsable value, and for the
    HTTP-date form, which is not supported (the caller then uses its backoff)."""
    if value is None:
        return None
    v = value.strip()
    if not _DECIMAL.fullmatch(v):
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
        """Builds the error from an answer's ``{"error": {"type", "message", "field"}}`` body
        (its first :data:`ERROR_BODY_BYTES`; the rest is not read).

        The OpenAI-compatible routes name the field ``param`` instead; both are understood.
        """
        raw = _read_prefix(resp, ERROR_BODY_BYTES)
        try:
            body: object = json.loads(raw)
            if not isinstance(body, dict):
                raise TypeError("the body is not an object")
            err = body["error"]
            if not isinstance(err, dict):
                raise TypeError("error is not an object")
            field = err.get("field", err.get("param"))
            return cls(resp.status_code, str(err.get("type", "http_error")),
                       str(err.get("message", "")), None if field is None else str(field))
        except (ValueError, KeyError, TypeError, RecursionError):
            text = raw[:500].decode("utf-8", "replace").strip()
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


class HeadUnavailable(TeacherError):
    """The server serves no LM head: its ``/v1/info`` has no ``full_vocab`` (a server without
    the routes, or a model whose head cannot be served), or a route answered ``501
    head_unavailable``. ``type`` is ``"head_unavailable"``."""


class HeadFingerprintMismatch(TeacherError):
    """A head whose bytes do not have the SHA-256 fingerprint they must have: the server
    announced (``X-Xdistill-Head-Fingerprint``) or sent a head other than the one expected
    (``/v1/info``'s ``head_fingerprint``, or the ``fingerprint`` the caller asked for).
    ``type`` is ``"head_fingerprint_mismatch"``; nothing is cached.

    Attributes:
        expected: the fingerprint the head had to have.
        got: the fingerprint the server announced or the body hashed to.
    """

    expected: str
    got: str

    def __init__(self, status: Optional[int], expected: str, got: str, what: str):
        super().__init__(status, "head_fingerprint_mismatch",
                         f"{what}: expected head {expected}, got {got}")
        self.expected = expected
        self.got = got


#: How much of an error answer is read (its message shows the first 500 characters).
ERROR_BODY_BYTES = 64 << 10
#: The most ``/v1/info`` may send.
SMALL_BODY_BYTES = 16 << 20
#: The most ``/tokenizer.json`` may send (the teacher's own limit on the file).
TOKENIZER_BODY_BYTES = 512 << 20
#: Room for what a request does not size (the model's name, the field names).
_SLACK_BYTES = 64 << 10
#: A ``/hidden_states`` row, at most: ``H`` float32 values for ``H`` up to 262,144 (the
#: client does not know ``H`` before the answer).
_HIDDEN_ROW_BYTES = 1 << 20


class AnswerTooLarge(TeacherError):
    """An answer longer than any answer to its request can be (an endless body, a URL that
    serves something else): not read further, not retried. ``type`` is ``"answer_too_large"``."""


def _rows(seqs: Sequence[Sequence[int]], start: int, starts: Optional[Sequence[int]]
          ) -> List[int]:
    """Rows the teacher answers per sequence: ``len - 1 - start``."""
    return [max(len(q) - 1 - (starts[i] if starts is not None and i < len(starts) else start), 0)
            for i, q in enumerate(seqs)]


def _score_limit(rows: Sequence[int], k: int, m: int) -> int:
    """The most a ``/topk_logits`` answer takes in either format: 24 bytes a number (JSON's
    longest float and a comma), 16 a row, 128 a sequence, 256 the envelope (the server's
    ``codec::topk_response_bytes``), plus slack for the model's name."""
    row = (2 * k + m + 2) * 24 + 16
    return 256 + sum(128 + r * row for r in rows) + _SLACK_BYTES


def _read_capped(resp: requests.Response, limit: int) -> bytes:
    """The body of a streamed answer, at most ``limit`` bytes: a declared length over it is
    refused before a byte is read, a body that runs past it once it does."""
    def too_large() -> AnswerTooLarge:
        return AnswerTooLarge(
            resp.status_code, "answer_too_large",
            f"{resp.request.method} {resp.url}: the answer is longer than {limit} bytes, more "
            "than any answer to this request can be; not read further (is this URL a teacher?)")
    declared = resp.headers.get("Content-Length", "")
    # ASCII digits only: "²".isdigit() is true, and int("²") a ValueError.
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise too_large()
    buf = bytearray()
    for chunk in resp.iter_content(1 << 16):
        if len(buf) + len(chunk) > limit:
            raise too_large()
        buf += chunk
    return bytes(buf)


def _read_prefix(resp: requests.Response, limit: int) -> bytes:
    """The first ``limit`` bytes of an answer (what arrived, if it broke off)."""
    buf = bytearray()
    try:
        for chunk in resp.iter_content(1 << 16):
            buf += chunk[:limit - len(buf)]
            if len(buf) >= limit:
                break
    except requests.RequestException:
        pass
    return bytes(buf)


def _encoding_error(resp: requests.Response, what: str) -> Optional[TeacherError]:
    """The error for an answer sent with a ``Content-Encoding`` other than ``identity``, which
    the client asks for and a teacher always sends: its body is not read, since inflating it
    is what a decompression bomb needs (a proxy that compresses anyway is misconfigured).
    ``None`` for an answer as sent. A 2xx answer is malformed; an error answer keeps its
    status (and so whether it is retried), its body unread."""
    coding = resp.headers.get("Content-Encoding", "").strip().lower()
    if coding in ("", "identity") or resp.status_code in (204, 304):  # 204, 304: no body
        return None
    message = (f"{what}: the answer is compressed (Content-Encoding: {coding[:80]}) although "
               "the client asked for Accept-Encoding: identity; not read (does a proxy "
               "compress answers?)")
    if 200 <= resp.status_code < 300:
        return TeacherError(resp.status_code, "malformed_answer", message)
    return TeacherError(resp.status_code, "http_error", message)


def _head_error(e: TeacherError) -> TeacherError:
    """A route's ``501 head_unavailable`` as :class:`HeadUnavailable`; other errors as they are."""
    if e.type == "head_unavailable" and not isinstance(e, HeadUnavailable):
        out = HeadUnavailable(e.status, e.type, e.message, e.field)
        out.__cause__ = e
        return out
    return e


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


class FullVocabInfo(TypedDict):
    """``/v1/info``'s ``full_vocab``: what ``/hidden_states`` and ``/v1/head`` serve
    (docs/protocol.md, "Exact full-vocabulary distillation")."""

    hidden_route: str
    head_route: str
    dtype: str
    hidden_size: int
    head_rows: int
    vocab_size: int
    tied: bool
    bias: bool
    logit_scale: float
    logit_softcap: Optional[float]
    head_fingerprint: str
    head_bytes: int


class TeacherInfo(_InfoV1, total=False):
    """The body of ``GET /v1/info`` (docs/protocol.md). The keys of this class itself are
    absent from servers older than protocol 2; ``full_vocab`` is absent from servers without
    ``/hidden_states`` and ``/v1/head`` and from those whose model's head cannot be served."""

    rope_theta: float
    rope_scaling: str
    sliding_window: Optional[int]
    sliding_layers: int
    host_simd: str
    lm_head: str
    batch_invariant: bool
    full_vocab: FullVocabInfo


def _round_f32(z: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.float32]:
    """float32 values rounded to bf16 or f16 (to nearest, ties to even), as float32."""
    if dtype == "f16":
        return z.astype(np.float16).astype(np.float32)
    u = np.ascontiguousarray(z, dtype=np.float32).view(np.uint32)
    # Finite values only (non-finite logits are refused upstream): add half an ulp, minus
    # one when the kept part is even, then drop the low 16 bits.
    r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return r.view(np.float32)


@dataclass
class HiddenStates:
    """The answer of ``POST /hidden_states`` as numpy arrays (``return_tensors="np"``).

    ``states[i]`` is sequence ``i``'s ``[rows, H]`` float32 array of final-norm hidden states
    (the LM head's input); row ``r`` is position ``start + r``, whose logits predict token
    ``start + r + 1`` (the rows of :meth:`TeacherClient.score`). bf16 and f16 states are
    widened to float32, which is exact. The object is also a sequence of those arrays
    (``len``, indexing, iteration).

    Attributes:
        states: one ``[rows, H]`` float32 array per request sequence, in order.
        head_fingerprint: the fingerprint of the head these states go with
            (:attr:`TeacherHead.fingerprint`).
        model: the model fingerprint (``/v1/info``'s ``model_fingerprint``).
        dtype: the wire dtype the server sent: ``"bf16"``, ``"f16"`` or ``"f32"``.
        hidden_size: ``H``.
    """

    states: List[npt.NDArray[np.float32]]
    head_fingerprint: str
    model: str
    dtype: str
    hidden_size: int

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> npt.NDArray[np.float32]:
        return self.states[i]

    def __iter__(self) -> Iterator[npt.NDArray[np.float32]]:
        return iter(self.states)


@dataclass
class TorchHiddenStates:
    """The answer of ``POST /hidden_states`` as torch tensors (``return_tensors="pt"``): the
    fields of :class:`HiddenStates`, with each ``states[i]`` a CPU tensor in the wire dtype as
    sent (``torch.bfloat16`` from a bf16 teacher, ``torch.float16`` or ``torch.float32``):
    half the memory and transfer of float32. :meth:`TeacherHead.log_probs` widens them to
    float32 (exact)."""

    states: List[torch.Tensor]
    head_fingerprint: str
    model: str
    dtype: str
    hidden_size: int

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.states[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.states)


@dataclass
class TeacherHead:
    """The teacher's LM head, from ``GET /v1/head`` (:meth:`TeacherClient.head`), with what is
    needed to turn hidden states into the teacher's distribution over its whole vocabulary:

    ``z = (hidden · weightᵀ + bias) · logit_scale``, then ``z = c · tanh(z / c)`` with a
    soft-cap ``c``, then ``log_softmax(z[..., :vocab_size] / temperature)``
    (:meth:`log_probs`). Rows ``>= vocab_size`` are LM-head padding and never take part.

    Attributes:
        weight: ``[head_rows, H]`` float32 (widened exactly from the wire dtype); row ``v`` is
            token ``v``'s output vector (the input embedding when ``tied``).
        bias: ``[head_rows]`` float32, or ``None`` when the head has none.
        vocab_size: valid token ids (``<= head_rows``).
        logit_scale: the logits' scale (1.0 for every architecture served today).
        logit_softcap: the final soft-cap ``c``, or ``None``.
        fingerprint: SHA-256 (hex) of the head file as served; equals the
            ``head_fingerprint`` of the :class:`HiddenStates` it goes with.
        tied: whether the head is the input embedding.
        dtype: the wire dtype of the file (``"bf16"``, ``"f16"``, ``"f32"``).
        model: the model fingerprint the head came from.
        architecture: the model's architecture (``"Qwen3ForCausalLM"``, ...).
        path: the cached file when :meth:`TeacherClient.head` was given a ``cache_dir``.
    """

    weight: npt.NDArray[np.float32]
    bias: Optional[npt.NDArray[np.float32]]
    vocab_size: int
    logit_scale: float
    logit_softcap: Optional[float]
    fingerprint: str
    tied: bool
    dtype: str = "f32"
    model: str = ""
    architecture: str = ""
    path: Optional[Path] = None
    _torch: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]] = field(
        default_factory=dict, repr=False, compare=False)

    @property
    def head_rows(self) -> int:
        """Rows of the head (``>= vocab_size``: padded vocabularies)."""
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        """``H``, the width of a hidden state."""
        return int(self.weight.shape[1])

    def torch_weight(self, device: Union[str, torch.device, None] = None
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The valid rows of the head (``[vocab_size, H]``) and of its bias as float32 torch
        tensors on ``device`` (default CPU), made once per device and kept (the CPU ones share
        memory with :attr:`weight`)."""
        import torch

        dev = torch.device(device if device is not None else "cpu")
        key = str(dev)
        if key not in self._torch:
            w = torch.from_numpy(self.weight[:self.vocab_size]).to(dev)
            b = (None if self.bias is None
                 else torch.from_numpy(self.bias[:self.vocab_size]).to(dev))
            self._torch[key] = (w, b)
        return self._torch[key]

    @overload
    def logits(self, hidden: npt.NDArray[Any], round_logits: bool = True
               ) -> npt.NDArray[np.float32]: ...

    @overload
    def logits(self, hidden: torch.Tensor, round_logits: bool = True) -> torch.Tensor: ...

    def logits(self, hidden: Union[npt.NDArray[Any], torch.Tensor], round_logits: bool = True
               ) -> Union[npt.NDArray[np.float32], torch.Tensor]:
        """The teacher's logits over the real vocabulary, ``[..., vocab_size]`` float32, from
        hidden states ``[..., H]`` (any float dtype; a numpy array gives a numpy array, a
        torch tensor a tensor on its device): ``(h · Wᵀ + b) · scale``, soft-capped when the
        head has a cap; before any temperature.

        The products are summed in float32. A bf16 or f16 teacher's own matmul writes its
        logits in that dtype, so with ``round_logits`` (the default) ``h · Wᵀ + b`` is rounded
        to the head's :attr:`dtype` (to nearest even; nothing changes for an f32 head) and the
        values are the teacher's, as ``/topk_logits`` scores them. ``round_logits=False`` keeps
        the float32 products (within half a bf16 ulp of the teacher's)."""
        rnd = round_logits and self.dtype in ("bf16", "f16")
        if isinstance(hidden, np.ndarray):
            h = np.asarray(hidden, dtype=np.float32)
            self._check_width(h.shape)
            z: npt.NDArray[np.float32] = h @ self.weight[:self.vocab_size].T
            if self.bias is not None:
                z += self.bias[:self.vocab_size]
            if rnd:
                z = _round_f32(z, self.dtype)
            if self.logit_scale != 1.0:
                z *= np.float32(self.logit_scale)
            if self.logit_softcap is not None:
                c = np.float32(self.logit_softcap)
                z = (c * np.tanh(z / c)).astype(np.float32, copy=False)
            return z
        import torch

        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"expected a numpy array or a torch tensor, got {type(hidden).__name__}")
        self._check_width(tuple(hidden.shape))
        w, b = self.torch_weight(hidden.device)
        zt = hidden.to(torch.float32) @ w.T
        if b is not None:
            zt = zt + b
        if rnd:
            zt = zt.to(torch.bfloat16 if self.dtype == "bf16" else torch.float16).to(
                torch.float32)
        if self.logit_scale != 1.0:
            zt = zt * self.logit_scale
        if self.logit_softcap is not None:
            zt = self.logit_softcap * torch.tanh(zt / self.logit_softcap)
        return zt

    @overload
    def log_probs(self, hidden: npt.NDArray[Any], temperature: float = 1.0,
                  round_logits: bool = True) -> npt.NDArray[np.float32]: ...

    @overload
    def log_probs(self, hidden: torch.Tensor, temperature: float = 1.0,
                  round_logits: bool = True) -> torch.Tensor: ...

    def log_probs(self, hidden: Union[npt.NDArray[Any], torch.Tensor], temperature: float = 1.0,
                  round_logits: bool = True) -> Union[npt.NDArray[np.float32], torch.Tensor]:
        """The teacher's log-probs over the real vocabulary, ``[..., vocab_size]`` float32:
        ``log_softmax(logits(hidden) / temperature)`` — what ``/topk_logits`` computes from the
        same positions at the same temperature, to f32 rounding (its ``topk_values`` are these
        at its ``topk_ids``, its ``target_logprobs`` these at the next tokens). A numpy array
        gives a numpy array; a torch tensor (e.g. :class:`TorchHiddenStates`' bf16 states) a
        float32 tensor on its device. ``round_logits``: see :meth:`logits`."""
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, not {temperature!r}")
        if isinstance(hidden, np.ndarray):
            z = self.logits(hidden, round_logits)
            if temperature != 1.0:
                z = z / np.float32(temperature)
            z = z - z.max(axis=-1, keepdims=True)
            out: npt.NDArray[np.float32] = (
                z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32, copy=False)
            return out
        import torch

        zt = self.logits(hidden, round_logits)
        if temperature != 1.0:
            zt = zt / temperature
        return torch.log_softmax(zt, dim=-1)

    def _check_width(self, shape: Tuple[int, ...]) -> None:
        if not shape or shape[-1] != self.hidden_size:
            raise ValueError(f"hidden states of shape {tuple(shape)}: the head expects [..., "
                             f"{self.hidden_size}]")


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


def _decode_scores(r: Dict[str, object], rows_asked: int, k_asked: int,
                   m_asked: Optional[int]) -> SequenceScores:
    """One sequence's answer, checked against what was asked: ``rows_asked`` rows of at most
    ``k_asked`` entries, and ``m_asked`` candidate log-probs a row when candidates were sent
    (``None``: none were, and none may come back)."""
    shape = _int_list(r["shape"])
    if len(shape) != 2 or shape[0] != rows_asked or not 0 <= shape[1] <= k_asked:
        raise ValueError(f"shape {shape} where [{rows_asked}, <= {k_asked}] was asked")
    rows, kk = shape
    ids_shape = r.get("ids_shape")
    if (ids_shape is None) != (m_asked is None) or (
            ids_shape is not None and _int_list(ids_shape) != [rows_asked, m_asked]):
        raise ValueError(f"ids_shape {ids_shape!r} where "
                         f"{'none' if m_asked is None else [rows_asked, m_asked]} was asked")
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


#: Element sizes of the wire dtypes of hidden states and heads.
_WIRE_SIZES: Dict[str, int] = {"f32": 4, "bf16": 2, "f16": 2}
#: safetensors' names of the wire dtypes.
_SAFETENSORS_DTYPES: Dict[str, str] = {"F32": "f32", "BF16": "bf16", "F16": "f16"}


def _widen(raw: npt.NDArray[Any], dtype: str) -> npt.NDArray[np.float32]:
    """Little-endian wire values (``uint8`` bytes or ``<u2``/``<f2``/``<f4`` elements) of
    ``dtype`` as native float32, exactly (bf16 is the upper 16 bits of an f32)."""
    b = raw.view(np.uint8)
    if dtype == "bf16":
        u = b.view("<u2").astype(np.uint32)
        u <<= np.uint32(16)  # in place: a head is large
        return u.view(np.float32)
    if dtype == "f16":
        return b.view("<f2").astype(np.float32)
    if dtype == "f32":
        return b.view("<f4").astype(np.float32)
    raise ValueError(f"unknown dtype {dtype!r}")


def _decode_hidden(r: Dict[str, object], dtype: str, hidden_size: int, rows: int,
                   torch_out: bool) -> Union[npt.NDArray[np.float32], torch.Tensor]:
    shape = _int_list(r["shape"])
    if len(shape) != 2 or shape != [rows, hidden_size] or hidden_size <= 0:
        raise ValueError(f"shape {shape} where [{rows}, {hidden_size}] was asked")
    buf = r["hidden"]
    if not isinstance(buf, bytes):
        raise TypeError(f"expected a binary blob, got {type(buf).__name__}")
    if len(buf) != shape[0] * shape[1] * _WIRE_SIZES[dtype]:
        raise ValueError(f"{len(buf)} bytes of {dtype} for shape {shape}")
    raw = np.frombuffer(buf, np.uint8)
    if not torch_out or dtype == "f32":
        out = _widen(raw, dtype).reshape(shape)
        if torch_out:
            import torch

            return torch.from_numpy(out)
        return out
    import torch

    # Native-endian 16-bit patterns (a copy: writable), reinterpreted as the torch dtype.
    u16 = raw.view("<u2").astype(np.uint16).view(np.int16).reshape(shape)
    return torch.from_numpy(u16).view(torch.bfloat16 if dtype == "bf16" else torch.float16)


@dataclass
class _HeadLayout:
    """The header of a head file: where its tensors lie and its metadata."""

    data_start: int
    dtype: str
    head_rows: int
    hidden_size: int
    weight_offsets: Tuple[int, int]
    bias_offsets: Optional[Tuple[int, int]]
    meta: Dict[str, str]


def _head_layout(prefix: bytes, total: int) -> _HeadLayout:
    """Parses a head file's header from its first bytes (at least ``8 + N``) and checks it
    against the file's length ``total``."""
    if len(prefix) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if 8 + n > len(prefix):
        raise ValueError(f"a header of {n} bytes does not fit")
    header = json.loads(prefix[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not an object")
    w = header.get("weight")
    if not isinstance(w, dict):
        raise ValueError("no `weight` tensor")
    dtype = _SAFETENSORS_DTYPES.get(str(w.get("dtype")))
    if dtype is None:
        raise ValueError(f"weight dtype {w.get('dtype')!r} is not F32, BF16 or F16")
    shape = _int_list(w["shape"])
    if len(shape) != 2:
        raise ValueError(f"weight shape {shape} is not [head_rows, H]")
    data_start = 8 + n
    data_len = total - data_start

    def offsets(t: Dict[str, object], elements: int) -> Tuple[int, int]:
        if str(t.get("dtype")) != w.get("dtype"):
            raise ValueError("the bias and the weight have different dtypes")
        a, b = _int_list(t["data_offsets"])
        if not (0 <= a <= b <= data_len) or b - a != elements * _WIRE_SIZES[dtype]:
            raise ValueError(f"data_offsets {[a, b]} do not fit {elements} {dtype} values")
        return a, b

    bias = header.get("bias")
    return _HeadLayout(
        data_start=data_start, dtype=dtype, head_rows=shape[0], hidden_size=shape[1],
        weight_offsets=offsets(w, shape[0] * shape[1]),
        bias_offsets=None if not isinstance(bias, dict) else offsets(bias, shape[0]),
        meta={str(k): str(v) for k, v in meta.items()},
    )


def _head_from(layout: _HeadLayout, read: Callable[[int, int], npt.NDArray[np.uint8]],
               fingerprint: str, path: Optional[Path]) -> TeacherHead:
    """A :class:`TeacherHead` from a parsed header and a reader of the data's byte ranges."""
    meta = layout.meta
    if meta.get("format", "xdistill-head-1") != "xdistill-head-1":
        raise ValueError(f"unknown head format {meta.get('format')!r}")
    vocab = int(meta.get("vocab_size", layout.head_rows))
    if not 0 < vocab <= layout.head_rows:
        raise ValueError(f"vocab_size {vocab} with {layout.head_rows} head rows")
    cap_text = meta.get("logit_softcap", "none")
    scale = float(meta.get("logit_scale", "1.0"))
    cap = None if cap_text in ("none", "null", "") else float(cap_text)
    # A NaN or infinite scale, or a soft-cap c <= 0 (c * tanh(z / c)), makes every logit NaN.
    if not math.isfinite(scale) or (cap is not None and not (math.isfinite(cap) and cap > 0)):
        raise ValueError(f"logit_scale {scale} and logit_softcap {cap}: a finite scale and a "
                         "positive, finite soft-cap (or none) are needed")
    weight = _widen(read(*layout.weight_offsets), layout.dtype).reshape(
        layout.head_rows, layout.hidden_size)
    bias = (None if layout.bias_offsets is None
            else _widen(read(*layout.bias_offsets), layout.dtype))
    return TeacherHead(
        weight=weight, bias=bias, vocab_size=vocab,
        logit_scale=scale,
        logit_softcap=cap,
        fingerprint=fingerprint, tied=meta.get("tied", "false") == "true", dtype=layout.dtype,
        model=meta.get("model_fingerprint", ""), architecture=meta.get("architecture", ""),
        path=path,
    )


def _head_from_bytes(body: Union[bytes, bytearray], fingerprint: str) -> TeacherHead:
    layout = _head_layout(bytes(body[:min(len(body), 8 + (1 << 24))]), len(body))
    data = np.frombuffer(body, np.uint8)
    return _head_from(layout, lambda a, b: data[layout.data_start + a:layout.data_start + b],
                      fingerprint, None)


def _head_from_file(path: Path, fingerprint: str) -> TeacherHead:
    total = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) == 8:
            # The header's stated length, read no further than the file and the 16 MiB a
            # header may take (_head_layout refuses the rest).
            n = struct.unpack("<Q", prefix)[0]
            prefix += f.read(min(n, max(total - 8, 0), 1 << 24))
    layout = _head_layout(prefix, total)
    return _head_from(
        layout, lambda a, b: np.fromfile(path, np.uint8, count=b - a,
                                         offset=layout.data_start + a),
        fingerprint, path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HEAD_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


#: A SHA-256 fingerprint, lower-case hex; whole strings only (``fullmatch``: ``$`` would accept a
#: trailing newline, and the fingerprint names the head's file in the cache).
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


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
        # Answers as sent: a teacher never compresses, and a compressed answer is refused
        # unread (_encoding_error), never inflated by urllib3, whose versions before 2.6
        # bound neither a chunk's expansion nor a chain of encodings (decompression bombs).
        self._session.headers["Accept-Encoding"] = "identity"
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
                 headers: Optional[Dict[str, str]], read: Callable[[requests.Response], _T],
                 also_ok: FrozenSet[int]
                 ) -> Tuple[Optional[TeacherError], Optional[float], Optional[_T]]:
        """One attempt: ``(None, None, read(answer))`` for a 2xx answer (or one whose status
        is in ``also_ok``), else ``(error, Retry-After seconds, None)``. A connection error or
        a body that breaks off while ``read`` reads it is a retryable ``connection_error``; a
        :class:`TeacherError` that ``read`` raises is the attempt's error."""
        try:
            resp = self._session.request(method, url, data=data, headers=headers, stream=True,
                                         timeout=(self.connect_timeout, self.timeout))
        except _RETRYABLE_EXCEPTIONS as e:
            err = TeacherError(None, "connection_error", f"{method} {url}: {e}")
            err.__cause__ = e
            return err, None, None
        except requests.RequestException as e:
            # What another attempt would meet again (a redirect loop, a redirect to another
            # scheme, a malformed header): the caller's error at once, not requests' own.
            raise TeacherError(None, "bad_answer", f"{method} {url}: {e}") from e
        try:
            encoded = _encoding_error(resp, f"{method} {url}")
            if encoded is not None:
                return encoded, parse_retry_after(resp.headers.get("Retry-After")), None
            if 200 <= resp.status_code < 300 or resp.status_code in also_ok:
                try:
                    return None, None, read(resp)
                except _RETRYABLE_EXCEPTIONS as e:
                    err = TeacherError(None, "connection_error",
                                       f"{method} {url}: the answer broke off: {e}")
                    err.__cause__ = e
                    return err, None, None
                except TeacherError as e:
                    return e, None, None
            return TeacherError.from_response(resp), parse_retry_after(
                resp.headers.get("Retry-After")), None
        finally:
            resp.close()

    def _request(self, method: str, path: str, limit: int, data: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None) -> bytes:
        """Sends a request with the retry policy of the class docstring; returns the body of a
        2xx answer (at most ``limit`` bytes: :class:`AnswerTooLarge` past it) or raises
        :class:`TeacherError` (:class:`RetriesExhausted` when retries ran out)."""
        return self._call(method, path, data, headers, lambda r: _read_capped(r, limit))

    def _call(self, method: str, path: str, data: Optional[bytes],
              headers: Optional[Dict[str, str]], read: Callable[[requests.Response], _T], *,
              also_ok: FrozenSet[int] = frozenset()) -> _T:
        """:meth:`_request` whose attempts end with ``read(answer)``: the body streams in and
        is read there (a body that breaks off is retried like a connection error)."""
        url = self.url + path
        what = f"{method} {url}"
        start = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            err, retry_after, value = self._attempt(method, url, data, headers, read, also_ok)
            if err is None:
                if attempts > 1:
                    _log.info("%s: succeeded after %d attempts (%.1f s)", what, attempts,
                              time.monotonic() - start)
                return cast(_T, value)
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
        starts_list = None if starts is None else _int_list(starts)
        if starts_list is not None:
            body["starts"] = starts_list
        m = 0
        m_per: List[Optional[int]] = [None] * len(seqs)
        if ids is not None:
            if len(ids) != len(seqs):
                raise ValueError(f"ids has {len(ids)} entries for {len(seqs)} sequences")
            id_rows = [_int_rows(per_seq) for per_seq in ids]
            body["ids"] = id_rows
            m = max((len(row) for per_seq in id_rows for row in per_seq), default=0)
            m_per = [len(per_seq[0]) if per_seq else 0 for per_seq in id_rows]
        if return_tensors == "pt":
            _import_torch()

        packed: bytes = msgpack.packb(body, use_bin_type=True)
        rows = _rows(seqs, int(start), starts_list)
        limit = _score_limit(rows, int(k), m)
        raw = self._request(
            "POST", "/topk_logits", limit, data=packed,
            headers={"Content-Type": _MSGPACK, "Accept": _MSGPACK,
                     AFFINITY_HEADER: affinity_key(seqs)},
        )
        try:
            answer: object = msgpack.unpackb(raw, raw=False)
            if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
                raise TypeError("no `results` list")
            results = cast(List[Dict[str, object]], answer["results"])
            if len(results) != len(seqs):
                raise ValueError(f"{len(results)} results for {len(seqs)} sequences")
            scores = [_decode_scores(r, n, int(k), mi) for r, n, mi in zip(results, rows, m_per)]
        except (ValueError, TypeError, KeyError, OverflowError, msgpack.UnpackException) as e:
            raise TeacherError(200, "malformed_answer", str(e)) from e
        if return_tensors == "pt":
            return [_to_torch(s) for s in scores]
        return scores

    @overload
    def hidden_states(self, sequences: Sequence[TokenIds], start: int = 0,
                      starts: Optional[TokenIds] = None,
                      return_tensors: Literal["np"] = "np") -> HiddenStates: ...

    @overload
    def hidden_states(self, sequences: Sequence[TokenIds], start: int = 0,
                      starts: Optional[TokenIds] = None, *,
                      return_tensors: Literal["pt"]) -> TorchHiddenStates: ...

    def hidden_states(self, sequences: Sequence[TokenIds], start: int = 0,
                      starts: Optional[TokenIds] = None,
                      return_tensors: Literal["np", "pt"] = "np",
                      ) -> Union[HiddenStates, TorchHiddenStates]:
        """The teacher's final-norm hidden states: ``POST /hidden_states``.

        With the head (:meth:`head`), :meth:`TeacherHead.log_probs` turns them into the
        teacher's exact log-probs over its whole vocabulary; ``H`` values per position travel
        instead of ``V``.

        Args:
            sequences: token ids, as for :meth:`score`.
            start: first position returned, for every sequence.
            starts: per-sequence first positions (overrides ``start``).
            return_tensors: ``"np"`` for :class:`HiddenStates` of ``[rows, H]`` float32 numpy
                arrays (bf16/f16 widened exactly), ``"pt"`` for :class:`TorchHiddenStates` of
                CPU tensors in the wire dtype (``torch.bfloat16`` from a bf16 teacher).

        Returns:
            The states of every sequence, in order (``rows = S - 1 - start``, the rows of
            :meth:`score`), with the answer's ``head_fingerprint`` and ``model``.

        Raises:
            HeadUnavailable: the server serves no head (``501 head_unavailable``).
            TeacherError: the server refused the request (``field`` names what it refused).
            RetriesExhausted: it could not be answered within the retry policy.
        """
        if return_tensors not in ("np", "pt"):
            raise ValueError(f'return_tensors must be "np" or "pt", not {return_tensors!r}')
        seqs = [_int_list(s) for s in sequences]
        body: Dict[str, object] = {"sequences": seqs, "start": int(start)}
        starts_list = None if starts is None else _int_list(starts)
        if starts_list is not None:
            body["starts"] = starts_list
        torch_out = return_tensors == "pt"
        if torch_out:
            _import_torch()
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        try:
            rows = _rows(seqs, int(start), starts_list)
            raw = self._request(
                "POST", "/hidden_states",
                256 + sum(64 + r * _HIDDEN_ROW_BYTES for r in rows) + _SLACK_BYTES,
                data=packed,
                headers={"Content-Type": _MSGPACK, "Accept": _MSGPACK,
                         AFFINITY_HEADER: affinity_key(seqs)},
            )
        except TeacherError as e:
            raise _head_error(e) from e.__cause__
        try:
            answer: object = msgpack.unpackb(raw, raw=False)
            if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
                raise TypeError("no `results` list")
            dtype = str(answer["dtype"])
            if dtype not in _WIRE_SIZES:
                raise ValueError(f"unknown dtype {dtype!r}")
            hidden_size = _to_int(answer["hidden_size"])
            results = cast(List[Dict[str, object]], answer["results"])
            if len(results) != len(seqs):
                raise ValueError(f"{len(results)} results for {len(seqs)} sequences")
            states = [_decode_hidden(r, dtype, hidden_size, n, torch_out)
                      for r, n in zip(results, rows)]
            fp, model = str(answer["head_fingerprint"]), str(answer["model"])
        except (ValueError, TypeError, KeyError, OverflowError, msgpack.UnpackException) as e:
            raise TeacherError(200, "malformed_answer", str(e)) from e
        if torch_out:
            return TorchHiddenStates(cast(List["torch.Tensor"], states), fp, model, dtype,
                                     hidden_size)
        return HiddenStates(cast(List[npt.NDArray[np.float32]], states), fp, model, dtype,
                            hidden_size)

    def head(self, cache_dir: Union[str, os.PathLike[str], None] = None,
             fingerprint: Optional[str] = None) -> TeacherHead:
        """The teacher's LM head: ``GET /v1/head``, checked against its fingerprint.

        The fingerprint it must have is ``fingerprint`` when given (e.g. a
        :attr:`HiddenStates.head_fingerprint`, so that head and states surely go together),
        else ``/v1/info``'s ``full_vocab.head_fingerprint``. The body's SHA-256 must equal it.

        With ``cache_dir``, the head streams to ``cache_dir/<fingerprint>.safetensors`` (never
        whole in memory; written under a temporary name and renamed once verified) and is
        read from there next time: a cached file is hashed again, then the server is asked
        with ``If-None-Match`` (``304 Not Modified``: nothing is downloaded). A cached file
        whose hash is wrong (corrupt, cut short) is deleted and fetched again. Without
        ``cache_dir`` the head is downloaded into memory each call.

        Raises:
            HeadUnavailable: the server serves no head (no ``full_vocab`` in ``/v1/info``, or
                ``501 head_unavailable``).
            HeadFingerprintMismatch: the server announced or sent a head with another
                fingerprint (nothing is cached).
            TeacherError: any other failure; RetriesExhausted when retries ran out (a body
                that breaks off is retried).
            ValueError: ``fingerprint`` is not 64 hex digits.
        """
        info = self.info()
        fv = info.get("full_vocab")
        if not isinstance(fv, dict) or "head_fingerprint" not in fv:
            raise HeadUnavailable(None, "head_unavailable",
                                  f"{self.url}/v1/info has no full_vocab: the server serves no "
                                  f"LM head (too old, or its model's head cannot be served)")
        announced = str(fv["head_fingerprint"]).lower()
        if not _FINGERPRINT.fullmatch(announced):
            raise TeacherError(200, "malformed_answer",
                               f"{self.url}/v1/info: head_fingerprint {announced[:80]!r} is not "
                               "64 hex digits")
        expected = announced if fingerprint is None else fingerprint.lower()
        if not _FINGERPRINT.fullmatch(expected):
            raise ValueError(f"a head fingerprint is 64 hex digits, not {expected!r}")
        if expected != announced:
            raise HeadFingerprintMismatch(None, expected, announced, f"{self.url}/v1/info")
        what = f"GET {self.url}/v1/head"
        most = _head_file_limit(fv, f"{self.url}/v1/info")

        def check_announced(resp: requests.Response) -> None:
            got = resp.headers.get(HEAD_FINGERPRINT_HEADER)
            if got is not None and got.lower() != expected:
                raise HeadFingerprintMismatch(resp.status_code, expected, got.lower(), what)

        def chunks(resp: requests.Response) -> Iterator[bytes]:
            """The body, checked for its length and its SHA-256."""
            check_announced(resp)
            length = resp.headers.get("Content-Length")
            h = hashlib.sha256()
            n = 0
            for chunk in resp.iter_content(_HEAD_CHUNK):
                h.update(chunk)
                n += len(chunk)
                if most is not None and n > most:
                    raise AnswerTooLarge(resp.status_code, "answer_too_large",
                                         f"{what}: longer than the {most} bytes /v1/info "
                                         "announces; not read further")
                yield chunk
            if length is not None and (not (length.isascii() and length.isdigit())
                                       or n != int(length)):
                raise requests.exceptions.ChunkedEncodingError(
                    f"{n} of {length} bytes of the head arrived")
            if h.hexdigest() != expected:
                raise HeadFingerprintMismatch(resp.status_code, expected, h.hexdigest(), what)

        try:
            if cache_dir is None:
                def to_memory(resp: requests.Response) -> bytearray:
                    buf = bytearray()
                    for c in chunks(resp):
                        buf += c
                    return buf

                body = self._call("GET", "/v1/head", None, None, to_memory)
                try:
                    return _head_from_bytes(body, expected)
                except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
                    raise TeacherError(200, "malformed_answer", f"{what}: {e}") from e

            folder = Path(cache_dir).expanduser()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{expected}.safetensors"
            cached = path.is_file()
            if cached and _sha256_file(path) != expected:
                _log.warning("%s: the cached head does not hash to its fingerprint; fetching "
                             "it again", path)
                path.unlink()
                cached = False

            def to_file(resp: requests.Response) -> bool:
                """True when the cached file stands (304), False once a new one is written."""
                if resp.status_code == 304:
                    check_announced(resp)
                    return True
                tmp = folder / f".{expected}.{os.getpid()}.{random.getrandbits(32):08x}.part"
                try:
                    with open(tmp, "wb") as f:
                        for c in chunks(resp):
                            f.write(c)
                    os.replace(tmp, path)
                finally:
                    if tmp.exists():
                        tmp.unlink()
                return False

            headers = {"If-None-Match": f'"{expected}"'} if cached else None
            if self._call("GET", "/v1/head", None, headers, to_file,
                          also_ok=frozenset({304} if cached else set())):
                _log.info("%s: the cached head %s is current", what, path)
            try:
                return _head_from_file(path, expected)
            except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
                raise TeacherError(200, "malformed_answer", f"{path}: {e}") from e
        except TeacherError as e:
            if isinstance(e, HeadFingerprintMismatch) or e.type != "head_unavailable":
                raise
            raise _head_error(e) from e.__cause__

    def info(self) -> TeacherInfo:
        """The model and limits: ``GET /v1/info`` (``vocab_size``, ``logits_size``,
        ``max_seq_len``, ``protocol_version``, ``limits["max_k"]``, ...)."""
        raw = self._request("GET", "/v1/info", SMALL_BODY_BYTES)
        try:
            info: object = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise TeacherError(200, "malformed_answer", f"{self.url}/v1/info: {e}") from e
        if not isinstance(info, dict):
            raise TeacherError(200, "malformed_answer",
                               f"{self.url}/v1/info: the answer is not a JSON object")
        return cast(TeacherInfo, info)

    def tokenizer_json(self) -> str:
        """The teacher's ``tokenizer.json`` text, byte for byte: ``GET /tokenizer.json``."""
        return self._request("GET", "/tokenizer.json", TOKENIZER_BODY_BYTES).decode("utf-8")

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
            with self._session.get(self.url + "/health", stream=True,
                                   timeout=(self.connect_timeout, self.timeout)) as r:
                return r.status_code == 200  # its body is not read
        except requests.RequestException:
            return False
