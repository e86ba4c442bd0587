"""Checked by `mypy --strict` (test_typing.py), never run: what a caller sees of the
installed package's types."""

from __future__ import annotations

import random
from typing import List, Optional

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

from xdistill import (FullVocabInfo, HeadFingerprintMismatch, HeadUnavailable, HiddenStates,
                      RetriesExhausted, SequenceScores, TeacherClient, TeacherError, TeacherHead,
                      TeacherInfo, TorchHiddenStates, TorchSequenceScores, backoff_delay,
                      parse_retry_after)


def use(c: TeacherClient) -> None:
    np_scores = c.score([[1, 2, 3], np.arange(4)], k=4, ids=[[[5, 6]] * 2, np.zeros((3, 2))])
    assert_type(np_scores, List[SequenceScores])
    s = np_scores[0]
    assert_type(s.topk_ids, npt.NDArray[np.uint32])
    assert_type(s.topk_values, npt.NDArray[np.float32])
    assert_type(s.target_logprobs, npt.NDArray[np.float32])
    assert_type(s.logsumexp, npt.NDArray[np.float32])
    assert_type(s.ids_logprobs, Optional[npt.NDArray[np.float32]])
    assert_type(s.rows, int)
    pt_scores = c.score([[1, 2, 3]], k=4, return_tensors="pt")
    assert_type(pt_scores, List[TorchSequenceScores])
    info = c.info()
    assert_type(info, TeacherInfo)
    assert_type(info["vocab_size"], int)
    assert_type(info["limits"]["max_k"], int)
    assert_type(c.tokenizer_json(), str)
    assert_type(c.health(), bool)
    try:
        c.score([[1]], k=1, values="logits")
    except RetriesExhausted as e:
        assert_type(e.attempts, int)
        assert_type(e.last, TeacherError)
        assert_type(e.status, Optional[int])
    fv = info["full_vocab"]
    assert_type(fv, FullVocabInfo)
    assert_type(fv["head_fingerprint"], str)
    assert_type(fv["logit_softcap"], Optional[float])
    states = c.hidden_states([[1, 2, 3]], starts=[0])
    assert_type(states, HiddenStates)
    assert_type(states[0], npt.NDArray[np.float32])
    assert_type(states.states, List[npt.NDArray[np.float32]])
    assert_type(states.head_fingerprint, str)
    assert_type(c.hidden_states([[1, 2, 3]], return_tensors="pt"), TorchHiddenStates)
    try:
        head = c.head(cache_dir="/tmp/heads", fingerprint=states.head_fingerprint)
    except HeadFingerprintMismatch as e:
        assert_type(e.expected, str)
        raise
    except HeadUnavailable as e:
        assert_type(e.status, Optional[int])
        raise
    assert_type(head, TeacherHead)
    assert_type(head.weight, npt.NDArray[np.float32])
    assert_type(head.bias, Optional[npt.NDArray[np.float32]])
    assert_type(head.vocab_size, int)
    assert_type(head.logit_softcap, Optional[float])
    assert_type(head.log_probs(states[0], temperature=0.7), npt.NDArray[np.float32])
    assert_type(head.logits(states[0], round_logits=False), npt.NDArray[np.float32])
    assert_type(backoff_delay(1, 0.5, 30.0, random.random()), float)
    assert_type(parse_retry_after("2"), Optional[float])


with TeacherClient("http://127.0.0.1:8000", max_retry_wait_s=60.0, max_attempts=None,
                   backoff_initial_s=0.1, backoff_max_s=2.0, rng=random.Random(0)) as client:
    use(client)
