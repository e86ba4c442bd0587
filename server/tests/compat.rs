//! The protocol-version-2 native fields (`k = 0`, candidate `ids`) and the vLLM/SGLang-compatible
//! routes on a real `teacher` (a Llama model with the SentencePiece Llama-2 tokenizer; the Python
//! tests in `python/tests` cover the same routes through third-party clients on Qwen3), checked
//! against the f64 reference, the native route and the `tokenizers` crate.

use crate::common;

use crate::common::{client, ids, request, score, Reference, Teacher};
use serde_json::{json, Value};
use std::sync::OnceLock;
use xdistill_shared::codec::Format;

/// Llama-2's vocabulary is 32,000 ids: `--max-k 32000` lets `prompt_logprobs: -1` through.
fn teachers() -> &'static (Teacher, Teacher, Reference) {
    static S: OnceLock<(Teacher, Teacher, Reference)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = common::tiny_model("compat-llama", "llama", "llama2", 1);
        let plain = common::start_teacher(&dir, &["--served-model-name", "tiny"]);
        let wide = common::start_teacher(&dir, &["--max-k", "32000", "--cache-bytes", "0"]);
        (plain, wide, Reference::load(&dir))
    })
}

async fn post_json(t: &Teacher, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(t.url(path))
        .json(body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    let v = r.json().await.expect("JSON body");
    (status, v)
}

/// `k = 0` returns no top-k columns but exact target log-probs and logsumexps, and `ids` returns
/// the full-vocabulary log-probs at each row's candidates, in both formats.
#[tokio::test]
async fn k_zero_and_candidate_ids_equal_the_reference() {
    let (t, _, reference) = teachers();
    let v = reference.vocab();
    let seqs = vec![ids(1, 7, v), ids(2, 4, v)];
    let mut req = request(seqs.clone(), 0);
    req.starts = Some(vec![2, 0]);
    req.temperature = 0.7;
    // Rows: 7 - 1 - 2 = 4 and 3; 5 candidates per row (a few of them the targets).
    let cands: Vec<Vec<Vec<u32>>> = [(4usize, 11u64), (3, 12)]
        .iter()
        .map(|&(rows, seed)| (0..rows).map(|r| ids(seed + r as u64, 5, v)).collect())
        .collect();
    req.ids = Some(cands.clone());
    for format in [Format::Json, Format::Msgpack] {
        let resp = score(&client(), t, &req, format).await;
        assert!(resp.with_ids);
        for (i, (s, got)) in seqs.iter().zip(&resp.results).enumerate() {
            let start = req.start_of(i);
            let rows = reference.rows(s, start, 0.7);
            assert_eq!((got.rows, got.k, got.m), (rows.len(), 0, 5));
            assert!(got.topk_ids.is_empty() && got.topk_values.is_empty());
            for (r, (y, lp)) in rows.iter().enumerate() {
                let target = s[start + r + 1] as usize;
                assert!((got.target_logprobs[r] as f64 - lp[target]).abs() < 1e-5);
                assert!((got.logsumexp[r] as f64 - (y[0] - lp[0])).abs() < 1e-5);
                for (j, &c) in cands[i][r].iter().enumerate() {
                    let want = lp[c as usize];
                    let got = got.ids_logprobs_row(r)[j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{format:?} seq {i} row {r} cand {j}"
                    );
                }
            }
        }
    }
    // A candidate list per row, of one length, of valid ids.
    req.ids = Some(vec![cands[0].clone(), vec![vec![1, 2]; 2]]);
    let (status, body) = common::post(&client(), t, &req, Format::Json).await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["field"], "ids[1]");
}

/// `prompt_logprobs: -1` is the whole vocabulary when `--max-k` allows it: every entry present,
/// ranks 1..V, probabilities summing to 1, values equal to the reference.
#[tokio::test]
async fn whole_vocabulary_prompt_logprobs() {
    let (plain, wide, reference) = teachers();
    let v = reference.vocab();
    let prompt = ids(5, 3, v);
    let body = json!({"prompt": prompt, "max_tokens": 0, "prompt_logprobs": -1});
    let (status, resp) = post_json(wide, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{resp}");
    let pl = resp["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(pl.len(), 3);
    assert!(pl[0].is_null());
    let rows = reference.rows(&prompt, 0, 1.0);
    for (p, (_, lp)) in (1..3).zip(&rows) {
        let entry = pl[p].as_object().unwrap();
        assert_eq!(entry.len(), v, "position {p}: every id once");
        let mut ranks: Vec<u64> = entry
            .values()
            .map(|e| e["rank"].as_u64().unwrap())
            .collect();
        ranks.sort_unstable();
        assert!(ranks.iter().copied().eq(1..=v as u64));
        let total: f64 = entry
            .values()
            .map(|e| e["logprob"].as_f64().unwrap().exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-4, "position {p}: mass {total}");
        for (id, e) in entry.iter().step_by(997) {
            let id: usize = id.parse().unwrap();
            assert!((e["logprob"].as_f64().unwrap() - lp[id]).abs() < 1e-5);
        }
    }
    // Over --max-k (256 on the plain server) it is a 400 naming the limit, as vLLM phrases it.
    let (status, resp) = post_json(plain, "/v1/completions", &body).await;
    assert_eq!(status, 400, "{resp}");
    let msg = resp["error"]["message"].as_str().unwrap();
    assert!(msg.contains("greater than max allowed: 256"), "{msg}");
    assert_eq!(resp["error"]["param"], "prompt_logprobs");
    assert_eq!(resp["error"]["code"], 400);
}

#[tokio::test]
async fn generation_beyond_one_token_is_refused() {
    let (t, _, _) = teachers();
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "max_tokens": 2, "prompt_logprobs": 1}),
            "max_tokens",
        ),
        (
            "/generate",
            json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16}}),
            "sampling_params.max_new_tokens",
        ),
        ("/v1/completions", json!({"prompt": [1, 2], "n": 2}), "n"),
    ] {
        let (status, resp) = post_json(t, path, &body).await;
        assert_eq!(status, 400, "{path}: {resp}");
        assert_eq!(resp["error"]["type"], "unsupported_request");
        assert_eq!(resp["error"]["param"], param);
        assert!(resp["error"]["message"]
            .as_str()
            .unwrap()
            .contains("generate"));
    }
    // A model name other than the served one is a 404.
    let (status, resp) = post_json(
        t,
        "/v1/completions",
        &json!({"prompt": [1, 2], "model": "gpt-4"}),
    )
    .await;
    assert_eq!(
        (status, resp["error"]["type"].as_str()),
        (404, Some("model_not_found"))
    );
}

/// Text prompts are tokenized with the teacher's tokenizer (`add_special_tokens` honoured: the
/// Llama-2 BOS), and the answer scores exactly those ids.
#[tokio::test]
async fn text_prompts_are_tokenized_by_the_teacher() {
    let (t, _, reference) = teachers();
    let tok = tokenizers::Tokenizer::from_file(xdistill_testkit::tokenizer_json("llama2")).unwrap();
    let texts = ["Hello world, how are you?", "x = 1 + 2"];
    for add_special in [true, false] {
        let body = json!({"prompt": texts, "max_tokens": 0, "prompt_logprobs": 2,
                          "add_special_tokens": add_special, "echo": true});
        let (status, resp) = post_json(t, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        let mut total = 0;
        for (i, text) in texts.iter().enumerate() {
            let want: Vec<u32> = tok.encode(*text, add_special).unwrap().get_ids().to_vec();
            assert_eq!(
                want[0] == 1,
                add_special,
                "BOS only with add_special_tokens"
            );
            total += want.len();
            let choice = &resp["choices"][i];
            assert_eq!(choice["index"], i);
            assert_eq!(choice["text"], *text, "echo returns the prompt text");
            let pl = choice["prompt_logprobs"].as_array().unwrap();
            assert_eq!(pl.len(), want.len());
            // The actual token's log-prob at every position equals the reference's.
            let rows = reference.rows(&want, 0, 1.0);
            for p in 1..want.len() {
                let e = &pl[p][want[p].to_string()];
                let lp = e["logprob"].as_f64().unwrap();
                assert!(
                    (lp - rows[p - 1].1[want[p] as usize]).abs() < 1e-5,
                    "{text} @ {p}"
                );
            }
            // /tokenize agrees.
            let (_, tk) = post_json(
                t,
                "/tokenize",
                &json!({"prompt": text, "add_special_tokens": add_special}),
            )
            .await;
            assert_eq!(tk["tokens"], json!(want));
            assert_eq!(tk["count"], want.len());
        }
        assert_eq!(resp["usage"]["prompt_tokens"], total);
    }
}

/// SGLang's layout: for `logprob_start_len = N` the lists align with `ids[N..]`, entry 0 null,
/// entry i the native row `N + i - 1`; the temperature scales like the native route's.
#[tokio::test]
async fn sglang_input_logprobs_equal_the_native_rows() {
    let (t, _, reference) = teachers();
    let v = reference.vocab();
    let s = ids(9, 8, v);
    let body = json!({"input_ids": [s.clone()], "return_logprob": true, "logprob_start_len": 3,
                      "top_logprobs_num": 4, "token_ids_logprob": [7, 8],
                      "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}});
    let (status, resp) = post_json(t, "/generate", &body).await;
    assert_eq!(status, 200, "{resp}");
    let out = &resp.as_array().unwrap()[0];
    let meta = &out["meta_info"];
    let mut native = request(vec![s.clone()], 4);
    native.start = 3;
    native.temperature = 0.5;
    native.ids = Some(vec![vec![vec![7, 8]; 4]]);
    let n = score(&client(), t, &native, Format::Msgpack).await;
    let n = &n.results[0];
    let tok = meta["input_token_logprobs"].as_array().unwrap();
    let top = meta["input_top_logprobs"].as_array().unwrap();
    let cand = meta["input_token_ids_logprobs"].as_array().unwrap();
    assert_eq!((tok.len(), top.len(), cand.len()), (5, 5, 5));
    assert_eq!(tok[0], json!([null, s[3], null]));
    assert!(top[0].is_null() && cand[0].is_null());
    for i in 1..5 {
        let r = i - 1;
        assert_eq!(tok[i][1], s[3 + i]);
        let close = |x: &Value, y: f32| (x.as_f64().unwrap() - y as f64).abs() < 1e-6;
        assert!(close(&tok[i][0], n.target_logprobs[r]));
        let row = top[i].as_array().unwrap();
        assert_eq!(row.len(), 4);
        for ((e, &id), &v) in row.iter().zip(n.ids_row(r)).zip(n.values_row(r)) {
            assert_eq!(e[1], id);
            assert!(close(&e[0], v));
        }
        let row = cand[i].as_array().unwrap();
        assert_eq!(row.len(), 2);
        for (e, &v) in row.iter().zip(n.ids_logprobs_row(r)) {
            assert!(close(&e[0], v));
        }
    }
    assert_eq!(meta["prompt_tokens"], 8);
    assert_eq!(out["text"], "");
}

/// The tokenizer routes refuse bad input with the documented errors.
#[tokio::test]
async fn tokenizer_routes_refuse_bad_input() {
    let (t, _, _) = teachers();
    let (status, resp) = post_json(t, "/detokenize", &json!({"tokens": [1, 32000]})).await;
    assert_eq!(status, 422, "{resp}");
    assert_eq!(resp["error"]["param"], "tokens[1]");
    let (status, resp) = post_json(t, "/detokenize", &json!({"tokens": [1, -3]})).await;
    assert_eq!(
        (status, resp["error"]["param"].as_str()),
        (422, Some("tokens[1]"))
    );
    let (status, resp) = post_json(t, "/tokenize", &json!({"add_special_tokens": true})).await;
    assert_eq!(
        (status, resp["error"]["param"].as_str()),
        (422, Some("prompt"))
    );
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, resp) = post_json(t, "/tokenize", &chat).await;
    assert_eq!(
        (status, resp["error"]["param"].as_str()),
        (400, Some("messages"))
    );
    // Round trip of a real text through both routes.
    let (_, tk) = post_json(t, "/tokenize", &json!({"prompt": "Déjà vu 🙂"})).await;
    let (status, dt) = post_json(t, "/detokenize", &json!({"tokens": tk["tokens"]})).await;
    assert_eq!(status, 200);
    assert!(
        dt["prompt"].as_str().unwrap().ends_with("Déjà vu 🙂"),
        "{dt}"
    );
}

/// A prompt scored with `max_tokens: 1` gets the same bits as the native route gives it: the
/// next token's row is a separate step over the KV cache, so the prompt's forward is the plain
/// request's (and batching does not matter: scores are batch-invariant).
#[tokio::test]
async fn next_token_requests_keep_the_native_bits() {
    let (t, _, reference) = teachers();
    let v = reference.vocab();
    for (len, seed) in [(9usize, 21u64), (2, 22), (40, 23)] {
        let prompt = ids(seed, len, v);
        let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                          "prompt_logprobs": 5});
        let (status, resp) = post_json(t, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{resp}");
        let native = score(
            &client(),
            t,
            &request(vec![prompt.clone()], 5),
            Format::Msgpack,
        )
        .await;
        let n = &native.results[0];
        let pl = resp["choices"][0]["prompt_logprobs"].as_array().unwrap();
        assert_eq!(pl.len(), len);
        for (p, entry) in pl.iter().enumerate().skip(1) {
            for (j, &id) in n.ids_row(p - 1).iter().enumerate() {
                let lp = entry[id.to_string()]["logprob"].as_f64().unwrap() as f32;
                assert_eq!(
                    lp.to_bits(),
                    n.values_row(p - 1)[j].to_bits(),
                    "len {len} position {p} entry {j}"
                );
            }
        }
    }
}
