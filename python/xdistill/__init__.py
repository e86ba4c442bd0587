"""Python client for the xdistill teacher server.

The teacher (``teacher --model DIR``) answers ``POST /topk_logits`` with per-position top-k
log-probs, the actual next token's log-prob and the logsumexp of one causal language model.
:class:`TeacherClient` speaks its MessagePack wire format and returns numpy arrays (or torch
tensors), one :class:`SequenceScores` per input sequence.

Example::

    from xdistill import TeacherClient

    teacher = TeacherClient("http://127.0.0.1:8000")
    [scores] = teacher.score([[9707, 11, 1879, 0]], k=5)
    scores.topk_ids.shape   # (3, 5): rows = len(sequence) - 1 - start
"""

from .client import (AFFINITY_HEADER, DEFAULT_BACKOFF_INITIAL_S, DEFAULT_BACKOFF_MAX_S,
                     DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MAX_RETRY_WAIT_S, DEFAULT_TIMEOUT_S,
                     MAX_RETRY_AFTER_S, PROTOCOL_VERSION, RETRYABLE_STATUSES, InfoLimits,
                     RetriesExhausted, SequenceScores, TeacherClient, TeacherError, TeacherInfo,
                     TorchSequenceScores, affinity_key, backoff_delay, parse_retry_after)

__all__ = ["TeacherClient", "SequenceScores", "TorchSequenceScores", "TeacherInfo", "InfoLimits",
           "TeacherError", "RetriesExhausted", "PROTOCOL_VERSION", "AFFINITY_HEADER",
           "RETRYABLE_STATUSES", "MAX_RETRY_AFTER_S", "DEFAULT_TIMEOUT_S",
           "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_MAX_RETRY_WAIT_S", "DEFAULT_BACKOFF_INITIAL_S",
           "DEFAULT_BACKOFF_MAX_S", "affinity_key", "backoff_delay", "parse_retry_after"]
__version__ = "0.1.0"
