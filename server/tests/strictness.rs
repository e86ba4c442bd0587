//! Strict where the protocol is strict (issue 33, item 6), each case against a real `teacher`
//! on loopback with its exact status and JSON body: named maps only (empty and `null` bodies
//! named as such), JSON bodies on the answers
//! hyper writes itself (400, 414, 431), 415 for content encodings, RFC 9112 on
//! `Transfer-Encoding` and `Host`, `max_model_len` counted with `max_tokens`, compatible-route
//! errors naming their own fields, and `messages` refused with or without a prompt.

use crate::common;

use crate::common::Teacher;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::Duration;

/// One shared teacher (tiny Qwen3 with its tokenizer, which adds no BOS, 64-token context).
fn teacher() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| {
        let dir = common::tiny_model("strict-qwen3", "qwen3", "qwen3", 1);
        common::start_teacher(&dir, &["--max-seq-len", "64"])
    })
}

/// Sends `raw` bytes on a new connection; the status, the head and the JSON body of the answer.
fn raw(request: &[u8]) -> (u16, String, Value) {
    let addr = teacher().base.trim_start_matches("http://").to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    // Read the head, then exactly content-length bytes (keep-alive answers do not close).
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&out);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(usize::MAX);
            if body.len() >= len {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text:?}"));
    let v = serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {text:?}"));
    (status, head.to_ascii_lowercase(), v)
}

/// A POST with `headers` (each `Name: value`) and `body`.
fn post_raw(path: &str, headers: &[&str], body: &[u8]) -> (u16, String, Value) {
    let mut req = format!("POST {path} HTTP/1.1\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    raw(&bytes)
}

fn assert_error(got: &(u16, String, Value), status: u16, kind: &str, param: Option<&str>) {
    let (s, head, body) = got;
    assert_eq!(*s, status, "{head}\n{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert_eq!(body["error"]["code"], status, "{body}");
    assert_eq!(body["error"]["param"].as_str(), param, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
}

async fn post(path: &str, body: Value) -> (u16, String, Value) {
    let bytes = serde_json::to_vec(&body).unwrap();
    let len = format!("Content-Length: {}", bytes.len());
    let path = path.to_string();
    tokio::task::spawn_blocking(move || {
        post_raw(
            &path,
            &[
                "Host: x",
                "Content-Type: application/json",
                &len,
                "Connection: close",
            ],
            &bytes,
        )
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn positional_arrays_are_refused() {
    // JSON: `[[[1,2,3]],2]` would be (sequences, k) in order.
    let got = post("/topk_logits", json!([[[1, 2, 3]], 2])).await;
    assert_error(&got, 400, "malformed_body", None);
    assert!(got.2["error"]["message"]
        .as_str()
        .unwrap()
        .contains("positional"));
    // MessagePack: a fixarray of the same.
    let msgpack = rmp_serde::to_vec(&(vec![vec![1u32, 2, 3]], 2u32)).unwrap();
    let len = format!("Content-Length: {}", msgpack.len());
    let got = tokio::task::spawn_blocking(move || {
        post_raw(
            "/topk_logits",
            &[
                "Host: x",
                "Content-Type: application/msgpack",
                &len,
                "Connection: close",
            ],
            &msgpack,
        )
    })
    .await
    .unwrap();
    assert_error(&got, 400, "malformed_body", None);
    // The compatible routes too.
    let got = post("/v1/completions", json!([[1, 2, 3], 1])).await;
    assert_error(&got, 400, "malformed_body", None);
    // A named map is served.
    let ok = post("/topk_logits", json!({"sequences": [[1, 2, 3]], "k": 2})).await;
    assert_eq!(ok.0, 200, "{}", ok.2);
}

/// An empty body, or a `null` (MessagePack nil) one, is named as such on every scoring route
/// (it used to be told that "positional arrays are not accepted").
#[tokio::test]
async fn empty_and_null_bodies_are_named() {
    let cases: [(&str, &[u8], &str); 4] = [
        ("application/json", b"", "the request body is empty"),
        ("application/json", b" \r\n ", "the request body is empty"),
        (
            "application/json",
            b" null ",
            "the request body is JSON null",
        ),
        (
            "application/msgpack",
            &[0xc0],
            "the request body is MessagePack nil",
        ),
    ];
    for path in [
        "/topk_logits",
        "/hidden_states",
        "/v1/completions",
        "/tokenize",
        "/generate",
    ] {
        for (ct, body, needle) in cases {
            // The compatible routes take JSON only.
            if path != "/topk_logits" && path != "/hidden_states" && ct != "application/json" {
                continue;
            }
            let (p, body) = (path.to_string(), body.to_vec());
            let got = tokio::task::spawn_blocking(move || {
                let ct = format!("Content-Type: {ct}");
                let len = format!("Content-Length: {}", body.len());
                post_raw(&p, &["Host: x", &ct, &len, "Connection: close"], &body)
            })
            .await
            .unwrap();
            assert_error(&got, 400, "malformed_body", None);
            let msg = got.2["error"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{path} {ct}: {msg}");
            assert!(!msg.contains("positional"), "{path} {ct}: {msg}");
        }
    }
}

#[tokio::test]
async fn answers_hyper_writes_have_json_bodies() {
    let got = tokio::task::spawn_blocking(|| {
        // 431: more headers than hyper takes (100).
        let mut many = String::from("GET /health HTTP/1.1\r\nHost: x\r\n");
        for i in 0..200 {
            many.push_str(&format!("X-Filler-{i}: {i}\r\n"));
        }
        many.push_str("\r\n");
        let h431 = raw(many.as_bytes());
        // 414: a request target longer than hyper takes.
        let long = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
        let h414 = raw(long.as_bytes());
        // 400: no request line at all.
        let h400 = raw(b"NOT HTTP AT ALL\r\n\r\n");
        (h431, h414, h400)
    })
    .await
    .unwrap();
    assert_error(&got.0, 431, "headers_too_large", None);
    assert_error(&got.1, 414, "uri_too_long", None);
    assert_error(&got.2, 400, "malformed_request", None);
    for g in [&got.0, &got.1, &got.2] {
        assert!(g.1.contains("connection: close"), "{}", g.1);
    }
}

#[tokio::test]
async fn content_encodings_are_refused_with_415() {
    let body = br#"{"sequences": [[1, 2, 3]], "k": 2}"#.to_vec();
    let len = format!("Content-Length: {}", body.len());
    let got = tokio::task::spawn_blocking(move || {
        post_raw(
            "/topk_logits",
            &[
                "Host: x",
                "Content-Type: application/json",
                "Content-Encoding: gzip",
                &len,
                "Connection: close",
            ],
            &body,
        )
    })
    .await
    .unwrap();
    assert_error(&got, 415, "unsupported_encoding", None);
    assert!(got.1.contains("accept-encoding: identity"), "{}", got.1);
    assert!(got.2["error"]["message"]
        .as_str()
        .unwrap()
        .contains("\"gzip\""));
}

#[tokio::test]
async fn transfer_encoding_follows_rfc_9112() {
    let body = br#"{"sequences": [[1, 2, 3]], "k": 2}"#;
    let chunked = |te: &str| {
        let mut req = format!(
            "POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: {te}\r\n\r\n{:x}\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        req.extend_from_slice(b"\r\n0\r\n\r\n");
        req
    };
    let (a, b, c, d) = tokio::task::spawn_blocking(move || {
        (
            raw(&chunked("identity, chunked")),
            raw(&chunked("gzip, chunked")),
            raw(&chunked("chunked, chunked")),
            raw(&chunked("chunked")),
        )
    })
    .await
    .unwrap();
    // An unknown coding: 501, and the connection is closed (its framing is not trusted).
    assert_error(&a, 501, "transfer_coding_not_implemented", None);
    assert!(a.1.contains("connection: close"), "{}", a.1);
    assert!(a.2["error"]["message"]
        .as_str()
        .unwrap()
        .contains("identity"));
    assert_error(&b, 501, "transfer_coding_not_implemented", None);
    assert_error(&c, 400, "bad_framing", None);
    assert!(c.1.contains("connection: close"), "{}", c.1);
    // A lone final chunked is served.
    assert_eq!(d.0, 200, "{}", d.2);
    // A coding list not ending in chunked: hyper's 400, with a JSON body.
    let e = tokio::task::spawn_blocking(|| {
        raw(b"POST /topk_logits HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n")
    })
    .await
    .unwrap();
    assert_error(&e, 400, "malformed_request", None);
}

#[tokio::test]
async fn http_11_requests_need_a_host() {
    let (no_host, http10) = tokio::task::spawn_blocking(|| {
        (
            raw(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"),
            raw(b"GET /health HTTP/1.0\r\n\r\n"),
        )
    })
    .await
    .unwrap();
    assert_error(&no_host, 400, "bad_framing", None);
    assert!(no_host.2["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Host"));
    // HTTP/1.0 has no Host requirement (load balancers' health checks send none).
    assert_eq!(http10.0, 200, "{}", http10.2);
}

#[tokio::test]
async fn max_model_len_counts_max_tokens() {
    // 64 tokens fill the context: scoring them alone is fine, one more token is vLLM's 400.
    let prompt: Vec<u32> = (1..=64).collect();
    let got = post(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1}),
    )
    .await;
    assert_error(&got, 400, "unsupported_request", Some("prompt"));
    let msg = got.2["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("maximum context length is 64 tokens")
            && msg.contains("you requested 65 tokens (64 in the messages, 1 in the completion)"),
        "{msg}"
    );
    let ok = post(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 1}),
    )
    .await;
    assert_eq!(ok.0, 200, "{}", ok.2);
}

#[tokio::test]
async fn compatible_routes_name_their_own_fields() {
    // An empty text on /generate names `text`, not `input_ids`.
    let got = post("/generate", json!({"text": ""})).await;
    assert_error(&got, 422, "invalid_request", Some("text"));
    let got = post("/generate", json!({"text": ["a b", ""]})).await;
    assert_error(&got, 422, "invalid_request", Some("text[1]"));
    // Too many prompts names `prompt` (the native route's field is `sequences`).
    let many: Vec<Vec<u32>> = vec![vec![1, 2]; 16_385];
    let got = post("/v1/completions", json!({"prompt": many, "max_tokens": 0})).await;
    assert_error(&got, 413, "too_many_sequences", Some("prompt"));
    // An over-long prompt names its index in the route's field.
    let long: Vec<u32> = vec![5; 65];
    let got = post("/generate", json!({"input_ids": [[1, 2], long]})).await;
    assert_error(&got, 422, "invalid_request", Some("input_ids[1]"));
    // A top_logprobs_num of 2^64 - 1 is a k over max-k (it once overflowed the answer's
    // estimate, a panic in a debug build).
    let got = post(
        "/generate",
        json!({"input_ids": [1, 2, 3], "return_logprob": true,
               "top_logprobs_num": u64::MAX}),
    )
    .await;
    assert_error(&got, 422, "invalid_request", Some("top_logprobs_num"));
    // Too many tokens for the queue names the route's field too.
    let got = post(
        "/topk_logits",
        json!({"sequences": vec![vec![1u32; 64]; 5000], "k": 1}),
    )
    .await;
    assert_error(&got, 413, "request_too_large", Some("sequences"));
}

#[tokio::test]
async fn messages_are_refused_with_or_without_a_prompt() {
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/tokenize",
            json!({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
    ] {
        let got = post(path, body).await;
        assert_error(&got, 400, "unsupported_request", Some("messages"));
    }
}
