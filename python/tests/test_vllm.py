"""The vLLM-compatible routes: `/v1/completions` (through the official `openai` SDK and plain
HTTP, in the shapes TRL and Axolotl send), `/v1/models`, `/tokenize`, `/detokenize`.

Values are checked against the native `/topk_logits` route of the same server (1e-6) and the
f64 reference forward (1e-5); tokenization against the `tokenizers` library.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import requests

from helpers import (API_KEY, LIMITED_MAX_K, MODEL_NAME, REF_ATOL, ROUTE_ATOL,
                     assert_openai_error, assert_topk_matches_ref, native_topk, post, post_ok,
                     true_rank_bounds)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


def _prompt_logprobs(choice):
    """`choices[i].prompt_logprobs`, a vLLM extension the SDK keeps as an extra field."""
    extra = choice.model_extra or {}
    if "prompt_logprobs" in extra:
        return extra["prompt_logprobs"]
    return getattr(choice, "prompt_logprobs")


def _special_ids(tok):
    return set(tok.get_added_tokens_decoder())


def _check_prompt_logprobs(pl, ids, k, native, lp_ref, tok, atol_ref=REF_ATOL):
    """Checks vLLM's `prompt_logprobs` for one prompt against the native top-k of the same
    server (`native`: one `/topk_logits` JSON result, start 0, same k and temperature) and the
    reference's log-prob rows `lp_ref` ([S, V])."""
    special = _special_ids(tok)
    assert len(pl) == len(ids)
    assert pl[0] is None
    for p in range(1, len(ids)):
        entry = pl[p]
        assert isinstance(entry, dict), (p, entry)
        keys = list(entry)  # insertion order: top-K by rank, then the actual token
        top_ids = native["topk_ids"][p - 1]
        top_vals = native["topk_values"][p - 1]
        assert [int(key) for key in keys[:k]] == top_ids, p
        got_vals = [entry[key]["logprob"] for key in keys[:k]]
        np.testing.assert_allclose(got_vals, top_vals, rtol=0, atol=ROUTE_ATOL)
        if k:
            assert_topk_matches_ref([int(key) for key in keys[:k]], got_vals, lp_ref[p - 1], atol_ref)
        assert [entry[key]["rank"] for key in keys[:k]] == list(range(1, k + 1))
        actual = ids[p]
        if actual in top_ids:
            assert len(keys) == k, (p, keys)
        else:
            assert len(keys) == k + 1 and keys[-1] == str(actual), (p, keys)
            e = entry[str(actual)]
            np.testing.assert_allclose(e["logprob"], native["target_logprobs"][p - 1],
                                       rtol=0, atol=ROUTE_ATOL)
            np.testing.assert_allclose(e["logprob"], lp_ref[p - 1][actual], rtol=0, atol=atol_ref)
            lo, hi = true_rank_bounds(lp_ref[p - 1], actual, atol_ref)
            assert lo <= e["rank"] <= hi and e["rank"] > k, (p, e["rank"], lo, hi)
        for key in keys:
            assert set(entry[key]) == {"logprob", "rank", "decoded_token"}
            assert isinstance(entry[key]["decoded_token"], str)
            tid = int(key)
            if tid not in special:
                assert entry[key]["decoded_token"] == tok.decode([tid], skip_special_tokens=False)


def _greedy_prompt(seqs, ref, tok):
    """A prompt whose greedy next token (reference argmax, clear of ties) is an ordinary token
    with a clean decoding, and that token."""
    special = _special_ids(tok)
    for s in seqs[:3]:
        for n in range(len(s), 1, -1):
            row = ref.logprobs(s[:n])[-1]
            best, second = np.sort(row)[::-1][:2]
            nxt = int(np.argmax(row))
            text = tok.decode([nxt], skip_special_tokens=False)
            if best - second > 1e-3 and nxt not in special and "\ufffd" not in text and text:
                return s[:n], nxt
    pytest.skip("no prompt with a clean greedy token")


def _greedy_extend(ids, ref, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(ref.logprobs(ids)[-1])))
    return ids


# -- /v1/completions: prompt_logprobs ---------------------------------------------------------


@pytest.mark.parametrize("k", [3, 0])
def test_prompt_logprobs_through_the_sdk(oai, base, seqs, ref, tok, k):
    # The tail of the third prompt is greedy, so there the actual token is inside the top K.
    prompts = [seqs[0], seqs[1], _greedy_extend(seqs[2][:4], ref, 4)]
    for ids in prompts:
        resp = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1,
                                      extra_body={"prompt_logprobs": k})
        assert resp.model == MODEL_NAME and resp.object == "text_completion"
        assert resp.id.startswith("cmpl-")
        [choice] = resp.choices
        assert choice.index == 0 and choice.finish_reason == "length"
        native = native_topk(base, {"sequences": [ids], "k": k})["results"][0]
        _check_prompt_logprobs(_prompt_logprobs(choice), ids, k, native, ref.logprobs(ids), tok)
        assert resp.usage.prompt_tokens == len(ids)
        assert resp.usage.completion_tokens == 1
        assert resp.usage.total_tokens == len(ids) + 1
    # The greedy tail: rank 1 and exactly K keys.
    pl = _prompt_logprobs(resp.choices[0])
    if k:
        for p in range(5, len(prompts[2])):
            entry = pl[p]
            assert len(entry) == k and entry[str(prompts[2][p])]["rank"] == 1


def test_batch_of_prompts_answers_in_order(oai, base, seqs, ref, tok):
    k = 2
    prompts = [seqs[1], seqs[0], seqs[3]]
    resp = oai.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1,
                                  extra_body={"prompt_logprobs": k})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    natives = native_topk(base, {"sequences": prompts, "k": k})["results"]
    for ids, choice, native in zip(prompts, resp.choices, natives):
        _check_prompt_logprobs(_prompt_logprobs(choice), ids, k, native, ref.logprobs(ids), tok)
    assert resp.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_text_prompts_use_the_teachers_tokenizer(oai, base, ref, tok):
    k = 2
    texts = ["hello world", "The cat sat on the mat."]
    resp = oai.completions.create(model=MODEL_NAME, prompt=texts, max_tokens=1,
                                  extra_body={"prompt_logprobs": k})
    assert len(resp.choices) == 2
    for text, choice in zip(texts, resp.choices):
        t = post_ok(base, "/tokenize", {"prompt": text, "add_special_tokens": True})
        ids = t["tokens"]
        assert ids == tok.encode(text, add_special_tokens=True).ids
        native = native_topk(base, {"sequences": [ids], "k": k})["results"][0]
        _check_prompt_logprobs(_prompt_logprobs(choice), ids, k, native, ref.logprobs(ids), tok)
    # A single string.
    one = oai.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=1,
                                 extra_body={"prompt_logprobs": k})
    assert len(_prompt_logprobs(one.choices[0])) == len(tok.encode("hello world").ids)


def test_temperature_scales_prompt_logprobs(oai, base, seqs, ref, tok):
    k, tau = 3, 0.5
    ids = seqs[0]
    resp = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=tau,
                                  seed=1, extra_body={"prompt_logprobs": k})
    native = native_topk(base, {"sequences": [ids], "k": k, "temperature": tau})["results"][0]
    _check_prompt_logprobs(_prompt_logprobs(resp.choices[0]), ids, k, native,
                           ref.logprobs(ids, tau), tok)


def test_temperature_zero_is_greedy_with_unscaled_logprobs(oai, base, seqs, ref, tok):
    k = 3
    ids, nxt = _greedy_prompt(seqs, ref, tok)
    resp = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": k})
    choice = resp.choices[0]
    assert choice.text == tok.decode([nxt], skip_special_tokens=False)
    native = native_topk(base, {"sequences": [ids], "k": k})["results"][0]
    _check_prompt_logprobs(_prompt_logprobs(choice), ids, k, native, ref.logprobs(ids), tok)
    assert resp.usage.completion_tokens == 1


def test_no_prompt_logprobs_unless_asked(base, seqs):
    body = post_ok(base, "/v1/completions", {"model": MODEL_NAME, "prompt": seqs[0], "max_tokens": 1})
    [choice] = body["choices"]
    assert choice["prompt_logprobs"] is None
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert isinstance(body["created"], int)


# -- Axolotl's request and the legacy logprobs object -----------------------------------------


def test_axolotl_echo_request_with_extra_keys(base, seqs, ref, tok):
    k = 4
    ids = seqs[0]
    body = post_ok(base, "/v1/completions", {
        "prompt": [ids], "max_tokens": 0, "echo": True, "prompt_logprobs": k, "logprobs": k,
        "top_logprobs": k, "sampling_params": {}, "some_future_key": {"x": [1, 2]},
    })
    [choice] = body["choices"]
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids)
    native = native_topk(base, {"sequences": [ids], "k": k})["results"][0]
    _check_prompt_logprobs(pl, ids, k, native, ref.logprobs(ids), tok)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}


def test_legacy_logprobs_with_echo(base, seqs):
    k = 3
    ids = seqs[1]
    native = native_topk(base, {"sequences": [ids], "k": k})["results"][0]
    # Token ids as keys: unambiguous.
    body = post_ok(base, "/v1/completions", {
        "model": MODEL_NAME, "prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": k,
        "return_tokens_as_token_ids": True})
    [choice] = body["choices"]
    lg = choice["logprobs"]
    assert set(lg) >= {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lg["tokens"] == [f"token_id:{i}" for i in ids]
    assert lg["token_logprobs"][0] is None
    np.testing.assert_allclose(lg["token_logprobs"][1:], native["target_logprobs"],
                               rtol=0, atol=ROUTE_ATOL)
    assert lg["top_logprobs"][0] is None and len(lg["top_logprobs"]) == len(ids)
    for p in range(1, len(ids)):
        top = lg["top_logprobs"][p]
        want = {f"token_id:{i}": v for i, v in zip(native["topk_ids"][p - 1], native["topk_values"][p - 1])}
        assert set(want) <= set(top) <= set(want) | {f"token_id:{ids[p]}"}
        for key, v in want.items():
            np.testing.assert_allclose(top[key], v, rtol=0, atol=ROUTE_ATOL)
    offs = lg["text_offset"]
    assert len(offs) == len(ids) and offs[0] == 0 and all(a <= b for a, b in zip(offs, offs[1:]))
    # Echo + logprobs without prompt_logprobs: prompt_logprobs takes the value of logprobs.
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    assert all(len(pl[p]) in (k, k + 1) for p in range(1, len(ids)))
    # Decoded strings as keys.
    body = post_ok(base, "/v1/completions", {
        "model": MODEL_NAME, "prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": k})
    lg = body["choices"][0]["logprobs"]
    assert len(lg["tokens"]) == len(ids) and all(isinstance(t, str) for t in lg["tokens"])
    assert lg["token_logprobs"][0] is None
    np.testing.assert_allclose(lg["token_logprobs"][1:], native["target_logprobs"],
                               rtol=0, atol=ROUTE_ATOL)
    assert all(1 <= len(lg["top_logprobs"][p]) <= k + 1 for p in range(1, len(ids)))


# -- /v1/models, /tokenize, /detokenize -------------------------------------------------------


def test_models(base, oai):
    r = requests.get(base + "/v1/models", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    [m] = body["data"]
    assert m["id"] == MODEL_NAME and m["object"] == "model" and m["owned_by"] == "xdistill"
    assert m["max_model_len"] == 256 and isinstance(m["created"], int)
    assert [x.id for x in oai.models.list()] == [MODEL_NAME]


@pytest.mark.parametrize("text", ["hello world", "Ünïcödé — 你好, <|im_start|>user\nhi"])
def test_tokenize_matches_the_tokenizers_library(base, tok, text):
    body = post_ok(base, "/tokenize", {"prompt": text, "add_special_tokens": True})
    enc = tok.encode(text, add_special_tokens=True)
    assert body["tokens"] == enc.ids
    assert body["count"] == len(enc.ids)
    assert body["max_model_len"] == 256
    assert "token_strs" in body
    with_strs = post_ok(base, "/tokenize", {"model": MODEL_NAME, "prompt": text,
                                            "return_token_strs": True})
    assert with_strs["tokens"] == enc.ids
    assert with_strs["token_strs"] == enc.tokens


def test_detokenize_matches_the_tokenizers_library(base, tok):
    ids = tok.encode("The quick brown fox, 你好!").ids
    body = post_ok(base, "/detokenize", {"tokens": ids})
    assert body == {"prompt": tok.decode(ids)}
    body = post_ok(base, "/detokenize", {"model": MODEL_NAME, "tokens": ids, "extra": 1})
    assert body["prompt"] == "The quick brown fox, 你好!"


# -- errors -----------------------------------------------------------------------------------


def test_max_tokens_above_one_is_400(base, oai, seqs):
    r = post(base, "/v1/completions", {"model": MODEL_NAME, "prompt": [seqs[0]], "max_tokens": 2})
    assert_openai_error(r, 400)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL_NAME, prompt=seqs[0], max_tokens=2)


def test_prompt_logprobs_above_max_k_is_400(limited_teacher, seqs):
    url = limited_teacher.url
    r = post(url, "/v1/completions", {"prompt": [seqs[0]], "max_tokens": 1,
                                      "prompt_logprobs": LIMITED_MAX_K + 1})
    assert_openai_error(r, 400, contains=f"greater than max allowed: {LIMITED_MAX_K}")
    # -1 (the whole vocabulary) is over the limit too, and the message names it.
    r = post(url, "/v1/completions", {"prompt": [seqs[0]], "max_tokens": 1, "prompt_logprobs": -1})
    err = assert_openai_error(r, 400)
    assert str(LIMITED_MAX_K) in err["message"], err
    # At the limit it serves.
    body = post_ok(url, "/v1/completions", {"prompt": [seqs[0]], "max_tokens": 1,
                                            "prompt_logprobs": LIMITED_MAX_K})
    assert len(body["choices"][0]["prompt_logprobs"][1]) >= LIMITED_MAX_K
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=f"greater than max allowed: {LIMITED_MAX_K}"):
        c.completions.create(model=MODEL_NAME, prompt=seqs[0], max_tokens=1,
                             extra_body={"prompt_logprobs": LIMITED_MAX_K + 1})


def test_whole_vocabulary_prompt_logprobs_is_400_on_the_default_server(base, seqs):
    r = post(base, "/v1/completions", {"prompt": [seqs[0]], "max_tokens": 1, "prompt_logprobs": -1})
    err = assert_openai_error(r, 400)
    assert "256" in err["message"], err


def test_n_above_one_is_400(base, seqs):
    r = post(base, "/v1/completions", {"prompt": [seqs[0]], "max_tokens": 1, "n": 2})
    assert_openai_error(r, 400)


def test_wrong_model_is_404(base, oai, seqs):
    r = post(base, "/v1/completions", {"model": "not-" + MODEL_NAME, "prompt": [seqs[0]],
                                       "max_tokens": 1})
    assert_openai_error(r, 404)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt=seqs[0], max_tokens=1)


def test_token_id_out_of_vocabulary_is_422_naming_it(base, seqs, ref):
    bad = list(seqs[0][:3]) + [ref.n_valid] + list(seqs[0][3:])
    r = post(base, "/v1/completions", {"prompt": [bad], "max_tokens": 1, "prompt_logprobs": 1})
    assert_openai_error(r, 422, param="prompt[0][3]")


def test_empty_prompt_is_422(base):
    r = post(base, "/v1/completions", {"prompt": [[]], "max_tokens": 1})
    assert_openai_error(r, 422)


@pytest.mark.parametrize("raw", ['{"prompt": [[1, 2, 3]], "max_tokens": 1', "not json", '[1, 2]'])
def test_malformed_json_is_400(base, raw):
    r = post(base, "/v1/completions", raw)
    assert_openai_error(r, 400)


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/completions", {"prompt": [[9707, 11, 1879]], "max_tokens": 1, "prompt_logprobs": 1}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/detokenize", {"tokens": [9707]}),
    ("POST", "/generate", {"input_ids": [9707, 11, 1879], "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 0}}),
])
def test_api_key_is_required(auth_teacher, method, path, body):
    url = auth_teacher.url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.request(method, url, json=body, headers=headers, timeout=60)
        assert_openai_error(r, 401)
    r = requests.request(method, url, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=60)
    assert r.status_code == 200, r.text


def test_api_key_through_the_sdk(auth_teacher, seqs):
    good = openai.OpenAI(base_url=f"{auth_teacher.url}/v1", api_key=API_KEY, max_retries=0)
    resp = good.completions.create(model=MODEL_NAME, prompt=seqs[0], max_tokens=1,
                                   extra_body={"prompt_logprobs": 1})
    assert len(_prompt_logprobs(resp.choices[0])) == len(seqs[0])
    bad = openai.OpenAI(base_url=f"{auth_teacher.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt=seqs[0], max_tokens=1)
