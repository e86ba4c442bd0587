"""The SGLang-compatible route `POST /generate`, as Axolotl (sglang mode), verl and miles call it.

Layout (SGLang's): with `logprob_start_len = N` a prompt of S tokens gets S − N entries aligned
with `ids[N:]`; entry 0 is always null, entry i ≥ 1 is the distribution that predicted
`ids[N + i]` (row N + i − 1 in this project's convention). Checked against the native
`/topk_logits` of the same server (1e-6) and the f64 reference (1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import (REF_ATOL, ROUTE_ATOL, assert_openai_error, assert_topk_matches_ref,
                     native_topk, post, post_ok)

CANDIDATES = [17, 42]


def _request(input_ids, start=0, k=5, **extra):
    body = {"input_ids": input_ids, "return_logprob": True, "logprob_start_len": start,
            "top_logprobs_num": k, "token_ids_logprob": CANDIDATES,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
    body.update(extra)
    return body


def _check(out, ids, start, k, base, ref, with_text=False, tok=None):
    """One answer object against the native route and the reference."""
    s = len(ids)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == s
    assert meta["completion_tokens"] == 0
    assert out["text"] == ""
    tl, tops, cand = meta["input_token_logprobs"], meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(tl) == len(tops) == len(cand) == s - start
    native = native_topk(base, {"sequences": [ids], "k": k, "start": start,
                                "ids": [[CANDIDATES] * (s - 1 - start)]})["results"][0]
    lp = ref.logprobs(ids)
    text = (lambda i: tok.decode([i], skip_special_tokens=False)) if with_text else (lambda i: None)
    # Entry 0: no distribution, whatever the start.
    assert tl[0] == [None, ids[start], text(ids[start])]
    assert tops[0] is None and cand[0] is None
    for i in range(1, s - start):
        row = start + i - 1  # the row predicting ids[start + i]
        r = i - 1            # its index in the native answer (which starts at `start`)
        value, tid, t = tl[i]
        assert tid == ids[start + i] and t == text(tid)
        np.testing.assert_allclose(value, native["target_logprobs"][r], rtol=0, atol=ROUTE_ATOL)
        np.testing.assert_allclose(value, lp[row][tid], rtol=0, atol=REF_ATOL)
        assert [e[1] for e in tops[i]] == native["topk_ids"][r]
        vals = [e[0] for e in tops[i]]
        np.testing.assert_allclose(vals, native["topk_values"][r], rtol=0, atol=ROUTE_ATOL)
        assert_topk_matches_ref([e[1] for e in tops[i]], vals, lp[row])
        assert [e[2] for e in tops[i]] == [text(e[1]) for e in tops[i]]
        assert [e[1] for e in cand[i]] == CANDIDATES
        np.testing.assert_allclose([e[0] for e in cand[i]], native["ids_logprobs"][r],
                                   rtol=0, atol=ROUTE_ATOL)
        np.testing.assert_allclose([e[0] for e in cand[i]], lp[row][CANDIDATES], rtol=0, atol=REF_ATOL)
        assert [e[2] for e in cand[i]] == [text(c) for c in CANDIDATES]


def test_single_prompt_is_one_object(base, seqs, ref):
    ids = seqs[0]
    out = post_ok(base, "/generate", _request(ids))
    assert isinstance(out, dict)
    _check(out, ids, 0, 5, base, ref)


def test_batch_is_a_list_in_order(base, seqs, ref):
    batch = [seqs[1], seqs[0], seqs[3]]
    out = post_ok(base, "/generate", _request(batch, k=3))
    assert isinstance(out, list) and len(out) == 3
    for ids, o in zip(batch, out):
        _check(o, ids, 0, 3, base, ref)


@pytest.mark.parametrize("start", [1, 4])
def test_logprob_start_len(base, seqs, ref, start):
    ids = seqs[0]
    _check(post_ok(base, "/generate", _request(ids, start=start)), ids, start, 5, base, ref)


def test_default_start_is_the_last_token(base, seqs):
    ids = seqs[0]
    body = _request(ids)
    del body["logprob_start_len"]
    meta = post_ok(base, "/generate", body)["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ids[-1], None]]
    assert meta["input_top_logprobs"] == [None]
    assert meta["input_token_ids_logprobs"] == [None]
    assert meta["prompt_tokens"] == len(ids)


def test_return_text_in_logprobs(base, seqs, ref, tok):
    ids = seqs[0]
    out = post_ok(base, "/generate", _request(ids, start=2, k=3, return_text_in_logprobs=True))
    _check(out, ids, 2, 3, base, ref, with_text=True, tok=tok)


def test_text_input(base, ref, tok):
    texts = ["hello world", "The cat sat on the mat."]
    out = post_ok(base, "/generate", {"text": texts[0], "return_logprob": True,
                                      "logprob_start_len": 0, "top_logprobs_num": 2,
                                      "token_ids_logprob": CANDIDATES,
                                      "sampling_params": {"max_new_tokens": 0}})
    _check(out, tok.encode(texts[0]).ids, 0, 2, base, ref)
    out = post_ok(base, "/generate", {"text": texts, "return_logprob": True,
                                      "logprob_start_len": 0, "top_logprobs_num": 2,
                                      "token_ids_logprob": CANDIDATES,
                                      "sampling_params": {"max_new_tokens": 0}})
    assert isinstance(out, list) and len(out) == 2
    for t, o in zip(texts, out):
        _check(o, tok.encode(t).ids, 0, 2, base, ref)


def test_one_greedy_new_token(base, seqs, ref, tok):
    ids = seqs[0]
    row = ref.logprobs(ids)[-1]
    nxt = int(np.argmax(row))
    out = post_ok(base, "/generate", {
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 1 and meta["prompt_tokens"] == len(ids)
    [(value, tid, t)] = meta["output_token_logprobs"]
    assert tid == nxt and t is None
    np.testing.assert_allclose(value, row[nxt], rtol=0, atol=REF_ATOL)
    if nxt not in tok.get_added_tokens_decoder():
        assert out["text"] == tok.decode([nxt], skip_special_tokens=False)


def test_unknown_fields_are_ignored(base, seqs, ref):
    ids = seqs[3]
    out = post_ok(base, "/generate", _request(ids, rid="abc", stream=False, lora_path=None,
                                              custom_logit_processor=None))
    _check(out, ids, 0, 5, base, ref)


def test_more_than_one_new_token_is_400(base, seqs):
    body = _request(seqs[0])
    body["sampling_params"]["max_new_tokens"] = 2
    assert_openai_error(post(base, "/generate", body), 400)


def test_start_at_or_beyond_the_prompt_is_422(base, seqs):
    ids = seqs[0]
    for start in (len(ids), len(ids) + 3):
        assert_openai_error(post(base, "/generate", _request(ids, start=start)), 422)


def test_bad_ids_are_422_naming_them(base, seqs, ref):
    bad = [seqs[0], [1, 2, ref.n_valid]]
    err = assert_openai_error(post(base, "/generate", _request(bad)), 422)
    assert isinstance(err["param"], str) and err["param"].startswith("input_ids"), err
