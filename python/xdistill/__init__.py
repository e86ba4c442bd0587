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

from .client import (AFFINITY_HEADER, PROTOCOL_VERSION, SequenceScores, TeacherClient,
                     TeacherError, affinity_key)

__all__ = ["TeacherClient", "SequenceScores", "TeacherError", "PROTOCOL_VERSION",
           "AFFINITY_HEADER", "affinity_key"]
__version__ = "0.1.0"
