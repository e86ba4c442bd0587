//! The routes of exact full-vocabulary distillation against a real `teacher`: `/hidden_states`
//! times `/v1/head` gives back `/topk_logits`' log-probs (tied and untied heads, a padded
//! vocabulary, Gemma's scaled embedding and `1 + w` norms), the head file's fingerprint, the
//! same refusals as `/topk_logits`, auth, answer limits and the cache.

mod common;

use common::{client, ids, metric, request, score, Teacher};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use xdistill_shared::codec::{self, Format, HeadFile};
use xdistill_shared::init::{init_model_dir, InitSpec};
use xdistill_shared::protocol::{
    HiddenRequest, HiddenResponse, InfoWithFullVocab, HEAD_FINGERPRINT_HEADER, HEAD_PATH,
    HIDDEN_PATH,
};

/// f32 rounding of logits of a few units, summed over hidden 32, and of a logsumexp over
/// 150k ids.
const TOL: f64 = 2e-4;

/// A tiny model (hidden 32, 2 layers) of `arch` with `tokenizer`, tied or not, its head padded
/// to a multiple of `pad_to`, made once under this package's `CARGO_TARGET_TMPDIR`.
fn model(name: &str, arch: &str, tokenizer: &str, tie: bool, pad_to: usize) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("teacher-models")
        .join(name);
    xdistill_testkit::models::made_once(&out, |out| {
        let tok = xdistill_testkit::tokenizer_json(tokenizer);
        init_model_dir(&InitSpec {
            pad_vocab_to: pad_to,
            init_std: 0.1,
            out: out.to_path_buf(),
            ..xdistill_testkit::tiny_spec(arch, &tok, tie)
        })
        .expect("init-model");
    })
}

/// Qwen3 vocabulary (151,669 ids), untied head padded to 151,680 rows.
fn qwen3_untied_padded() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| {
        let dir = model("fv-qwen3-untied", "qwen3", "qwen3", false, 64);
        common::start_teacher(&dir, &[])
    })
}

/// Llama 2 vocabulary, tied head, not padded; the padded (per-batch) forward and a small batch
/// budget, so that long sequences take the KV-cache path.
fn llama_tied() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| {
        let dir = model("fv-llama-tied", "llama", "llama2", true, 1);
        common::start_teacher(
            &dir,
            &["--batch-invariant", "false", "--max-batch-tokens", "16"],
        )
    })
}

/// Gemma 3 (scaled embedding, `1 + w` norms), tied, padded.
fn gemma3_tied_padded() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| {
        let dir = model("fv-gemma3-tied", "gemma3", "gemma3", true, 64);
        common::start_teacher(&dir, &[])
    })
}

async fn info(c: &reqwest::Client, t: &Teacher) -> InfoWithFullVocab {
    c.get(t.url("/v1/info"))
        .send()
        .await
        .expect("GET /v1/info")
        .json()
        .await
        .expect("an info body")
}

/// `GET /v1/head`: the status, the fingerprint header and the bytes.
async fn get_head(c: &reqwest::Client, t: &Teacher) -> (u16, String, Vec<u8>) {
    let r = c.get(t.url(HEAD_PATH)).send().await.expect("GET /v1/head");
    let status = r.status().as_u16();
    let fp = r
        .headers()
        .get(HEAD_FINGERPRINT_HEADER)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, fp, r.bytes().await.expect("head bytes").to_vec())
}

/// POSTs `body` to `/hidden_states` as `format`; the status and the raw answer.
async fn post_hidden(
    c: &reqwest::Client,
    t: &Teacher,
    body: Vec<u8>,
    format: Format,
) -> (u16, Vec<u8>) {
    let r = c
        .post(t.url(HIDDEN_PATH))
        .header("content-type", format.content_type())
        .body(body)
        .send()
        .await
        .expect("POST /hidden_states");
    (r.status().as_u16(), r.bytes().await.expect("body").to_vec())
}

async fn hidden(c: &reqwest::Client, t: &Teacher, req: &HiddenRequest) -> HiddenResponse {
    let (status, body) = post_hidden(
        c,
        t,
        codec::encode_hidden_request(Format::Msgpack, req).unwrap(),
        Format::Msgpack,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    codec::decode_hidden_response(&body).expect("a hidden-state answer")
}

/// Log-probs over the valid vocabulary of one hidden row through the head, in f64:
/// `log_softmax(c · tanh((h · W^T + b) · s / c))` over ids `< vocab_size`.
fn logprobs(head: &HeadFile, row: &[f32]) -> (Vec<f64>, f64) {
    let m = &head.meta;
    let h = m.hidden_size;
    let z: Vec<f64> = (0..m.vocab_size)
        .map(|v| {
            let w = &head.weight[v * h..(v + 1) * h];
            let mut x: f64 = w.iter().zip(row).map(|(&a, &b)| a as f64 * b as f64).sum();
            if let Some(b) = &head.bias {
                x += b[v] as f64;
            }
            x *= m.logit_scale;
            if let Some(cap) = m.logit_softcap {
                x = cap * (x / cap).tanh();
            }
            x
        })
        .collect();
    let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    (z.iter().map(|x| x - lse).collect(), lse)
}

/// The property the routes exist for, on one teacher: the head file is what `/v1/info` says,
/// and hidden states through it give `/topk_logits`' top-k, target log-probs and logsumexps.
async fn reconstructs_topk(t: &Teacher, tied: bool, padded: bool) {
    let c = client();
    let inf = info(&c, t).await;
    let fv = inf.full_vocab.expect("full_vocab in /v1/info");
    assert_eq!(fv.hidden_route, HIDDEN_PATH);
    assert_eq!(fv.head_route, HEAD_PATH);
    assert_eq!(fv.dtype, "f32");
    assert_eq!(fv.dtype, inf.info.dtype);
    assert_eq!(fv.hidden_size, 32);
    assert_eq!(fv.head_rows, inf.info.logits_size);
    assert_eq!(fv.vocab_size, inf.info.vocab_size);
    assert_eq!(fv.tied, tied);
    assert_eq!(padded, fv.head_rows > fv.vocab_size, "{fv:?}");
    let (status, fp, bytes) = get_head(&c, t).await;
    assert_eq!(status, 200);
    assert_eq!(bytes.len() as u64, fv.head_bytes);
    assert_eq!(hex::encode(Sha256::digest(&bytes)), fv.head_fingerprint);
    assert_eq!(fp, fv.head_fingerprint);
    let head = codec::decode_head(&bytes).expect("a head file");
    assert_eq!(head.meta.head_rows, fv.head_rows);
    assert_eq!(head.meta.vocab_size, fv.vocab_size);
    assert_eq!(head.meta.model_fingerprint, inf.info.model_fingerprint);
    assert_eq!(head.weight.len(), fv.head_rows * fv.hidden_size);

    let v = fv.vocab_size;
    // Long enough for the KV-cache chunks of `--max-batch-tokens 16`; ids near the top of the
    // vocabulary included.
    let mut long = ids(41, 40, v);
    long[5] = (v - 1) as u32;
    let seqs = vec![long, ids(42, 7, v), ids(43, 2, v), vec![3]];
    let starts = vec![0, 2, 1, 0];
    let k = 8;
    let mut topk = request(seqs.clone(), k);
    topk.starts = Some(starts.clone());
    let want = score(&c, t, &topk, Format::Msgpack).await;
    let req = HiddenRequest {
        sequences: seqs.clone(),
        start: 0,
        starts: Some(starts.clone()),
    };
    let got = hidden(&c, t, &req).await;
    assert_eq!(got.model, inf.info.model_fingerprint);
    assert_eq!(got.head_fingerprint, fv.head_fingerprint);
    assert_eq!(got.hidden_size, 32);
    let mut rows_checked = 0;
    for (i, s) in seqs.iter().enumerate() {
        let rows = s.len() - 1 - starts[i];
        let w = &want.results[i];
        assert_eq!(got.results[i].rows, rows, "sequence {i}");
        assert_eq!(w.rows, rows);
        let states = got.f32_rows(i).unwrap();
        for r in 0..rows {
            let (lp, lse) = logprobs(&head, &states[r * 32..(r + 1) * 32]);
            let at = |what: &str, a: f64, b: f32| {
                assert!(
                    (a - b as f64).abs() < TOL,
                    "sequence {i} row {r} {what}: reconstructed {a}, served {b}"
                );
            };
            at("logsumexp", lse, w.logsumexp[r]);
            let target = s[starts[i] + r + 1] as usize;
            at("target", lp[target], w.target_logprobs[r]);
            for (j, (&id, &val)) in w.ids_row(r).iter().zip(w.values_row(r)).enumerate() {
                at(&format!("top-{j} id {id}"), lp[id as usize], val);
            }
            // The reconstruction's own top-k has the served values.
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
            for (j, &id) in order[..k].iter().enumerate() {
                at(
                    &format!("reconstructed top-{j} ({id})"),
                    lp[id],
                    w.values_row(r)[j],
                );
            }
            rows_checked += 1;
        }
    }
    // 39 + 4 rows; the 2-token sequence from 1 and the 1-token one have none.
    assert_eq!(rows_checked, 43);

    // The JSON body is the same request.
    let (status, body) = post_hidden(
        &c,
        t,
        codec::encode_hidden_request(Format::Json, &req).unwrap(),
        Format::Json,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(codec::decode_hidden_response(&body).unwrap(), got);
}

#[tokio::test]
async fn hidden_states_through_an_untied_padded_head_give_the_topk_logprobs() {
    reconstructs_topk(qwen3_untied_padded(), false, true).await;
}

#[tokio::test]
async fn hidden_states_through_a_tied_head_give_the_topk_logprobs() {
    reconstructs_topk(llama_tied(), true, false).await;
}

#[tokio::test]
async fn hidden_states_of_gemma3_give_the_topk_logprobs() {
    reconstructs_topk(gemma3_tied_padded(), true, true).await;
}

/// The fingerprint is the SHA-256 of the bytes received, the same on every request, and
/// `If-None-Match` with it answers 304 without the file.
#[tokio::test]
async fn head_fingerprint_is_the_sha256_of_the_bytes_and_stable() {
    let t = llama_tied();
    let c = client();
    let (s1, fp1, b1) = get_head(&c, t).await;
    let (s2, fp2, b2) = get_head(&c, t).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(fp1, fp2);
    assert_eq!(b1, b2);
    assert_eq!(hex::encode(Sha256::digest(&b1)), fp1);
    let st = safetensors::SafeTensors::deserialize(&b1).expect("a safetensors file");
    let w = st.tensor("weight").unwrap();
    assert_eq!(w.shape(), &[32000, 32]);
    let r = c
        .get(t.url(HEAD_PATH))
        .header("if-none-match", format!("\"{fp1}\""))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 304);
    assert!(r.bytes().await.unwrap().is_empty());
    let r = c.post(t.url(HEAD_PATH)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
}

/// A request body and its format.
type Body = (Vec<u8>, Format);

/// Refusals: the same statuses, types and fields as `/topk_logits`, and the server keeps
/// serving.
#[tokio::test]
async fn bad_hidden_requests_get_clear_4xx_answers() {
    let t = qwen3_untied_padded();
    let c = client();
    let v = info(&c, t).await.info.vocab_size as u32;
    let json = |s: &str| (s.as_bytes().to_vec(), Format::Json);
    let long = format!("[{}]", vec!["1"; 300].join(","));
    let cases: Vec<(Body, u16, &str, Option<String>, &str)> = vec![
        (
            json(&format!(r#"{{"sequences": [[1, 2, {v}]]}}"#)),
            422,
            "invalid_request",
            Some("sequences[0][2]".into()),
            "vocab size",
        ),
        (
            json(r#"{"sequences": [[1, 2], []]}"#),
            422,
            "invalid_request",
            Some("sequences[1]".into()),
            "empty sequence",
        ),
        (
            json(r#"{"sequences": []}"#),
            422,
            "invalid_request",
            Some("sequences".into()),
            "at least one",
        ),
        (
            json(&format!(r#"{{"sequences": [{long}]}}"#)),
            422,
            "invalid_request",
            Some("sequences[0]".into()),
            "max-seq-len",
        ),
        (
            json(r#"{"sequences": [[1, 2]], "start": 2}"#),
            422,
            "invalid_request",
            Some("start".into()),
            "out of range",
        ),
        (
            json(r#"{"sequences": [[1, 2]], "starts": [0, 0]}"#),
            422,
            "invalid_request",
            Some("starts".into()),
            "2 starts for 1 sequences",
        ),
        (
            json(r#"{"sequences": [[1, 2]], "k": 3}"#),
            400,
            "malformed_body",
            None,
            "unknown field",
        ),
        (
            json(r#"[[[1, 2]]]"#),
            400,
            "malformed_body",
            None,
            "positional",
        ),
        (
            (
                b"\x81\xa9sequences\x91\xc4\x02\x01\x02".to_vec(),
                Format::Msgpack,
            ),
            400,
            "malformed_body",
            None,
            "",
        ),
    ];
    for ((body, format), status, kind, field, needle) in cases {
        let shown = String::from_utf8_lossy(&body)
            .chars()
            .take(80)
            .collect::<String>();
        let (got, answer) = post_hidden(&c, t, body, format).await;
        let e: serde_json::Value = serde_json::from_slice(&answer)
            .unwrap_or_else(|_| panic!("{shown}: not JSON: {answer:?}"));
        assert_eq!(got, status, "{shown}: {e}");
        assert_eq!(e["error"]["type"], kind, "{shown}: {e}");
        assert_eq!(
            e["error"]["field"].as_str().map(String::from),
            field,
            "{shown}: {e}"
        );
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{shown}: {msg}");
    }
    let r = c
        .post(t.url(HIDDEN_PATH))
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    let r = c.get(t.url(HIDDEN_PATH)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    // Still serving.
    let ok = hidden(
        &c,
        t,
        &HiddenRequest {
            sequences: vec![vec![1, 2, 3]],
            start: 0,
            starts: None,
        },
    )
    .await;
    assert_eq!(ok.results[0].rows, 2);
}

/// With `--api-key`, both routes need the bearer token; `--max-answer-bytes` bounds the hidden
/// states' answer as it bounds scores.
#[tokio::test]
async fn auth_and_answer_limit_apply() {
    let dir = model("fv-llama-tied", "llama", "llama2", true, 1);
    // One row of 32 f32 is 128 bytes: 10 rows fit 2,000 bytes, 20 do not.
    let t = common::start_teacher(&dir, &["--api-key", "k1", "--max-answer-bytes", "2000"]);
    let c = client();
    let body = |n: usize| {
        codec::encode_hidden_request(
            Format::Json,
            &HiddenRequest {
                sequences: vec![(1..=n as u32).collect()],
                start: 0,
                starts: None,
            },
        )
        .unwrap()
    };
    for path in [HEAD_PATH, "/v1/info"] {
        let r = c.get(t.url(path)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
    }
    let r = c
        .post(t.url(HIDDEN_PATH))
        .body(body(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let post = |n: usize| {
        c.post(t.url(HIDDEN_PATH))
            .bearer_auth("k1")
            .body(body(n))
            .send()
    };
    let r = post(11).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = post(21).await.unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "answer_too_large", "{e}");
    let r = c
        .get(t.url(HEAD_PATH))
        .bearer_auth("k1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let bytes = r.bytes().await.unwrap();
    let head = codec::decode_head(&bytes).expect("a head file");
    assert_eq!(head.weight.len(), 32000 * 32);
}

/// A repeated request is answered from the cache (`xdistill_cache_hits_total`), with the same
/// bytes; hidden states and scores of one sequence are different entries.
#[tokio::test]
async fn repeated_hidden_requests_are_cache_hits() {
    let t = gemma3_tied_padded();
    let c = client();
    let v = info(&c, t).await.info.vocab_size;
    let req = HiddenRequest {
        sequences: vec![ids(77, 12, v)],
        start: 3,
        starts: None,
    };
    let body = codec::encode_hidden_request(Format::Msgpack, &req).unwrap();
    let (s1, a1) = post_hidden(&c, t, body.clone(), Format::Msgpack).await;
    let hits = metric(&c, t, "xdistill_cache_hits_total").await;
    let misses = metric(&c, t, "xdistill_cache_misses_total").await;
    let (s2, a2) = post_hidden(&c, t, body, Format::Msgpack).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(a1, a2);
    assert_eq!(metric(&c, t, "xdistill_cache_hits_total").await, hits + 1.0);
    assert_eq!(metric(&c, t, "xdistill_cache_misses_total").await, misses);
    // `/topk_logits` of the same sequence and start is not the hidden states' entry.
    let mut topk = request(req.sequences.clone(), 0);
    topk.start = 3;
    let s = score(&c, t, &topk, Format::Msgpack).await;
    assert_eq!(s.results[0].rows, 8);
    assert_eq!(
        metric(&c, t, "xdistill_cache_misses_total").await,
        misses + 1.0
    );
    let text = c
        .get(t.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(&format!(
            "xdistill_request_total{{route=\"{HIDDEN_PATH}\",outcome=\"ok\"}}"
        )),
        "{text}"
    );
}
