//! Every class of bad input gets a JSON error with the right status, and the server keeps
//! serving afterwards. One shared server (tiny Llama, Llama 2 vocabulary, API key set).

use crate::common;

use crate::common::{client, ids, request, Teacher};
use std::sync::OnceLock;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{ErrorBody, TopkRequest};

const KEY: &str = "test-secret";
const VOCAB: usize = 32_000;

fn teacher() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| {
        let dir = common::tiny_model("errors-llama", "llama", "llama2", 1);
        common::start_teacher(
            &dir,
            &[
                "--max-k",
                "40000",
                "--max-seq-len",
                "64",
                "--max-body-bytes",
                "4096",
                "--api-key",
                KEY,
            ],
        )
    })
}

async fn send(
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
    key: Option<&str>,
) -> reqwest::Response {
    let mut r = client().post(teacher().url(path)).body(body);
    if let Some(ct) = content_type {
        r = r.header("content-type", ct);
    }
    if let Some(k) = key {
        r = r.header("authorization", format!("Bearer {k}"));
    }
    r.send().await.expect("send")
}

async fn post_json(body: serde_json::Value) -> reqwest::Response {
    send(
        "/topk_logits",
        Some("application/json"),
        serde_json::to_vec(&body).unwrap(),
        Some(KEY),
    )
    .await
}

async fn post_msgpack(req: &TopkRequest) -> reqwest::Response {
    let body = codec::encode_request(Format::Msgpack, req).unwrap();
    send("/topk_logits", Some(codec::MSGPACK), body, Some(KEY)).await
}

/// Asserts status, error type and field of an error answer, then that the server still works.
async fn expect_error(r: reqwest::Response, status: u16, kind: &str, field: Option<&str>) {
    assert_eq!(r.status().as_u16(), status);
    assert_eq!(
        r.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json")
    );
    let text = r.text().await.unwrap();
    let body: ErrorBody = serde_json::from_str(&text).expect(&text);
    assert_eq!(body.error.kind, kind, "{text}");
    assert_eq!(body.error.field.as_deref(), field, "{text}");
    assert!(!body.error.message.is_empty());
    still_serving().await;
}

async fn still_serving() {
    let ok = post_json(serde_json::json!({"sequences": [[1, 2, 3]], "k": 2})).await;
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn malformed_body() {
    let r = send(
        "/topk_logits",
        Some("application/json"),
        b"{\"sequences\": [[1,".to_vec(),
        Some(KEY),
    )
    .await;
    expect_error(r, 400, "malformed_body", None).await;
    let r = send(
        "/topk_logits",
        Some(codec::MSGPACK),
        vec![0xc1, 0x00, 0xff],
        Some(KEY),
    )
    .await;
    expect_error(r, 400, "malformed_body", None).await;
    let r = post_json(serde_json::json!({"sequences": [[1, -2]], "k": 2})).await;
    expect_error(r, 400, "malformed_body", None).await;
}

#[tokio::test]
async fn unknown_field() {
    let r = post_json(serde_json::json!({"sequences": [[1, 2]], "k": 2, "topk": 3})).await;
    assert_eq!(r.status(), 400);
    let body: ErrorBody = r.json().await.unwrap();
    assert!(
        body.error.message.contains("topk"),
        "{}",
        body.error.message
    );
    still_serving().await;
}

#[tokio::test]
async fn empty_sequence_and_empty_list() {
    let r = post_json(serde_json::json!({"sequences": [[1, 2], []], "k": 2})).await;
    expect_error(r, 422, "invalid_request", Some("sequences[1]")).await;
    let r = post_json(serde_json::json!({"sequences": [], "k": 2})).await;
    expect_error(r, 422, "invalid_request", Some("sequences")).await;
}

#[tokio::test]
async fn id_at_or_above_vocab() {
    let r = post_json(serde_json::json!({"sequences": [[1, 2, VOCAB]], "k": 2})).await;
    expect_error(r, 422, "invalid_request", Some("sequences[0][2]")).await;
    let r = post_json(serde_json::json!({"sequences": [[1], [5, u32::MAX]], "k": 2})).await;
    expect_error(r, 422, "invalid_request", Some("sequences[1][1]")).await;
}

#[tokio::test]
async fn k_over_max_k_and_over_vocab() {
    for k in [40_001, VOCAB + 1] {
        let r = post_json(serde_json::json!({"sequences": [[1, 2]], "k": k})).await;
        expect_error(r, 422, "invalid_request", Some("k")).await;
    }
    // k equal to the vocabulary is allowed, and so (since protocol version 2) is k = 0: one
    // empty top-k row per position, with its target log-prob and logsumexp.
    let r = post_json(serde_json::json!({"sequences": [[1, 2]], "k": VOCAB})).await;
    assert_eq!(r.status(), 200);
    let r = post_json(serde_json::json!({"sequences": [[1, 2, 3]], "k": 0})).await;
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["results"][0]["topk_ids"], serde_json::json!([[], []]));
    assert_eq!(
        v["results"][0]["target_logprobs"].as_array().unwrap().len(),
        2
    );
}

#[tokio::test]
async fn temperature_not_positive_or_not_finite() {
    for t in [0.0, -1.0] {
        let r =
            post_json(serde_json::json!({"sequences": [[1, 2]], "k": 2, "temperature": t})).await;
        expect_error(r, 422, "invalid_request", Some("temperature")).await;
    }
    // JSON cannot carry NaN or infinity; MessagePack can.
    for t in [f32::NAN, f32::INFINITY] {
        let mut req = request(vec![vec![1, 2]], 2);
        req.temperature = t;
        expect_error(
            post_msgpack(&req).await,
            422,
            "invalid_request",
            Some("temperature"),
        )
        .await;
    }
}

#[tokio::test]
async fn start_out_of_range() {
    let r =
        post_json(serde_json::json!({"sequences": [[1, 2, 3], [4, 5]], "k": 2, "start": 2})).await;
    expect_error(r, 422, "invalid_request", Some("start")).await;
    let r = post_json(serde_json::json!({"sequences": [[1, 2, 3]], "k": 2, "starts": [3]})).await;
    expect_error(r, 422, "invalid_request", Some("starts[0]")).await;
    let r =
        post_json(serde_json::json!({"sequences": [[1, 2, 3]], "k": 2, "starts": [0, 1]})).await;
    expect_error(r, 422, "invalid_request", Some("starts")).await;
}

#[tokio::test]
async fn sequence_over_max_seq_len() {
    let r = post_json(serde_json::json!({"sequences": [[1, 2], ids(3, 65, VOCAB)], "k": 2})).await;
    expect_error(r, 422, "invalid_request", Some("sequences[1]")).await;
}

#[tokio::test]
async fn body_over_the_size_limit() {
    let big = format!(
        "{{\"sequences\": [[{}]], \"k\": 2}}",
        vec!["1"; 3000].join(",")
    );
    let r = send(
        "/topk_logits",
        Some("application/json"),
        big.into_bytes(),
        Some(KEY),
    )
    .await;
    expect_error(r, 413, "payload_too_large", None).await;
}

#[tokio::test]
async fn unsupported_content_type() {
    let r = send(
        "/topk_logits",
        Some("text/csv"),
        b"1,2,3".to_vec(),
        Some(KEY),
    )
    .await;
    expect_error(r, 415, "unsupported_media_type", None).await;
}

#[tokio::test]
async fn api_key_required_except_for_health() {
    let c = client();
    let body = serde_json::to_vec(&serde_json::json!({"sequences": [[1, 2]], "k": 2})).unwrap();
    let r = send("/topk_logits", Some("application/json"), body.clone(), None).await;
    assert!(r.headers().contains_key("www-authenticate"));
    expect_error(r, 401, "unauthorized", None).await;
    let r = send(
        "/topk_logits",
        Some("application/json"),
        body,
        Some("wrong"),
    )
    .await;
    expect_error(r, 401, "unauthorized", None).await;
    for path in ["/v1/info", "/metrics", "/tokenizer.json"] {
        let r = c.get(teacher().url(path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
        let r = c
            .get(teacher().url(path))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    let r = c.get(teacher().url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn unknown_route_and_wrong_method() {
    let c = client();
    let r = c
        .get(teacher().url("/nope"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "not_found", None).await;
    let r = c
        .get(teacher().url("/topk_logits"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    expect_error(r, 405, "method_not_allowed", None).await;
}

/// A full queue answers 503 with Retry-After at once; a request larger than the whole queue
/// answers 413; the queued request still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_full_and_request_too_large() {
    let dir = common::tiny_model("errors-llama", "llama", "llama2", 1);
    let t = common::start_teacher(
        &dir,
        &[
            "--max-wait-ms",
            "3000",
            "--max-batch-tokens",
            "32",
            "--max-queue-tokens",
            "40",
        ],
    );
    let first = {
        let url = t.url("/topk_logits");
        let body =
            codec::encode_request(Format::Json, &request(vec![ids(1, 31, VOCAB)], 3)).unwrap();
        tokio::spawn(async move {
            let r = client()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await?;
            let status = r.status().as_u16();
            Ok::<_, reqwest::Error>((status, r.text().await?))
        })
    };
    // Wait until the first request is queued (it then waits out the 3 s window).
    let c = client();
    common::wait_for_metric(&c, &t, "xdistill_queue_tokens", 30.0).await;
    let (status, body) =
        common::post(&c, &t, &request(vec![ids(2, 21, VOCAB)], 3), Format::Json).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.error.kind, "queue_full");
    let r = c
        .post(t.url("/topk_logits"))
        .header("content-type", "application/json")
        .body(codec::encode_request(Format::Json, &request(vec![ids(2, 21, VOCAB)], 3)).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let (status, body) = common::post(
        &c,
        &t,
        &request(vec![ids(3, 30, VOCAB); 2], 3),
        Format::Json,
    )
    .await;
    assert_eq!(status, 413);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.error.kind, "request_too_large");
    // The compatible routes share the queue: the same 503 + Retry-After and 413, in the one
    // error shape (with the OpenAI `code`).
    let prompt = ids(2, 21, VOCAB);
    for (path, body) in [
        (
            "/v1/completions",
            serde_json::json!({"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 3}),
        ),
        (
            "/generate",
            serde_json::json!({"input_ids": prompt, "return_logprob": true,
                               "logprob_start_len": 0}),
        ),
    ] {
        let r = c.post(t.url(path)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 503, "{path}");
        assert_eq!(r.headers()["retry-after"], "1");
        let e: ErrorBody = r.json().await.unwrap();
        assert_eq!(
            (e.error.kind.as_str(), e.error.code),
            ("queue_full", Some(503))
        );
    }
    let two = vec![ids(3, 30, VOCAB); 2];
    let body = serde_json::json!({"prompt": two, "max_tokens": 0, "prompt_logprobs": 3});
    let r = c
        .post(t.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let e: ErrorBody = r.json().await.unwrap();
    assert_eq!(e.error.kind, "request_too_large");
    let (status, body) = first.await.unwrap().unwrap();
    assert_eq!(status, 200, "the queued request: {body}");
    // The budget came back: the same request is admitted now.
    let (status, _) =
        common::post(&c, &t, &request(vec![ids(2, 21, VOCAB)], 3), Format::Json).await;
    assert_eq!(status, 200);
}

/// Memory amplification: sequences without rows still cost a token each, the sequence count and
/// the answer's size are bounded, and the refusals come before any work (413 at once).
#[tokio::test]
async fn every_sequence_and_answer_byte_is_counted() {
    let dir = common::tiny_model("errors-llama", "llama", "llama2", 1);
    let t = common::start_teacher(
        &dir,
        &[
            "--max-queue-tokens",
            "5000",
            "--max-batch-tokens",
            "5000",
            "--max-sequences",
            "8000",
            "--max-answer-bytes",
            "100000",
        ],
    );
    let c = client();
    let ones = |n: usize| request(vec![vec![1u32]; n], 2);
    // 6,000 one-token sequences: no forward, but 6,000 tokens of a 5,000 budget.
    let (status, body) = common::post(&c, &t, &ones(6000), Format::Msgpack).await;
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.error.kind, "request_too_large");
    let (status, body) = common::post(&c, &t, &ones(9000), Format::Msgpack).await;
    assert_eq!(status, 413);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.error.kind, "too_many_sequences");
    // 4 × 40 rows × (2 · 256 + 2) × 4 bytes ≈ 329 kB of scores > 100 kB.
    let big = request(vec![ids(4, 41, VOCAB); 4], 256);
    let (status, body) = common::post(&c, &t, &big, Format::Msgpack).await;
    assert_eq!(status, 413);
    let e: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(e.error.kind, "answer_too_large");
    assert_eq!(
        common::metric(&c, &t, "xdistill_batch_forward_total").await,
        0.0
    );
    // Within the limits all is served.
    let (status, _) = common::post(&c, &t, &ones(100), Format::Msgpack).await;
    assert_eq!(status, 200);
}

/// MessagePack bodies are decoded as strictly as JSON: trailing bytes, `values` as a variant
/// index and a `bin` blob where ids are expected are 400s naming the problem.
#[tokio::test]
async fn lenient_msgpack_is_refused() {
    let good = codec::encode_request(Format::Msgpack, &request(vec![vec![1, 2, 3]], 2)).unwrap();
    let r = send(
        "/topk_logits",
        Some(codec::MSGPACK),
        good.clone(),
        Some(KEY),
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut trailing = good;
    trailing.extend_from_slice(b"garbage");
    let r = send("/topk_logits", Some(codec::MSGPACK), trailing, Some(KEY)).await;
    expect_error(r, 400, "malformed_body", None).await;
    let as_index = rmp_serde::to_vec_named(
        &serde_json::json!({"sequences": [[1, 2, 3]], "k": 2, "values": 1}),
    )
    .unwrap();
    let r = send("/topk_logits", Some(codec::MSGPACK), as_index, Some(KEY)).await;
    expect_error(r, 400, "malformed_body", None).await;
    #[derive(serde::Serialize)]
    struct Blob<'a> {
        sequences: Vec<&'a serde_bytes::Bytes>,
        k: usize,
    }
    let blob = rmp_serde::to_vec_named(&Blob {
        sequences: vec![serde_bytes::Bytes::new(&[1, 2, 3])],
        k: 2,
    })
    .unwrap();
    let r = send("/topk_logits", Some(codec::MSGPACK), blob, Some(KEY)).await;
    expect_error(r, 400, "malformed_body", None).await;
}
