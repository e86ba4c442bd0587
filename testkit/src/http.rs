//! An async HTTP client for a running teacher: `/topk_logits` in JSON or MessagePack, and
//! `/v1/info`.

use crate::TeacherProcess;
use std::time::Duration;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{InfoResponse, TopkRequest, TopkResponse, ValuesKind};

/// A client with a 60 s timeout that drops idle connections after 5 s, before the teacher
/// does (its keep-alive idle timeout is `--header-timeout-secs`, 10 s by default): a pooled
/// connection the server closes just as a request is sent on it fails with `IncompleteMessage`
/// (seen under load, when a test computes its reference for longer than 10 s between two
/// requests). The trainer's client does the same (`trainer/src/client/mod.rs`).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("client")
}

/// The teacher's `GET /v1/info`.
pub async fn info(c: &reqwest::Client, t: &TeacherProcess) -> InfoResponse {
    c.get(t.url("/v1/info"))
        .send()
        .await
        .expect("GET /v1/info")
        .json()
        .await
        .expect("an info body")
}

/// A `/topk_logits` request for `sequences` (temperature 1, log-probs, from position 0).
pub fn request(sequences: Vec<Vec<u32>>, k: usize) -> TopkRequest {
    TopkRequest {
        sequences,
        k,
        temperature: 1.0,
        start: 0,
        starts: None,
        values: ValuesKind::Logprobs,
        ids: None,
    }
}

/// POSTs `req` in JSON (or msgpack), asks for `format`, decodes the answer.
pub async fn score(
    c: &reqwest::Client,
    t: &TeacherProcess,
    req: &TopkRequest,
    format: Format,
) -> TopkResponse {
    let (status, body) = post(c, t, req, format).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    codec::decode_response(format, &body).expect("decode response")
}

/// POSTs `req` to `/topk_logits` in `format`; the status and the raw body.
pub async fn post(
    c: &reqwest::Client,
    t: &TeacherProcess,
    req: &TopkRequest,
    format: Format,
) -> (u16, Vec<u8>) {
    let body = codec::encode_request(format, req).expect("encode");
    let r = c
        .post(t.url("/topk_logits"))
        .header("content-type", format.content_type())
        .header("accept", format.content_type())
        .body(body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    (status, r.bytes().await.expect("body").to_vec())
}
