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

    # Exact full-vocabulary log-probs: the head once, then hidden states per batch.
    head = teacher.head(cache_dir="~/.cache/xdistill")
    states = teacher.hidden_states([[9707, 11, 1879, 0]])
    head.log_probs(states[0]).shape   # (3, head.vocab_size)
"""

from .client import (AFFINITY_HEADER, DEFAULT_BACKOFF_INITIAL_S, DEFAULT_BACKOFF_MAX_S,
                     DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MAX_RETRY_WAIT_S, DEFAULT_TIMEOUT_S,
                     HEAD_FINGERPRINT_HEADER, MAX_RETRY_AFTER_S, PROTOCOL_VERSION,
                     RETRYABLE_STATUSES, AnswerTooLarge, FullVocabInfo, HeadFingerprintMismatch,
                     HeadUnavailable, HiddenStates, InfoLimits, RetriesExhausted, SequenceScores,
                     TeacherClient, TeacherError, TeacherHead, TeacherInfo, TorchHiddenStates,
                     TorchSequenceScores, affinity_key, backoff_delay, parse_retry_after)

__all__ = ["TeacherClient", "SequenceScores", "TorchSequenceScores", "TeacherInfo", "InfoLimits",
           "TeacherError", "RetriesExhausted", "PROTOCOL_VERSION", "AFFINITY_HEADER",
           "RETRYABLE_STATUSES", "MAX_RETRY_AFTER_S", "DEFAULT_TIMEOUT_S",
           "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_MAX_RETRY_WAIT_S", "DEFAULT_BACKOFF_INITIAL_S",
           "DEFAULT_BACKOFF_MAX_S", "affinity_key", "backoff_delay", "parse_retry_after",
           "HiddenStates", "TorchHiddenStates", "TeacherHead", "FullVocabInfo",
           "HeadUnavailable", "HeadFingerprintMismatch", "HEAD_FINGERPRINT_HEADER",
           "AnswerTooLarge"]
__version__ = "0.1.0"
