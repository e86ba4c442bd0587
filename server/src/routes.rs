//! HTTP routes: content negotiation, body limit, auth, and the native `/topk_logits` face of the
//! engine (decode → validate → [`engine::score`] → encode). The vLLM- and SGLang-compatible faces
//! of the same engine are in [`crate::compat`].

use crate::body::{error_response, read_body, require_map, Outcome};
use crate::compat;
use crate::engine;
use crate::error::ApiError;
pub use crate::state::{AppState, BodyPace, Ready, ServerConfig};
use crate::validation::validate;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;
use std::time::Instant;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{
    HiddenResponse, HiddenStates, InfoWithFullVocab, TopkResponse, HEAD_FINGERPRINT_HEADER,
    HEAD_PATH, HIDDEN_PATH, PROBE_HEADER, TOPK_PATH,
};

type Shared = Arc<AppState>;

/// The router with every route and middleware.
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/info", get(info))
        .route("/tokenizer.json", get(tokenizer))
        .route("/metrics", get(metrics))
        .route(TOPK_PATH, post(topk))
        .route(HIDDEN_PATH, post(hidden))
        .route(HEAD_PATH, get(head))
        .merge(compat::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn(framing))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Counts every request by route and outcome.
async fn count(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let path = req.uri().path().to_string();
    let route = match path.as_str() {
        "/health" | "/v1/info" | "/tokenizer.json" | "/metrics" | TOPK_PATH | HIDDEN_PATH
        | HEAD_PATH => path,
        p if compat::ROUTES.contains(&p) => path,
        _ => "other".into(),
    };
    let resp = next.run(req).await;
    let outcome = match resp.extensions().get::<Outcome>() {
        Some(o) => o.0,
        None if resp.status().is_success() => "ok",
        None => "error",
    };
    st.metrics
        .record_request(&route, outcome, t0.elapsed().as_secs_f64());
    resp
}

/// HTTP/1.1 framing rules that hyper leaves to the server (RFC 9112), checked before anything
/// else: an HTTP/1.1 request needs `Host` (§3.2: 400); `Transfer-Encoding` may only be a lone
/// final `chunked` — another coding is not implemented (§6.1: 501), `chunked` twice is a 400.
/// (A coding list that does not end in `chunked` never gets here: hyper answers it with 400.)
async fn framing(req: Request, next: Next) -> Response {
    match check_framing(req.version(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => error_response(e),
    }
}

fn check_framing(version: axum::http::Version, headers: &HeaderMap) -> Result<(), ApiError> {
    if version == axum::http::Version::HTTP_11 && !headers.contains_key(header::HOST) {
        return Err(ApiError::BadFraming(
            "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)".into(),
        ));
    }
    let mut chunked = 0;
    for v in headers.get_all(header::TRANSFER_ENCODING) {
        let v = String::from_utf8_lossy(v.as_bytes());
        for coding in v.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if coding.eq_ignore_ascii_case("chunked") {
                chunked += 1;
            } else {
                return Err(ApiError::TransferCodingNotImplemented(coding.to_string()));
            }
        }
    }
    if chunked > 1 {
        return Err(ApiError::BadFraming(
            "Transfer-Encoding applies chunked more than once (RFC 9112 §6.1)".into(),
        ));
    }
    Ok(())
}

/// Constant-time comparison, so the key cannot be guessed byte by byte from timings.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token of an `Authorization: Bearer TOKEN` header; the scheme is case-insensitive
/// (RFC 7235).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// With `--api-key`, every route but `/health` needs `Authorization: Bearer KEY`.
async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.config.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(bearer_token);
            if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
                return error_response(ApiError::Unauthorized);
            }
        }
    }
    next.run(req).await
}

async fn not_found(req: Request) -> Response {
    error_response(ApiError::NotFound(req.uri().path().to_string()))
}

async fn method_not_allowed() -> Response {
    error_response(ApiError::MethodNotAllowed)
}

/// 200 once the model is loaded and while its worker thread runs; 503 with the reason while
/// loading (`not_ready`) and after the worker has ended (`worker_stopped`).
async fn health(State(st): State<Shared>) -> Response {
    if st.batcher.worker_stopped() {
        return error_response(ApiError::WorkerStopped);
    }
    match st.ready() {
        Ok(_) => (
            StatusCode::OK,
            axum::Json(serde_json::json!({"status": "ok"})),
        )
            .into_response(),
        Err(e) => error_response(e),
    }
}

async fn info(State(st): State<Shared>) -> Response {
    match st.ready() {
        Ok(r) => axum::Json(InfoWithFullVocab {
            info: r.info.clone(),
            full_vocab: r.full_vocab.clone(),
        })
        .into_response(),
        Err(e) => error_response(e),
    }
}

async fn tokenizer(State(st): State<Shared>) -> Response {
    match st.ready() {
        Ok(r) => (
            [(header::CONTENT_TYPE, HeaderValue::from_static(codec::JSON))],
            r.facts.tokenizer_json.clone(),
        )
            .into_response(),
        Err(e) => error_response(e),
    }
}

async fn metrics(State(st): State<Shared>) -> Response {
    let text = st.metrics.render(st.cache.usage());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// Format of the request body: JSON when no Content-Type is given.
fn body_format(headers: &HeaderMap) -> Result<Format, ApiError> {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else {
        return Ok(Format::Json);
    };
    let ct = ct.to_str().unwrap_or("");
    let mime = ct.split(';').next().unwrap_or("").trim();
    match Format::from_content_type(Some(ct)) {
        Format::Msgpack => Ok(Format::Msgpack),
        Format::Json if mime.eq_ignore_ascii_case(codec::JSON) || mime.is_empty() => {
            Ok(Format::Json)
        }
        Format::Json => Err(ApiError::UnsupportedMediaType(mime.to_string())),
    }
}

async fn topk(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match score(&st, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(e),
    }
}

/// The `/topk_logits` face: MessagePack or JSON in and out.
async fn score(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let ready = st.ready()?;
    let in_format = body_format(headers)?;
    let out_format = Format::from_accept(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    let bytes = read_body(st, headers, body).await?;
    require_map(in_format, &bytes)?;
    let req =
        codec::decode_request(in_format, &bytes).map_err(|e| ApiError::Malformed(e.to_string()))?;
    let with_ids = req.ids.is_some();
    let valid = validate(req, &ready.limits)?;
    let json = out_format == Format::Json;
    crate::validation::check_answer_size(
        valid.native_answer_bytes(json),
        if json { "of JSON" } else { "of MessagePack" },
        "sequences",
        &ready.limits,
    )?;
    let results = engine::score(st, &valid).await?;
    let p = valid.params;
    // Encode off the async threads (large answers take milliseconds).
    let model = ready.facts.fingerprint.clone();
    let body = crate::encode::off_thread(&st.metrics, move || {
        let resp = TopkResponse {
            k: p.k,
            values: p.values,
            temperature: p.temperature,
            model,
            with_ids,
            results: results.iter().map(|r| (**r).clone()).collect(),
        };
        codec::encode_response(out_format, &resp)
    })
    .await?;
    Ok(with_probe(
        ready,
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(out_format.content_type()),
            )],
            body,
        )
            .into_response(),
    ))
}

/// `resp` with this replica's probe hash as [`PROBE_HEADER`] (when it has a probe), so a client
/// behind a load balancer sees which replica's numbers it got.
fn with_probe(ready: &Ready, mut resp: Response) -> Response {
    let value = ready
        .info
        .probe
        .as_ref()
        .map(|p| HeaderValue::from_str(&p.hash));
    if let Some(Ok(v)) = value {
        resp.headers_mut()
            .insert(header::HeaderName::from_static(PROBE_HEADER), v);
    }
    resp
}

async fn hidden(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    match hidden_states(&st, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(e),
    }
}

/// The served head, or why there is none.
fn served_head(ready: &Ready) -> Result<Arc<crate::head_file::HeadServe>, ApiError> {
    ready.facts.head.clone().ok_or_else(|| {
        ApiError::NoHead(format!(
            "the LM head of {} ({}) cannot be served (the server log says why)",
            ready.facts.architecture, ready.facts.dtype
        ))
    })
}

/// `POST /hidden_states`: JSON or MessagePack in, MessagePack out (the states are blobs in the
/// model's dtype). The same validation, limits, admission, batching and cache as
/// `/topk_logits`: the request becomes a [`crate::request::ValidTopkRequest`] whose
/// parameters ask for hidden states.
async fn hidden_states(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let ready = st.ready()?;
    let head = served_head(ready)?;
    let in_format = body_format(headers)?;
    let bytes = read_body(st, headers, body).await?;
    require_map(in_format, &bytes)?;
    let req = codec::decode_hidden_request(in_format, &bytes)
        .map_err(|e| ApiError::Malformed(e.to_string()))?;
    let valid = crate::validation::validate_hidden(req, &ready.limits)?;
    let row_bytes = head.meta.hidden_size * head.meta.dtype.size();
    crate::validation::check_answer_size(
        codec::hidden_response_bytes(valid.sequences.iter().map(|s| s.rows()), row_bytes),
        "of MessagePack hidden states",
        "sequences",
        &ready.limits,
    )?;
    let results = engine::score(st, &valid).await?;
    let resp = HiddenResponse {
        model: ready.facts.fingerprint.clone(),
        head_fingerprint: head.fingerprint.clone(),
        dtype: head.meta.dtype,
        hidden_size: head.meta.hidden_size,
        results: Vec::new(),
    };
    let body = crate::encode::off_thread(&st.metrics, move || {
        let resp = HiddenResponse {
            results: results
                .iter()
                .map(|r| HiddenStates {
                    rows: r.rows,
                    data: r.hidden.clone(),
                })
                .collect(),
            ..resp
        };
        codec::encode_hidden_response(&resp)
    })
    .await?;
    let resp = (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(codec::MSGPACK),
            ),
            (
                header::HeaderName::from_static(HEAD_FINGERPRINT_HEADER),
                HeaderValue::from_str(&head.fingerprint)
                    .map_err(|e| ApiError::Internal(e.to_string()))?,
            ),
        ],
        body,
    );
    Ok(with_probe(ready, resp.into_response()))
}

async fn head(State(st): State<Shared>, headers: HeaderMap) -> Response {
    match head_file(&st, &headers) {
        Ok(r) => r,
        Err(e) => error_response(e),
    }
}

/// `GET /v1/head`: the head file (safetensors), streamed a piece at a time from the model's own
/// tensor as the client takes it ([`crate::head_file::PIECE_BYTES`]: a download holds well under a
/// MiB, however slow its client), with its fingerprint as `ETag` and
/// `X-Xdistill-Head-Fingerprint`. A whole-file answer is hashed again as it goes and its last
/// piece only sent once the hash matches. `If-None-Match` naming the fingerprint (weakly or
/// not): 304. One byte `Range` (with `If-Range`): 206, or 416 past the end.
fn head_file(st: &AppState, headers: &HeaderMap) -> Result<Response, ApiError> {
    use crate::head_file::{head_answer, HeadAnswer};
    let ready = st.ready()?;
    let head = served_head(ready)?;
    let etag = format!("\"{}\"", head.fingerprint);
    let fp =
        HeaderValue::from_str(&head.fingerprint).map_err(|e| ApiError::Internal(e.to_string()))?;
    let etag_value = HeaderValue::from_str(&etag).map_err(|e| ApiError::Internal(e.to_string()))?;
    let fp_name = header::HeaderName::from_static(HEAD_FINGERPRINT_HEADER);
    let texts = |name| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect::<Vec<_>>()
    };
    let if_range = headers.get(header::IF_RANGE).and_then(|v| v.to_str().ok());
    let answer = head_answer(
        texts(header::IF_NONE_MATCH),
        &texts(header::RANGE),
        if_range,
        &etag,
        head.len,
    );
    let len = head.len;
    let (status, range) = match answer {
        HeadAnswer::NotModified => {
            let mut r = StatusCode::NOT_MODIFIED.into_response();
            r.headers_mut().insert(header::ETAG, etag_value);
            r.headers_mut().insert(fp_name, fp);
            return Ok(r);
        }
        HeadAnswer::Unsatisfiable(range) => {
            return Err(ApiError::RangeNotSatisfiable { range, len });
        }
        HeadAnswer::Whole => (StatusCode::OK, 0..len),
        HeadAnswer::Part(r) => (StatusCode::PARTIAL_CONTENT, r),
    };
    let body_len = range.end - range.start;
    let content_range = format!(
        "bytes {}-{}/{len}",
        range.start,
        range.end.saturating_sub(1)
    );
    let mut r = Body::from_stream(head.stream(range)).into_response();
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(body_len));
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if status == StatusCode::PARTIAL_CONTENT {
        h.insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&content_range).map_err(|e| ApiError::Internal(e.to_string()))?,
        );
    }
    h.insert(header::ETAG, etag_value);
    h.insert(fp_name, fp);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batcher::{Batch, BatchConfig, Batcher};
    use crate::cache::ScoreCache;
    use crate::metrics::Metrics;
    use crate::worker::{self, WorkerConfig};
    use std::path::Path;
    use std::sync::OnceLock;
    use std::time::Duration;
    use tokio::sync::{mpsc, oneshot};
    use tower::ServiceExt;

    /// Server state whose batcher hands batches to `worker`.
    fn state(worker: mpsc::Sender<Batch>) -> Shared {
        let metrics = Arc::new(Metrics::default());
        let batcher = Batcher::start(
            BatchConfig {
                max_batch_tokens: 64,
                max_wait: Duration::from_millis(1),
                max_queue_tokens: 1024,
            },
            worker,
            metrics.clone(),
        );
        Arc::new(AppState {
            config: ServerConfig {
                max_k: 8,
                max_seq_len: None,
                max_batch_tokens: 64,
                max_queue_tokens: 1024,
                max_sequences: 8,
                max_answer_bytes: 1 << 20,
                max_body_bytes: 1 << 20,
                max_wait_ms: 1,
                body_timeout: Duration::from_secs(5),
                body_pace: BodyPace::NONE,
                api_key: None,
                batch_invariant: false,
                served_model_name: "m".into(),
            },
            ready: OnceLock::new(),
            batcher,
            cache: ScoreCache::new(0),
            metrics,
        })
    }

    /// Status and JSON body of `req` through the router.
    async fn call(st: &Shared, mut req: Request) -> (u16, serde_json::Value) {
        // An HTTP/1.1 request needs a Host (the framing layer refuses it otherwise).
        req.headers_mut()
            .insert(header::HOST, HeaderValue::from_static("test"));
        let r = router(st.clone()).oneshot(req).await.unwrap();
        let status = r.status().as_u16();
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    async fn health(st: &Shared) -> (u16, serde_json::Value) {
        let req = Request::get("/health").body(Body::empty()).unwrap();
        call(st, req).await
    }

    fn worker_config(model: &Path) -> WorkerConfig {
        WorkerConfig {
            model: model.to_path_buf(),
            device: "cpu".into(),
            dtype: "f32".into(),
            max_batch_tokens: 64,
            topk: Default::default(),
            lm_head: Default::default(),
            batch_invariant: false,
            packed_rows: None,
            gguf_weights: Default::default(),
        }
    }

    /// The real worker thread on a model it cannot load: it reports the error and ends, and
    /// `/health` then says the worker has stopped (not that the model is loading).
    #[tokio::test]
    async fn health_is_503_once_the_worker_thread_has_ended() {
        let (tx, rx) = mpsc::channel(1);
        let st = state(tx);
        let (status, body) = health(&st).await;
        assert_eq!(
            (status, body["error"]["type"].as_str()),
            (503, Some("not_ready"))
        );
        let (ready_tx, ready_rx) = oneshot::channel();
        let dir = tempfile::tempdir().unwrap();
        let thread = worker::spawn(
            worker_config(&dir.path().join("no-model")),
            st.metrics.clone(),
            rx,
            ready_tx,
        )
        .unwrap();
        assert!(ready_rx.await.unwrap().is_err(), "the load must fail");
        thread.join().unwrap();
        let (status, body) = health(&st).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["type"], "worker_stopped", "{body}");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("model worker has stopped"), "{msg}");
    }

    /// A loaded model: 200 while its worker thread holds its queue; once that thread has ended,
    /// `/health` and scoring requests are refused with 503 `worker_stopped`.
    #[tokio::test]
    async fn health_follows_the_worker_after_loading() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        xdistill_shared::init::init_model_dir(&xdistill_shared::init::InitSpec {
            arch: "llama".into(),
            tokenizer: xdistill_testkit::tokenizer_json("llama2"),
            hidden_size: 16,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            intermediate_size: 32,
            head_dim: None,
            pad_vocab_to: 1,
            max_position_embeddings: 64,
            tie_embeddings: true,
            init_std: 0.02,
            seed: 1,
            out: model.clone(),
            features: Default::default(),
        })
        .unwrap();
        let md = xdistill_shared::hf::ModelDir::open(&model).unwrap();
        let facts =
            crate::model::read_facts(&md, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        let (tx, rx) = mpsc::channel(1);
        let st = state(tx);
        st.set_ready(facts).unwrap();
        // In place of the worker thread: holds the queue's receiver until told to end.
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let _queue = rx;
            let _ = end_rx.recv();
        });
        let (status, body) = health(&st).await;
        assert_eq!((status, &body), (200, &serde_json::json!({"status": "ok"})));
        end_tx.send(()).unwrap();
        thread.join().unwrap();
        let (status, body) = health(&st).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["type"], "worker_stopped", "{body}");
        let topk = Request::post(TOPK_PATH)
            .header(header::CONTENT_TYPE, codec::JSON)
            .body(Body::from(r#"{"sequences": [[1, 2, 3]], "k": 2}"#))
            .unwrap();
        let (status, body) = call(&st, topk).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["type"], "worker_stopped", "{body}");
    }

    #[test]
    fn framing_rules() {
        use axum::http::Version;
        let h = |pairs: &[(&str, &str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.append(
                    axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            m
        };
        let label = |v, m: &HeaderMap| check_framing(v, m).err().map(|e| e.label());
        assert_eq!(label(Version::HTTP_11, &h(&[("host", "x")])), None);
        assert_eq!(label(Version::HTTP_11, &h(&[])), Some("bad_framing"));
        assert_eq!(label(Version::HTTP_10, &h(&[])), None);
        let te = |v: &str| {
            label(
                Version::HTTP_11,
                &h(&[("host", "x"), ("transfer-encoding", v)]),
            )
        };
        assert_eq!(te("chunked"), None);
        assert_eq!(te("Chunked"), None);
        assert_eq!(
            te("identity, chunked"),
            Some("transfer_coding_not_implemented")
        );
        assert_eq!(te("gzip, chunked"), Some("transfer_coding_not_implemented"));
        assert_eq!(te("chunked, chunked"), Some("bad_framing"));
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for h in ["Bearer k1", "bearer k1", "BEARER  k1 ", " Bearer k1"] {
            assert_eq!(bearer_token(h), Some("k1"), "{h:?}");
        }
        assert_eq!(bearer_token("Basic k1"), None);
        assert_eq!(bearer_token("Bearerk1"), None);
        assert_eq!(bearer_token("k1"), None);
    }
}
