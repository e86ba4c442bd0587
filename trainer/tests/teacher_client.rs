//! The teacher client against small mock servers on 127.0.0.1: retries and `Retry-After`,
//! round-robin, fail-over, 4xx surfacing, waiting for a late teacher, MessagePack on the wire,
//! the tokenizer cache, and the teacher pool feeding a prefetcher.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use reqwest::Url;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{
    InfoResponse, Limits, SequenceScores, TopkRequest, TopkResponse, ValuesKind,
};
use xdistill_trainer::client::{
    check_replicas, ClientError, ClientOptions, Prefetcher, TeacherClient, TeacherPool,
    TeacherTokenizer,
};

/// Behaviour and counters of one mock teacher.
#[derive(Default)]
struct Mock {
    /// Answer 503 to this many `/topk_logits` requests before succeeding.
    fail_first: usize,
    retry_after: Option<&'static str>,
    /// Answer 400 with an error body.
    reject: bool,
    /// Answer with one row too many.
    bad_rows: bool,
    /// Require `Authorization: Bearer <key>`.
    api_key: Option<String>,
    /// Advertise this tokenizer hash instead of the real one.
    wrong_sha: bool,
    /// Advertise this `tokenizer_sha256` verbatim (not a hash at all).
    sha_text: Option<String>,
    topk_hits: AtomicUsize,
    tokenizer_hits: AtomicUsize,
    head_hits: AtomicUsize,
    /// `/hidden_states` answers say they go with this head.
    hidden_head: Option<&'static str>,
    last_request: Mutex<Option<TopkRequest>>,
}

const TOKENIZER: &[u8] = b"{\"model\": {\"type\": \"mock\"}}";

/// The mock's scores for a request: a deterministic function of the token ids, so the test can
/// compute what the client must return.
fn fake_scores(req: &TopkRequest) -> TopkResponse {
    let results = req
        .sequences
        .iter()
        .enumerate()
        .map(|(i, seq)| {
            let start = req.start_of(i);
            let rows = seq.len().saturating_sub(1 + start);
            let mut s = SequenceScores {
                rows,
                k: req.k,
                ..Default::default()
            };
            for r in 0..rows {
                for j in 0..req.k {
                    s.topk_ids.push((seq[start + r] * 7 + j as u32) % 1000);
                    s.topk_values.push(-(j as f32) - 0.25 * r as f32);
                }
                s.target_logprobs.push(-(seq[start + r + 1] as f32) / 100.0);
                s.logsumexp.push(r as f32 * 1.5);
            }
            s
        })
        .collect();
    TopkResponse {
        k: req.k,
        values: req.values,
        temperature: req.temperature,
        model: "mock-model".into(),
        with_ids: false,
        results,
    }
}

fn request() -> TopkRequest {
    TopkRequest {
        sequences: vec![vec![3, 1, 4, 1, 5], vec![9, 2, 6]],
        k: 3,
        temperature: 0.5,
        start: 1,
        starts: None,
        values: ValuesKind::Logprobs,
        ids: None,
    }
}

fn error(status: StatusCode, kind: &str, msg: &str, field: Option<&str>) -> Response {
    let body = serde_json::json!({"error": {"type": kind, "message": msg, "field": field}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn authorized(m: &Mock, headers: &HeaderMap) -> bool {
    match &m.api_key {
        None => true,
        Some(k) => {
            headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                == Some(&format!("Bearer {k}"))
        }
    }
}

async fn topk(State(m): State<Arc<Mock>>, headers: HeaderMap, body: Bytes) -> Response {
    let n = m.topk_hits.fetch_add(1, Ordering::SeqCst);
    if !authorized(&m, &headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "bad API key",
            None,
        );
    }
    let h = |name| headers.get(name).and_then(|v| v.to_str().ok());
    if h(header::CONTENT_TYPE) != Some(codec::MSGPACK) || h(header::ACCEPT) != Some(codec::MSGPACK)
    {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request",
            "not msgpack",
            None,
        );
    }
    if n < m.fail_first {
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "queue_full", "busy", None);
        if let Some(ra) = m.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, ra.parse().unwrap());
        }
        return r;
    }
    if m.reject {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "token id 999999 is out of range (vocab 1000)",
            Some("sequences[0][2]"),
        );
    }
    let req = match codec::decode_request(Format::Msgpack, &body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                &e.to_string(),
                None,
            )
        }
    };
    let mut resp = fake_scores(&req);
    *m.last_request.lock().unwrap() = Some(req);
    if m.bad_rows {
        let s = &mut resp.results[0];
        s.rows += 1;
        s.topk_ids.extend(vec![0; s.k]);
        s.topk_values.extend(vec![0.0; s.k]);
        s.target_logprobs.push(0.0);
        s.logsumexp.push(0.0);
    }
    let bytes = codec::encode_response(Format::Msgpack, &resp).unwrap();
    ([(header::CONTENT_TYPE, codec::MSGPACK)], bytes).into_response()
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

async fn info(State(m): State<Arc<Mock>>) -> Response {
    let sha = if let Some(text) = &m.sha_text {
        text.clone()
    } else if m.wrong_sha {
        "00".repeat(32)
    } else {
        sha256_hex(TOKENIZER)
    };
    axum::Json(mock_info(sha)).into_response()
}

fn mock_info(sha: String) -> InfoResponse {
    InfoResponse {
        protocol_version: 1,
        server_version: "mock".into(),
        architecture: "Qwen3ForCausalLM".into(),
        model_type: "qwen3".into(),
        vocab_size: 1000,
        logits_size: 1024,
        max_seq_len: 128,
        dtype: "f32".into(),
        device: "cpu".into(),
        tokenizer_sha256: sha,
        model_fingerprint: "mock-model".into(),
        limits: Limits {
            max_k: 64,
            max_seq_len: 128,
            max_batch_tokens: 4096,
            max_queue_tokens: 65536,
            max_body_bytes: 1 << 20,
            max_wait_ms: 5,
            max_sequences: 1024,
            max_answer_bytes: 1 << 30,
        },
        batch_invariant: true,
        weights: "safetensors".into(),
        rope_theta: 1e6,
        rope_scaling: "default".into(),
        sliding_window: None,
        sliding_layers: 0,
        host_simd: "baseline".into(),
        lm_head: "fused".into(),
        probe: None,
    }
}

async fn tokenizer(State(m): State<Arc<Mock>>) -> Response {
    m.tokenizer_hits.fetch_add(1, Ordering::SeqCst);
    TOKENIZER.into_response()
}

/// The head file the mock serves (any bytes: the client checks their hash, not their format).
const HEAD: &[u8] = b"a head file of the mock";

async fn head(State(m): State<Arc<Mock>>) -> Response {
    m.head_hits.fetch_add(1, Ordering::SeqCst);
    HEAD.into_response()
}

/// `/hidden_states`: H = 2 zeros per row, for the head `m.hidden_head` names.
async fn hidden(State(m): State<Arc<Mock>>, body: Bytes) -> Response {
    let req = codec::decode_hidden_request(Format::Msgpack, &body).unwrap();
    let resp = xdistill_shared::protocol::HiddenResponse {
        model: "mock-model".into(),
        head_fingerprint: m.hidden_head.unwrap_or("none").into(),
        dtype: xdistill_shared::protocol::WireDtype::F32,
        hidden_size: 2,
        results: (0..req.sequences.len())
            .map(|i| {
                let rows = req.sequences[i].len() - 1 - req.start_of(i);
                xdistill_shared::protocol::HiddenStates {
                    rows,
                    data: vec![0; rows * 2 * 4],
                }
            })
            .collect(),
    };
    (
        [(header::CONTENT_TYPE, codec::MSGPACK)],
        codec::encode_hidden_response(&resp).unwrap(),
    )
        .into_response()
}

fn full_vocab_info(fingerprint: &str, bytes: u64) -> xdistill_shared::protocol::FullVocabInfo {
    xdistill_shared::protocol::FullVocabInfo {
        hidden_route: "/hidden_states".into(),
        head_route: "/v1/head".into(),
        dtype: "f32".into(),
        hidden_size: 2,
        head_rows: 4,
        vocab_size: 4,
        tied: false,
        bias: false,
        logit_scale: 1.0,
        logit_softcap: None,
        head_fingerprint: fingerprint.into(),
        head_bytes: bytes,
    }
}

fn router(m: Arc<Mock>) -> Router {
    Router::new()
        .route("/topk_logits", post(topk))
        .route("/v1/info", get(info))
        .route("/tokenizer.json", get(tokenizer))
        .route("/v1/head", get(head))
        .route("/hidden_states", post(hidden))
        .route("/health", get(|| async { "ok" }))
        .with_state(m)
}

/// Serves `m` on `listener`.
async fn serve_on(listener: tokio::net::TcpListener, m: Arc<Mock>) {
    let _ = axum::serve(listener, router(m)).await;
}

/// Starts a mock on a free port; returns its base URL.
async fn start(m: Arc<Mock>) -> Url {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
    tokio::spawn(serve_on(listener, m));
    url
}

/// A URL on which nothing listens (a port that was free a moment ago).
fn dead_url() -> (Url, std::net::SocketAddr) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    (Url::parse(&format!("http://{addr}")).unwrap(), addr)
}

fn opts(initial_ms: u64, max_ms: u64, max_wait: Duration) -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
        max_wait,
        max_attempts: None,
        backoff_initial: Duration::from_millis(initial_ms),
        backoff_max: Duration::from_millis(max_ms),
        api_key: None,
    }
}

#[tokio::test]
async fn msgpack_round_trip_through_the_shared_codec() {
    let m = Arc::new(Mock::default());
    let url = start(m.clone()).await;
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap();
    let req = request();
    let resp = c.topk(&req).await.unwrap();
    // The server decoded exactly what we sent, and we decoded exactly what it computed.
    assert_eq!(m.last_request.lock().unwrap().as_ref(), Some(&req));
    assert_eq!(resp, fake_scores(&req));
    // 5 tokens from start 1: 3 rows; 3 tokens from 1: 1 row.
    assert_eq!(resp.results[0].rows, 3);
    assert_eq!(resp.results[1].rows, 1);
}

#[tokio::test]
async fn retries_503_and_honours_retry_after() {
    let m = Arc::new(Mock {
        fail_first: 2,
        retry_after: Some("1"),
        ..Default::default()
    });
    let url = start(m.clone()).await;
    // Backoff alone would retry after ≤ 20 ms; Retry-After asks for 1 s each time.
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(30))).unwrap();
    let t0 = Instant::now();
    let resp = c.topk(&request()).await.unwrap();
    assert_eq!(resp, fake_scores(&request()));
    assert_eq!(m.topk_hits.load(Ordering::SeqCst), 3);
    // A lower bound only (sleeps never end early): two waits of ≥ 1 s.
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        t0.elapsed()
    );
}

#[tokio::test]
async fn round_robin_over_replicas() {
    let (a, b) = (Arc::new(Mock::default()), Arc::new(Mock::default()));
    let urls = vec![start(a.clone()).await, start(b.clone()).await];
    let c = TeacherClient::new(urls, opts(10, 20, Duration::from_secs(5))).unwrap();
    for _ in 0..6 {
        c.topk(&request()).await.unwrap();
    }
    assert_eq!(a.topk_hits.load(Ordering::SeqCst), 3);
    assert_eq!(b.topk_hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_4xx_is_not_retried_and_its_message_surfaces() {
    let m = Arc::new(Mock {
        reject: true,
        ..Default::default()
    });
    let url = start(m.clone()).await;
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap();
    let err = c.topk(&request()).await.unwrap_err();
    match &err {
        ClientError::Rejected {
            status,
            kind,
            message,
            field,
            ..
        } => {
            assert_eq!(*status, 400);
            assert_eq!(kind, "invalid_request");
            assert!(message.contains("out of range"));
            assert_eq!(field.as_deref(), Some("sequences[0][2]"));
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert!(err.to_string().contains("sequences[0][2]"), "{err}");
    assert_eq!(m.topk_hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn connection_refused_moves_to_the_next_replica_at_once() {
    let m = Arc::new(Mock::default());
    let (dead, _) = dead_url();
    let live = start(m.clone()).await;
    // A 30 s backoff: only an immediate fail-over finishes well within it.
    let c = TeacherClient::new(
        vec![dead, live],
        opts(30_000, 30_000, Duration::from_secs(60)),
    )
    .unwrap();
    let t0 = Instant::now();
    for _ in 0..2 {
        assert_eq!(c.topk(&request()).await.unwrap(), fake_scores(&request()));
    }
    assert_eq!(m.topk_hits.load(Ordering::SeqCst), 2);
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn a_teacher_that_appears_late_is_waited_for() {
    // Health first, then a scoring request made while the teacher is down.
    for via_topk in [false, true] {
        let m = Arc::new(Mock::default());
        let (url, addr) = dead_url();
        let m2 = m.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let l = tokio::net::TcpListener::bind(addr).await.unwrap();
            serve_on(l, m2).await;
        });
        let c =
            TeacherClient::new(vec![url.clone()], opts(20, 100, Duration::from_secs(20))).unwrap();
        if via_topk {
            assert_eq!(c.topk(&request()).await.unwrap(), fake_scores(&request()));
            // The refused attempts never reached the server; the step was not lost.
            assert_eq!(m.topk_hits.load(Ordering::SeqCst), 1);
        } else {
            assert_eq!(c.wait_ready(Duration::from_secs(20)).await.unwrap(), url);
        }
    }
}

#[tokio::test]
async fn gives_up_after_max_wait_with_the_last_error() {
    let (dead, _) = dead_url();
    let c = TeacherClient::new(vec![dead], opts(20, 50, Duration::from_millis(300))).unwrap();
    match c.topk(&request()).await.unwrap_err() {
        ClientError::GaveUp { attempts, last, .. } => {
            assert!(attempts >= 2, "{attempts}");
            assert!(matches!(*last, ClientError::Transport { .. }), "{last:?}");
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    let mut o = opts(1, 1, Duration::from_secs(60));
    o.max_attempts = Some(3);
    let c = TeacherClient::new(vec![dead_url().0], o).unwrap();
    match c.topk(&request()).await.unwrap_err() {
        ClientError::GaveUp { attempts, .. } => assert_eq!(attempts, 3),
        other => panic!("expected GaveUp, got {other:?}"),
    }
}

#[tokio::test]
async fn api_key_is_sent_as_bearer_token() {
    let m = Arc::new(Mock {
        api_key: Some("s3cret".into()),
        ..Default::default()
    });
    let url = start(m.clone()).await;
    let c = TeacherClient::new(vec![url.clone()], opts(10, 20, Duration::from_secs(5))).unwrap();
    match c.topk(&request()).await.unwrap_err() {
        ClientError::Rejected { status: 401, .. } => {}
        other => panic!("expected 401, got {other:?}"),
    }
    let mut o = opts(10, 20, Duration::from_secs(5));
    o.api_key = Some("s3cret".into());
    let c = TeacherClient::new(vec![url], o).unwrap();
    c.topk(&request()).await.unwrap();
}

#[tokio::test]
async fn malformed_answers_and_model_changes_are_errors() {
    let m = Arc::new(Mock {
        bad_rows: true,
        ..Default::default()
    });
    let url = start(m.clone()).await;
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap();
    assert!(matches!(
        c.topk(&request()).await,
        Err(ClientError::InvalidResponse { .. })
    ));
    assert_eq!(m.topk_hits.load(Ordering::SeqCst), 1);

    let url = start(Arc::new(Mock::default())).await;
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap();
    c.pin_model("another-model");
    assert!(matches!(
        c.topk(&request()).await,
        Err(ClientError::ModelChanged { .. })
    ));
}

#[tokio::test]
async fn teacher_tokenizer_is_fetched_once_and_checked() {
    let m = Arc::new(Mock::default());
    let url = start(m.clone()).await;
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap();
    let info = c.info().await.unwrap();
    assert_eq!(info.model_fingerprint, "mock-model");
    let dir = tempfile::tempdir().unwrap();
    let p = c.fetch_tokenizer(dir.path(), &info).await.unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), TOKENIZER);
    assert_eq!(
        p,
        dir.path()
            .join(sha256_hex(TOKENIZER))
            .join("tokenizer.json")
    );
    let again = c.fetch_tokenizer(dir.path(), &info).await.unwrap();
    assert_eq!(again, p);
    assert_eq!(
        m.tokenizer_hits.load(Ordering::SeqCst),
        1,
        "second call hits the cache"
    );

    let bad = Arc::new(Mock {
        wrong_sha: true,
        ..Default::default()
    });
    let c =
        TeacherClient::new(vec![start(bad).await], opts(10, 20, Duration::from_secs(5))).unwrap();
    let info = c.info().await.unwrap();
    assert!(matches!(
        c.fetch_tokenizer(dir.path(), &info).await,
        Err(ClientError::TokenizerMismatch { .. })
    ));
}

/// `tokenizer_sha256` names the cache directory: a teacher advertising anything but 64 hex
/// digits (a path, a traversal, a short or non-hex string) is refused with an error naming the
/// value, before any download and without touching the file system.
#[tokio::test]
async fn a_tokenizer_sha256_that_is_not_hex_is_refused() {
    let bad = [
        "../../etc".to_string(),
        "/etc/passwd".to_string(),
        // 64 characters, the length of a SHA-256 in hex, that climb out of the cache.
        format!("{}a", "../".repeat(21)),
        "g".repeat(64),
        sha256_hex(TOKENIZER)[..63].to_string(),
        format!("{}/", &sha256_hex(TOKENIZER)[..63]),
        String::new(),
    ];
    let root = tempfile::tempdir().unwrap();
    let cache = root.path().join("cache");
    let student = root.path().join("student.json");
    std::fs::write(&student, b"{}").unwrap();
    for text in bad {
        let m = Arc::new(Mock {
            sha_text: Some(text.clone()),
            ..Default::default()
        });
        let c = TeacherClient::new(
            vec![start(m.clone()).await],
            opts(10, 20, Duration::from_secs(5)),
        )
        .unwrap();
        let info = c.info().await.unwrap();
        assert_eq!(info.tokenizer_sha256, text);
        let direct = c.fetch_tokenizer(&cache, &info).await;
        let via_run = c.teacher_tokenizer(&info, &student, None, &cache).await;
        for got in [
            direct.map(|p| format!("{p:?}")),
            via_run.map(|t| format!("{t:?}")),
        ] {
            match got {
                Err(ClientError::InvalidResponse { message, .. }) => {
                    assert!(message.contains("is not a SHA-256 in hex"), "{message}");
                    assert!(message.contains(&format!("{text:?}")), "{message}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
        assert_eq!(m.tokenizer_hits.load(Ordering::SeqCst), 0, "{text:?}");
        assert!(!cache.exists(), "{text:?}: the cache directory was created");
        let entries: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, vec![std::ffi::OsString::from("student.json")]);
    }
    // The same client accepts a real hash (upper-case hex too) and downloads into the cache.
    let m = Arc::new(Mock {
        sha_text: Some(sha256_hex(TOKENIZER).to_ascii_uppercase()),
        ..Default::default()
    });
    let c = TeacherClient::new(vec![start(m).await], opts(10, 20, Duration::from_secs(5))).unwrap();
    let info = c.info().await.unwrap();
    let p = c.fetch_tokenizer(&cache, &info).await.unwrap();
    assert_eq!(p, cache.join(sha256_hex(TOKENIZER)).join("tokenizer.json"));
    assert_eq!(std::fs::read(&p).unwrap(), TOKENIZER);
}

#[test]
fn the_pool_feeds_the_prefetcher() {
    // The mock runs on its own runtime thread; the client side is fully synchronous.
    let m = Arc::new(Mock::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let m2 = m.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            serve_on(l, m2).await;
        });
    });
    let addr = rx.recv().unwrap();
    let url = Url::parse(&format!("http://{addr}")).unwrap();
    let mut pool = TeacherPool::new().unwrap();
    let mock = pool.add(
        "mock",
        TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap(),
    );
    let pool = Arc::new(pool);
    pool.block_on(pool.client(mock).wait_ready(Duration::from_secs(5)))
        .unwrap();
    let batches: Vec<TopkRequest> = (0..4u32)
        .map(|i| TopkRequest {
            sequences: vec![vec![i, i + 1, i + 2, i + 3]],
            k: 2,
            temperature: 1.0,
            start: 0,
            starts: None,
            values: ValuesKind::Logprobs,
            ids: None,
        })
        .collect();
    let p2 = pool.clone();
    let mut p = Prefetcher::spawn(batches.clone(), 1, move |req: &TopkRequest| {
        p2.block_on(p2.client(mock).topk(req))
    });
    let mut n = 0;
    while let Some(item) = p.next() {
        let f = item.unwrap();
        assert_eq!(f.batch, batches[n]);
        assert_eq!(f.result, fake_scores(&batches[n]));
        n += 1;
    }
    assert_eq!(n, 4);
    assert_eq!(m.topk_hits.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn same_tokenizer_is_detected_and_a_different_one_fetched() {
    let m = Arc::new(Mock::default());
    let c = TeacherClient::new(
        vec![start(m.clone()).await],
        opts(10, 20, Duration::from_secs(5)),
    )
    .unwrap();
    let info = c.info().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let same = dir.path().join("same.json");
    std::fs::write(&same, TOKENIZER).unwrap();
    let other = dir.path().join("other.json");
    std::fs::write(&other, b"{}").unwrap();
    assert_eq!(
        c.teacher_tokenizer(&info, &same, None, &cache)
            .await
            .unwrap(),
        TeacherTokenizer::Same
    );
    assert_eq!(m.tokenizer_hits.load(Ordering::SeqCst), 0);
    let got = c
        .teacher_tokenizer(&info, &other, None, &cache)
        .await
        .unwrap();
    assert_eq!(
        got,
        TeacherTokenizer::Different(cache.join(sha256_hex(TOKENIZER)).join("tokenizer.json"))
    );
    assert_eq!(m.tokenizer_hits.load(Ordering::SeqCst), 1);
    // A local copy is used as given, without a download.
    let local = c
        .teacher_tokenizer(&info, &other, Some(&same), &cache)
        .await
        .unwrap();
    assert_eq!(local, TeacherTokenizer::Different(same.clone()));
    assert_eq!(m.tokenizer_hits.load(Ordering::SeqCst), 1);
}

#[test]
fn replicas_must_serve_the_same_model() {
    let u = |p: u16| Url::parse(&format!("http://127.0.0.1:{p}")).unwrap();
    let a = mock_info("aa".into());
    let mut b = a.clone();
    assert_eq!(
        check_replicas(&[(u(1), a.clone()), (u(2), b.clone())]).unwrap(),
        a
    );
    b.model_fingerprint = "other".into();
    let err = check_replicas(&[(u(1), a.clone()), (u(2), b)]).unwrap_err();
    assert!(err.contains("127.0.0.1:2"), "{err}");
    assert!(check_replicas(&[]).is_err());
}

/// A mock behind one URL whose answers carry, in turn, probe hash `p-a`, `p-b` and none (as a
/// load balancer over replicas that disagree, and an older one); returns its URL and hit count.
async fn start_probed() -> (Url, Arc<AtomicUsize>) {
    use axum::http::{HeaderName, HeaderValue};
    use xdistill_shared::protocol::PROBE_HEADER;
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let app = Router::new().route(
        "/topk_logits",
        post(move |body: Bytes| async move {
            let n = h.fetch_add(1, Ordering::SeqCst);
            let req = codec::decode_request(Format::Msgpack, &body).unwrap();
            let bytes = codec::encode_response(Format::Msgpack, &fake_scores(&req)).unwrap();
            let mut r = ([(header::CONTENT_TYPE, codec::MSGPACK)], bytes).into_response();
            if let Some(p) = ["p-a", "p-b"].get(n % 3) {
                r.headers_mut().insert(
                    HeaderName::from_static(PROBE_HEADER),
                    HeaderValue::from_static(p),
                );
            }
            r
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, hits)
}

/// The first answer's probe hash is pinned (or the one `pin_probe` set); an answer with another
/// is an error naming the URL and both hashes, not retried; an answer without one passes.
#[tokio::test]
async fn an_answer_with_another_probe_hash_is_refused() {
    let (url, hits) = start_probed().await;
    let c = TeacherClient::new(vec![url.clone()], opts(10, 20, Duration::from_secs(5))).unwrap();
    c.topk(&request()).await.expect("the first answer pins p-a");
    let err = c.topk(&request()).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::ProbeChanged { expected, got, .. } if expected == "p-a" && got == "p-b"),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains(url.as_str().trim_end_matches('/')), "{msg}");
    assert!(msg.contains("x-xdistill-probe"), "{msg}");
    assert_eq!(hits.load(Ordering::SeqCst), 2, "not retried");
    c.topk(&request())
        .await
        .expect("no header: an older teacher");

    let (url, _) = start_probed().await;
    let c = TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5))).unwrap();
    c.pin_probe("p-b");
    assert!(matches!(
        c.topk(&request()).await,
        Err(ClientError::ProbeChanged { .. })
    ));
}

/// The head is kept only when its SHA-256 is the one `/v1/info` names; a kept head is read from
/// the cache, not fetched again; a corrupt cached head is fetched again.
#[tokio::test]
async fn the_head_is_checked_by_its_fingerprint_and_cached() {
    let m = Arc::new(Mock::default());
    let c = TeacherClient::new(
        vec![start(m.clone()).await],
        opts(10, 20, Duration::from_secs(5)),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let len = HEAD.len() as u64;
    // Another fingerprint than the bytes': refused, nothing left in the cache.
    let other = sha256_hex(b"another head");
    let err = c
        .fetch_head(&full_vocab_info(&other, len), dir.path())
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::HeadMismatch { .. }), "{err}");
    assert!(err.to_string().contains(&other), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // The right one: kept under its fingerprint, then read from the cache.
    let fp = sha256_hex(HEAD);
    let info = full_vocab_info(&fp, len);
    let path = c.fetch_head(&info, dir.path()).await.unwrap();
    assert_eq!(path, dir.path().join(format!("{fp}.safetensors")));
    assert_eq!(std::fs::read(&path).unwrap(), HEAD);
    let hits = m.head_hits.load(Ordering::SeqCst);
    assert_eq!(c.fetch_head(&info, dir.path()).await.unwrap(), path);
    assert_eq!(
        m.head_hits.load(Ordering::SeqCst),
        hits,
        "read from the cache"
    );
    std::fs::write(&path, b"corrupt").unwrap();
    c.fetch_head(&info, dir.path()).await.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), HEAD);
    assert_eq!(
        m.head_hits.load(Ordering::SeqCst),
        hits + 1,
        "fetched again"
    );
    // A head longer than /v1/info says is cut where it passes that length, and not kept.
    let err = c
        .fetch_head(&full_vocab_info(&sha256_hex(&HEAD[..4]), 4), dir.path())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClientError::TooLarge { limit: 4, .. }),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    // A fingerprint that is not a SHA-256 never becomes a path.
    let err = c
        .fetch_head(&full_vocab_info("../../x", len), dir.path())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a SHA-256"), "{err}");
}

/// Hidden states for another head than the one the run holds are an error, not a silent mix.
#[tokio::test]
async fn hidden_states_for_another_head_are_refused() {
    let m = Arc::new(Mock {
        hidden_head: Some("head-b"),
        ..Default::default()
    });
    let c = TeacherClient::new(vec![start(m).await], opts(10, 20, Duration::from_secs(5))).unwrap();
    let req = xdistill_shared::protocol::HiddenRequest {
        sequences: vec![vec![1, 2, 3]],
        start: 0,
        starts: None,
    };
    let spec = |fp: &str| xdistill_trainer::client::HiddenSpec {
        head_fingerprint: fp.into(),
        hidden_size: 2,
    };
    let ok = c.hidden(&req, &spec("head-b")).await.unwrap();
    assert_eq!(ok.results[0].rows, 2);
    let err = c.hidden(&req, &spec("head-a")).await.unwrap_err();
    assert!(
        err.to_string().contains("head-b") && err.to_string().contains("head-a"),
        "{err}"
    );
    let err = c
        .hidden(
            &req,
            &xdistill_trainer::client::HiddenSpec {
                head_fingerprint: "head-b".into(),
                hidden_size: 3,
            },
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("hidden_size 2"), "{err}");
}

/// A peer on loopback that answers every request with `head` (a status line and headers) and
/// then, unless the head declares a length, 64 KiB chunks of `fill` without end, until the
/// client hangs up: a broken proxy, or a URL that is no teacher. Returns its URL and the bytes
/// it managed to write.
async fn endless_peer(head: &'static str, fill: u8) -> (Url, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
    let written = Arc::new(AtomicUsize::new(0));
    let count = written.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                // The request's head (its body, if any, is left unread).
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                if head.contains("Content-Length") {
                    // Declares more than it will ever send.
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    return;
                }
                let mut chunk = b"10000\r\n".to_vec();
                chunk.extend(std::iter::repeat_n(fill, 1 << 16));
                chunk.extend_from_slice(b"\r\n");
                while sock.write_all(&chunk).await.is_ok() {
                    count.fetch_add(chunk.len(), Ordering::SeqCst);
                }
            });
        }
    });
    (url, written)
}

/// An answer longer than any answer to its request can be (a body without end, a declared
/// terabyte) is an error at the request's limit, not the trainer's memory filling until the
/// run is killed; an error answer without end is read for its first bytes only.
#[tokio::test]
async fn answers_without_end_are_cut_at_the_requests_limit() {
    const CHUNKED_OK: &str = "HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n\
                              Transfer-Encoding: chunked\r\n\r\n";
    let client = |url: Url| TeacherClient::new(vec![url], opts(10, 20, Duration::from_secs(5)));
    // /topk_logits: the limit follows the request (a few rows: well under a megabyte).
    let (url, written) = endless_peer(CHUNKED_OK, 0x90).await;
    let c = client(url).unwrap();
    let t0 = Instant::now();
    let err = c.topk(&request()).await.unwrap_err();
    let ClientError::TooLarge { limit, .. } = err else {
        panic!("{err}")
    };
    assert!(limit < 1 << 20, "{limit}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // The client stopped reading: what the peer wrote is the limit plus what the sockets'
    // buffers took before the client hung up, not an ever-growing body.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = written.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        written.load(Ordering::SeqCst),
        after,
        "the peer still writes"
    );
    assert!(after < 64 << 20, "{after}");
    // /v1/info and /tokenizer.json: their own limits; a declared length over the limit is
    // refused before a byte of the body is read (the peer never sends one: a read would hang
    // until the 10 s timeout).
    let err = c.info().await.unwrap_err();
    assert!(matches!(err, ClientError::TooLarge { .. }), "{err}");
    let (url, _) = endless_peer(
        "HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n",
        0,
    )
    .await;
    let t0 = Instant::now();
    let err = client(url).unwrap().tokenizer_json().await.unwrap_err();
    assert!(matches!(err, ClientError::TooLarge { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // A 400 without end: rejected at once with the start of its text as the message.
    let (url, _) = endless_peer(
        "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n\
         Transfer-Encoding: chunked\r\n\r\n",
        b'x',
    )
    .await;
    let err = client(url).unwrap().topk(&request()).await.unwrap_err();
    let ClientError::Rejected {
        status, message, ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!((*status, message.as_str()), (400, "x".repeat(300).as_str()));
}
