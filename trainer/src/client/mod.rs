//! Client of the teacher server: `POST /topk_logits` in MessagePack, `GET /v1/info`,
//! `GET /tokenizer.json`, `GET /health`; `POST /hidden_states` and `GET /v1/head` in `hidden`.
//!
//! Requests go round-robin over the configured replicas. Connection errors, timeouts and
//! 408/429/502/503/504 answers are retried with exponential backoff and jitter, honouring
//! `Retry-After`, moving to the next replica at once when another one is available; this goes on
//! until `max_wait` (or `max_attempts`), so a teacher that restarts is waited for and the step is
//! not lost. Other 4xx/5xx answers fail at once with the server's error message.
//!
//! The training loop is synchronous: [`TeacherPool`] runs every teacher's client on one runtime
//! and awaits a step's requests together, and [`Prefetcher`] keeps the next batch's requests in
//! flight while a step trains. Errors are in `errors`, settings in `options`, the tokenizer
//! cache in `tokenizer`, the response and replica checks in `wire`, backoff in `retry`, how
//! much of an answer is read in `body`.

mod body;
mod errors;
mod hidden;
mod options;
mod pool;
mod prefetch;
mod retry;
mod tokenizer;
mod wire;

pub use errors::{is_retryable_status, ClientError};
pub use hidden::{check_hidden_response, HiddenSpec};
pub use options::ClientOptions;
pub use pool::{join_in_order, ScoreError, TeacherPool};
pub use prefetch::{Fetched, PrefetchError, Prefetcher};
pub use retry::{backoff_delay, parse_retry_after};
pub use tokenizer::TeacherTokenizer;
pub use wire::{check_replicas, check_response, endpoint, HEALTH_PATH, INFO_PATH, TOKENIZER_PATH};

use crate::config::{ConfigError, TeacherConfig};
use bytes::Bytes;
use reqwest::header::{HeaderMap, ACCEPT, CONTENT_TYPE};
use reqwest::Url;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wire::error_body;
use xdistill_shared::codec::{self, CodecError, Format};
use xdistill_shared::protocol::{
    affinity_key, InfoResponse, TopkRequest, TopkResponse, AFFINITY_HEADER, PROBE_HEADER, TOPK_PATH,
};

/// The async teacher client; cheap to clone (shared connection pool and round-robin cursor).
#[derive(Clone)]
pub struct TeacherClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    urls: Vec<Url>,
    opts: ClientOptions,
    next: AtomicUsize,
    /// The model fingerprint of the first answer; later answers must match.
    model: Mutex<Option<String>>,
    /// Set when the teacher sends hidden states (`transport = "hidden"`): [`Self::score`]
    /// asks `/hidden_states` and checks the answers against this head.
    hidden: std::sync::OnceLock<HiddenSpec>,
    /// The start-up probe hash of the first answer that sent one; later answers must match.
    probe: Mutex<Option<String>>,
}

impl TeacherClient {
    /// A client of the replicas at `urls` (requests round-robin over them).
    pub fn new(urls: Vec<Url>, opts: ClientOptions) -> Result<TeacherClient, ClientError> {
        if urls.is_empty() {
            return Err(ClientError::NoUrls);
        }
        let http = reqwest::Client::builder()
            .timeout(opts.timeout)
            .connect_timeout(opts.connect_timeout)
            // Drop idle pooled connections before the teacher's keep-alive limit (its
            // --header-timeout-secs, 10 s by default) closes them under a request.
            .pool_idle_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| ClientError::Build(e.to_string()))?;
        Ok(TeacherClient {
            inner: Arc::new(Inner {
                http,
                urls,
                opts,
                next: AtomicUsize::new(0),
                model: Mutex::new(None),
                hidden: std::sync::OnceLock::new(),
                probe: Mutex::new(None),
            }),
        })
    }

    /// From the `[teacher]` section of a config.
    pub fn from_config(t: &TeacherConfig) -> Result<TeacherClient, ConfigError> {
        TeacherClient::new(t.parsed_urls()?, ClientOptions::from_config(t)?).map_err(|e| {
            ConfigError::Invalid {
                key: "teacher.urls".into(),
                message: e.to_string(),
            }
        })
    }

    /// The replicas' base URLs.
    pub fn urls(&self) -> &[Url] {
        &self.inner.urls
    }

    /// The connection and retry settings.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }

    /// Requires answers to come from the model with this fingerprint (e.g. from `/v1/info`).
    pub fn pin_model(&self, fingerprint: &str) {
        if let Ok(mut m) = self.inner.model.lock() {
            *m = Some(fingerprint.to_string());
        }
    }

    /// Requires answers to carry this start-up probe hash (`/v1/info`'s `probe.hash`) when they
    /// carry one: another hash is another replica's numbers.
    pub fn pin_probe(&self, hash: &str) {
        pin(&self.inner.probe, hash);
    }

    /// Top-k scores for `req`, retried as described in the module docs.
    pub async fn topk(&self, req: &TopkRequest) -> Result<TopkResponse, ClientError> {
        let body =
            Bytes::from(codec::encode_request(Format::Msgpack, req).map_err(ClientError::Encode)?);
        let max_wait = self.inner.opts.max_wait;
        self.with_retries(
            "POST /topk_logits",
            max_wait,
            self.inner.opts.max_attempts,
            |url| self.topk_once(url, body.clone(), req),
        )
        .await
    }

    async fn topk_once(
        &self,
        base: Url,
        body: Bytes,
        req: &TopkRequest,
    ) -> Result<TopkResponse, ClientError> {
        let url = endpoint(&base, TOPK_PATH);
        let (headers, bytes) = self
            .post_msgpack(&url, body, &req.sequences, body::topk_limit(req))
            .await?;
        self.check_probe(&url, &headers)?;
        let ct = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
        let resp =
            codec::decode_response(Format::from_content_type(ct), &bytes).map_err(|source| {
                ClientError::Decode {
                    url: url.to_string(),
                    source,
                }
            })?;
        check_response(req, &resp).map_err(|message| ClientError::InvalidResponse {
            url: url.to_string(),
            message,
        })?;
        self.check_model(&url, &resp.model)?;
        Ok(resp)
    }

    fn check_model(&self, url: &Url, got: &str) -> Result<(), ClientError> {
        let Ok(mut m) = self.inner.model.lock() else {
            return Ok(());
        };
        match m.as_deref() {
            None => {
                *m = Some(got.to_string());
                Ok(())
            }
            Some(expected) if expected == got => Ok(()),
            Some(expected) => Err(ClientError::ModelChanged {
                url: url.to_string(),
                expected: expected.to_string(),
                got: got.to_string(),
            }),
        }
    }

    /// Checks an answer's [`PROBE_HEADER`] against the pinned probe hash (the first one seen is
    /// pinned); an answer without the header (an older teacher) passes.
    fn check_probe(&self, url: &Url, headers: &HeaderMap) -> Result<(), ClientError> {
        let Some(got) = headers.get(PROBE_HEADER) else {
            return Ok(());
        };
        let got = String::from_utf8_lossy(got.as_bytes());
        match first_or_same(&self.inner.probe, &got) {
            Ok(()) => Ok(()),
            Err(expected) => Err(ClientError::ProbeChanged {
                url: url.to_string(),
                expected,
                got: got.into_owned(),
            }),
        }
    }

    /// `GET /v1/info` (retried).
    pub async fn info(&self) -> Result<InfoResponse, ClientError> {
        let max_wait = self.inner.opts.max_wait;
        self.with_retries(
            "GET /v1/info",
            max_wait,
            self.inner.opts.max_attempts,
            |base| async move {
                let url = endpoint(&base, INFO_PATH);
                let rb = self.inner.http.get(url.clone()).header(ACCEPT, codec::JSON);
                let (_, bytes) = self.send(&url, rb, body::SMALL_BODY).await?;
                let info: InfoResponse =
                    serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode {
                        url: url.to_string(),
                        source: CodecError::Json(e),
                    })?;
                wire::check_info(&info).map_err(|message| ClientError::InvalidResponse {
                    url: url.to_string(),
                    message,
                })?;
                Ok(info)
            },
        )
        .await
    }

    /// `GET /v1/info` of every replica, in URL order (each retried); use it to check that the
    /// replicas serve the same model.
    pub async fn info_all(&self) -> Vec<(Url, Result<InfoResponse, ClientError>)> {
        let mut out = Vec::new();
        for base in self.inner.urls.clone() {
            out.push((base.clone(), self.replica(&base).info().await));
        }
        out
    }

    /// A client of the one replica at `base` (same connection pool and settings).
    fn replica(&self, base: &Url) -> TeacherClient {
        TeacherClient {
            inner: Arc::new(Inner {
                http: self.inner.http.clone(),
                urls: vec![base.clone()],
                opts: self.inner.opts.clone(),
                next: AtomicUsize::new(0),
                model: Mutex::new(None),
                hidden: std::sync::OnceLock::new(),
                probe: Mutex::new(None),
            }),
        }
    }

    /// Polls `GET /health` (all replicas in turn, with backoff) until one answers 2xx or
    /// `max_wait` passes (`max_attempts` does not apply); returns the URL that answered. Logs a
    /// line per failed poll so a user sees what the trainer waits for.
    pub async fn wait_ready(&self, max_wait: Duration) -> Result<Url, ClientError> {
        self.with_retries("GET /health", max_wait, None, |base| async move {
            let url = endpoint(&base, HEALTH_PATH);
            let rb = self.inner.http.get(url.clone());
            self.send(&url, rb, body::SMALL_BODY).await?;
            Ok(base)
        })
        .await
    }

    /// Sends one request; 2xx → (content type, body of at most `limit` bytes); otherwise a
    /// typed error.
    async fn send(
        &self,
        url: &Url,
        rb: reqwest::RequestBuilder,
        limit: u64,
    ) -> Result<(Option<String>, Bytes), ClientError> {
        let (headers, bytes) = self.send_with_headers(url, rb, limit).await?;
        let ct = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
        Ok((ct.map(str::to_string), bytes))
    }

    /// `POST`s a MessagePack body about `sequences` (their affinity key lets a load balancer
    /// send them where their prefix is cached) and asks for MessagePack back.
    async fn post_msgpack(
        &self,
        url: &Url,
        body: Bytes,
        sequences: &[Vec<u32>],
        limit: u64,
    ) -> Result<(HeaderMap, Bytes), ClientError> {
        let rb = self
            .inner
            .http
            .post(url.clone())
            .header(CONTENT_TYPE, codec::MSGPACK)
            .header(ACCEPT, codec::MSGPACK)
            .header(AFFINITY_HEADER, affinity_key(sequences))
            .body(body);
        self.send_with_headers(url, rb, limit).await
    }

    /// As [`Self::send`], with every header of the answer.
    async fn send_with_headers(
        &self,
        url: &Url,
        mut rb: reqwest::RequestBuilder,
        limit: u64,
    ) -> Result<(HeaderMap, Bytes), ClientError> {
        if let Some(key) = &self.inner.opts.api_key {
            rb = rb.bearer_auth(key);
        }
        let resp = rb.send().await.map_err(|e| body::transport(url, &e))?;
        let status = resp.status();
        let ct = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let headers = resp.headers().clone();
        if status.is_success() {
            return Ok((headers, body::read(url, resp, limit).await?));
        }
        let bytes = body::read_error(resp).await;
        let (kind, message, field) = error_body(ct.as_deref(), &bytes, status);
        if is_retryable_status(status) {
            Err(ClientError::Unavailable {
                url: url.to_string(),
                status: status.as_u16(),
                message,
                retry_after,
            })
        } else {
            Err(ClientError::Rejected {
                url: url.to_string(),
                status: status.as_u16(),
                kind,
                message,
                field,
            })
        }
    }

    /// Runs `attempt` against the replicas until it succeeds, fails for good, or `max_wait`
    /// (or `max_attempts`) is used up. Each replica has a "not before" time set by its last
    /// failure (backoff or `Retry-After`); the next attempt goes to the first ready replica in
    /// round-robin order, or waits for the earliest one.
    async fn with_retries<T, F, Fut>(
        &self,
        what: &str,
        max_wait: Duration,
        max_attempts: Option<u32>,
        mut attempt: F,
    ) -> Result<T, ClientError>
    where
        F: FnMut(Url) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let urls = &self.inner.urls;
        let opts = &self.inner.opts;
        let n = urls.len();
        let start = Instant::now();
        let mut not_before = vec![start; n];
        let mut cursor = self.inner.next.fetch_add(1, Ordering::Relaxed) % n;
        let mut attempts = 0u32;
        let mut last: Option<ClientError> = None;
        loop {
            let now = Instant::now();
            let (idx, ready_at) = retry::pick(&not_before, cursor, now);
            if ready_at.saturating_duration_since(start) > max_wait {
                if let Some(last) = last.take() {
                    return Err(ClientError::GaveUp {
                        what: what.to_string(),
                        attempts,
                        waited: start.elapsed(),
                        last: Box::new(last),
                    });
                }
            }
            if ready_at > now {
                tokio::time::sleep_until(ready_at.into()).await;
            }
            attempts += 1;
            match attempt(urls[idx].clone()).await {
                Ok(v) => {
                    if attempts > 1 {
                        tracing::info!(
                            "{what}: succeeded on {} after {attempts} attempts ({:.1} s)",
                            urls[idx],
                            start.elapsed().as_secs_f64()
                        );
                    }
                    return Ok(v);
                }
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => {
                    if max_attempts.is_some_and(|m| attempts >= m) {
                        return Err(ClientError::GaveUp {
                            what: what.to_string(),
                            attempts,
                            waited: start.elapsed(),
                            last: Box::new(e),
                        });
                    }
                    let backoff = backoff_delay(
                        attempts - 1,
                        opts.backoff_initial,
                        opts.backoff_max,
                        rand::random::<f64>(),
                    );
                    let delay = e.retry_after().unwrap_or(backoff);
                    not_before[idx] = Instant::now() + delay;
                    let (next_idx, next_at) = retry::pick(&not_before, idx + 1, Instant::now());
                    tracing::warn!(
                        "{what}: attempt {attempts} failed: {e}; retrying on {} in {:.1} s \
                         (waited {:.1} s of {:.0} s)",
                        urls[next_idx],
                        next_at
                            .saturating_duration_since(Instant::now())
                            .as_secs_f64(),
                        start.elapsed().as_secs_f64(),
                        max_wait.as_secs_f64()
                    );
                    last = Some(e);
                    cursor = idx + 1;
                }
            }
        }
    }
}

/// Sets `slot` to `value`.
fn pin(slot: &Mutex<Option<String>>, value: &str) {
    if let Ok(mut m) = slot.lock() {
        *m = Some(value.to_string());
    }
}

/// Pins `got` in an empty `slot`; otherwise `Err(pinned)` when it holds another value.
fn first_or_same(slot: &Mutex<Option<String>>, got: &str) -> Result<(), String> {
    let Ok(mut m) = slot.lock() else {
        return Ok(());
    };
    match m.as_deref() {
        None => {
            *m = Some(got.to_string());
            Ok(())
        }
        Some(expected) if expected == got => Ok(()),
        Some(expected) => Err(expected.to_string()),
    }
}
