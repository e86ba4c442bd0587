//! Client of the teacher server: `POST /topk_logits` in MessagePack, `GET /v1/info`,
//! `GET /tokenizer.json`, `GET /health`.
//!
//! Requests go round-robin over the configured replicas. Connection errors, timeouts and
//! 408/429/502/503/504 answers are retried with exponential backoff and jitter, honouring
//! `Retry-After`, moving to the next replica at once when another one is available; this goes on
//! until `max_wait` (or `max_attempts`), so a teacher that restarts is waited for and the step is
//! not lost. Other 4xx/5xx answers fail at once with the server's error message.
//!
//! The training loop is synchronous: [`BlockingClient`] wraps this async client in its own
//! runtime, and [`Prefetcher`] keeps the next batch's request in flight while a step trains.

mod blocking;
mod prefetch;
mod retry;

pub use blocking::BlockingClient;
pub use prefetch::{Fetched, PrefetchError, Prefetcher};
pub use retry::{backoff_delay, parse_retry_after};

use crate::config::{ConfigError, TeacherConfig};
use bytes::Bytes;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{StatusCode, Url};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xdistill_shared::codec::{self, CodecError, Format};
use xdistill_shared::protocol::{
    affinity_key, ErrorBody, InfoResponse, TopkRequest, TopkResponse, AFFINITY_HEADER, TOPK_PATH,
};

pub const INFO_PATH: &str = "/v1/info";
pub const TOKENIZER_PATH: &str = "/tokenizer.json";
pub const HEALTH_PATH: &str = "/health";

/// Connection and retry settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientOptions {
    /// Whole-request timeout (sending, teacher compute, receiving).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// Total time one call may spend retrying before it fails.
    pub max_wait: Duration,
    /// Optional cap on attempts per call.
    pub max_attempts: Option<u32>,
    /// First retry delay; doubles per failure up to `backoff_max` (then ±50 % jitter).
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Sent as `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions::from_teacher_config(&TeacherConfig::default(), None)
    }
}

impl ClientOptions {
    fn from_teacher_config(t: &TeacherConfig, api_key: Option<String>) -> ClientOptions {
        ClientOptions {
            timeout: t.timeout(),
            connect_timeout: t.connect_timeout(),
            max_wait: t.max_wait(),
            max_attempts: t.max_attempts,
            backoff_initial: t.backoff_initial(),
            backoff_max: t.backoff_max(),
            api_key,
        }
    }

    /// From `[teacher]`, reading the API key from the environment variable it names.
    pub fn from_config(t: &TeacherConfig) -> Result<ClientOptions, ConfigError> {
        Ok(Self::from_teacher_config(t, t.api_key()?))
    }
}

/// What went wrong talking to the teacher.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no teacher URL given")]
    NoUrls,
    #[error("building the HTTP client: {0}")]
    Build(String),
    /// The server answered a status that is not retried: every one but 408, 429, 502, 503 and
    /// 504 (which are, as are transport errors).
    #[error("{url}: HTTP {status} ({kind}): {message}{}", field.as_ref().map(|f| format!(" [field {f}]")).unwrap_or_default())]
    Rejected {
        url: String,
        status: u16,
        kind: String,
        message: String,
        field: Option<String>,
    },
    /// A transient HTTP status (408, 429, 502, 503, 504): retried.
    #[error("{url}: HTTP {status}: {message}")]
    Unavailable {
        url: String,
        status: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    /// Connection refused/reset, timeout, or a broken body: retried.
    #[error("{url}: {message}")]
    Transport { url: String, message: String },
    #[error("encoding the request: {0}")]
    Encode(CodecError),
    #[error("{url}: {source}")]
    Decode { url: String, source: CodecError },
    /// The answer does not match the request (sequence count, rows, k).
    #[error("{url}: invalid response: {message}")]
    InvalidResponse { url: String, message: String },
    /// A replica answered with another model than the one seen first.
    #[error("{url}: teacher model changed from {expected} to {got}")]
    ModelChanged {
        url: String,
        expected: String,
        got: String,
    },
    #[error("teacher tokenizer sha256 {got} does not match /v1/info's {expected}")]
    TokenizerMismatch { expected: String, got: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: gave up after {attempts} attempts over {:.1} s; last error: {last}", waited.as_secs_f64())]
    GaveUp {
        what: String,
        attempts: u32,
        waited: Duration,
        last: Box<ClientError>,
    },
}

impl ClientError {
    /// Whether another attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::Unavailable { .. } | ClientError::Transport { .. }
        )
    }
    /// The delay the server asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// Statuses worth retrying: request timeout, too many requests, bad gateway, unavailable,
/// gateway timeout.
pub fn is_retryable_status(s: StatusCode) -> bool {
    matches!(s.as_u16(), 408 | 429 | 502 | 503 | 504)
}

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
}

impl TeacherClient {
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

    pub fn urls(&self) -> &[Url] {
        &self.inner.urls
    }

    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }

    /// Requires answers to come from the model with this fingerprint (e.g. from `/v1/info`).
    pub fn pin_model(&self, fingerprint: &str) {
        if let Ok(mut m) = self.inner.model.lock() {
            *m = Some(fingerprint.to_string());
        }
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
        let rb = self
            .inner
            .http
            .post(url.clone())
            .header(CONTENT_TYPE, codec::MSGPACK)
            .header(ACCEPT, codec::MSGPACK)
            .header(AFFINITY_HEADER, affinity_key(&req.sequences))
            .body(body);
        let (ct, bytes) = self.send(&url, rb).await?;
        let resp = codec::decode_response(Format::from_content_type(ct.as_deref()), &bytes)
            .map_err(|source| ClientError::Decode {
                url: url.to_string(),
                source,
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
                let (_, bytes) = self.send(&url, rb).await?;
                serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode {
                    url: url.to_string(),
                    source: CodecError::Json(e),
                })
            },
        )
        .await
    }

    /// `GET /v1/info` of every replica, in URL order (each retried); use it to check that the
    /// replicas serve the same model.
    pub async fn info_all(&self) -> Vec<(Url, Result<InfoResponse, ClientError>)> {
        let mut out = Vec::new();
        for base in self.inner.urls.clone() {
            let one = TeacherClient {
                inner: Arc::new(Inner {
                    http: self.inner.http.clone(),
                    urls: vec![base.clone()],
                    opts: self.inner.opts.clone(),
                    next: AtomicUsize::new(0),
                    model: Mutex::new(None),
                }),
            };
            out.push((base, one.info().await));
        }
        out
    }

    /// `GET /tokenizer.json`: the teacher's tokenizer file, as served (retried).
    pub async fn tokenizer_json(&self) -> Result<Bytes, ClientError> {
        let max_wait = self.inner.opts.max_wait;
        self.with_retries(
            "GET /tokenizer.json",
            max_wait,
            self.inner.opts.max_attempts,
            |base| async move {
                let url = endpoint(&base, TOKENIZER_PATH);
                let rb = self.inner.http.get(url.clone());
                Ok(self.send(&url, rb).await?.1)
            },
        )
        .await
    }

    /// The teacher tokenizer as a local file, cached as `cache_dir/<sha256>/tokenizer.json`
    /// keyed by `info.tokenizer_sha256`; downloaded (and its hash checked) when not cached.
    pub async fn fetch_tokenizer(
        &self,
        cache_dir: &Path,
        info: &InfoResponse,
    ) -> Result<PathBuf, ClientError> {
        let expected = info.tokenizer_sha256.to_ascii_lowercase();
        // The hash names a directory: only a SHA-256 in hex may become a path.
        if expected.len() != 64 || !expected.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ClientError::InvalidResponse {
                url: TOKENIZER_PATH.to_string(),
                message: format!(
                    "/v1/info's tokenizer_sha256 {:?} is not a SHA-256 in hex",
                    info.tokenizer_sha256
                ),
            });
        }
        let dir = cache_dir.join(&expected);
        let path = dir.join("tokenizer.json");
        if let Ok(bytes) = std::fs::read(&path) {
            if sha256_hex(&bytes) == expected {
                return Ok(path);
            }
            tracing::warn!(
                "{}: cached tokenizer has the wrong hash; fetching it again",
                path.display()
            );
        }
        let bytes = self.tokenizer_json().await?;
        let got = sha256_hex(&bytes);
        if got != expected {
            return Err(ClientError::TokenizerMismatch { expected, got });
        }
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| ClientError::Io { path: p, source }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let tmp = dir.join(format!(".tokenizer.json.tmp-{}", std::process::id()));
        std::fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        tracing::info!("teacher tokenizer saved to {}", path.display());
        Ok(path)
    }

    /// The teacher tokenizer for a run whose student uses `student_tokenizer`:
    /// [`TeacherTokenizer::Same`] when the files are identical (same sha256 as `/v1/info`'s),
    /// else a local file: `local` when given (a hash mismatch is only warned about, since an
    /// equivalent file may be formatted differently), else fetched into `cache_dir`.
    pub async fn teacher_tokenizer(
        &self,
        info: &InfoResponse,
        student_tokenizer: &Path,
        local: Option<&Path>,
        cache_dir: &Path,
    ) -> Result<TeacherTokenizer, ClientError> {
        let student = std::fs::read(student_tokenizer).map_err(|source| ClientError::Io {
            path: student_tokenizer.to_path_buf(),
            source,
        })?;
        if sha256_hex(&student).eq_ignore_ascii_case(&info.tokenizer_sha256) {
            return Ok(TeacherTokenizer::Same);
        }
        if let Some(p) = local {
            let bytes = std::fs::read(p).map_err(|source| ClientError::Io {
                path: p.to_path_buf(),
                source,
            })?;
            if !sha256_hex(&bytes).eq_ignore_ascii_case(&info.tokenizer_sha256) {
                tracing::warn!(
                    "{}: sha256 differs from the teacher's tokenizer ({}); using it anyway",
                    p.display(),
                    info.tokenizer_sha256
                );
            }
            return Ok(TeacherTokenizer::Different(p.to_path_buf()));
        }
        Ok(TeacherTokenizer::Different(
            self.fetch_tokenizer(cache_dir, info).await?,
        ))
    }

    /// Polls `GET /health` (all replicas in turn, with backoff) until one answers 2xx or
    /// `max_wait` passes (`max_attempts` does not apply); returns the URL that answered. Logs a
    /// line per failed poll so a user sees what the trainer waits for.
    pub async fn wait_ready(&self, max_wait: Duration) -> Result<Url, ClientError> {
        self.with_retries("GET /health", max_wait, None, |base| async move {
            let url = endpoint(&base, HEALTH_PATH);
            let rb = self.inner.http.get(url.clone());
            self.send(&url, rb).await?;
            Ok(base)
        })
        .await
    }

    /// Sends one request; 2xx → (content type, body); otherwise a typed error.
    async fn send(
        &self,
        url: &Url,
        mut rb: reqwest::RequestBuilder,
    ) -> Result<(Option<String>, Bytes), ClientError> {
        if let Some(key) = &self.inner.opts.api_key {
            rb = rb.bearer_auth(key);
        }
        let transport = |e: reqwest::Error| ClientError::Transport {
            url: url.to_string(),
            message: error_chain(&e),
        };
        let resp = rb.send().await.map_err(transport)?;
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
        let bytes = resp.bytes().await.map_err(transport)?;
        if status.is_success() {
            return Ok((ct, bytes));
        }
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

/// Whether the student and the teacher share a tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TeacherTokenizer {
    /// Byte-identical `tokenizer.json`: same-tokenizer losses, no alignment.
    Same,
    /// The teacher's own tokenizer file: cross-tokenizer alignment needed.
    Different(PathBuf),
}

/// Checks that every replica serves the same model (fingerprint) with the same tokenizer;
/// returns the common info. Replicas that disagree would silently mix two teachers.
pub fn check_replicas(infos: &[(Url, InfoResponse)]) -> Result<InfoResponse, String> {
    let Some((u0, first)) = infos.first() else {
        return Err("no replica answered /v1/info".into());
    };
    for (u, i) in &infos[1..] {
        if i.model_fingerprint != first.model_fingerprint
            || i.tokenizer_sha256 != first.tokenizer_sha256
        {
            return Err(format!(
                "replicas disagree: {u0} serves model {} (tokenizer {}), {u} serves model {} \
                 (tokenizer {})",
                first.model_fingerprint,
                first.tokenizer_sha256,
                i.model_fingerprint,
                i.tokenizer_sha256
            ));
        }
    }
    Ok(first.clone())
}

/// `base` with `route` appended to its path (keeps a path prefix such as `/teacher/`).
pub fn endpoint(base: &Url, route: &str) -> Url {
    let mut u = base.clone();
    let path = format!("{}{route}", base.path().trim_end_matches('/'));
    u.set_path(&path);
    u.set_query(None);
    u
}

/// Checks that a response answers `req`: one result per sequence, `S - 1 - start` rows each,
/// consistent buffers, and `k` not above the request's (a server may cap k at its vocabulary).
pub fn check_response(req: &TopkRequest, resp: &TopkResponse) -> Result<(), String> {
    if resp.results.len() != req.sequences.len() {
        return Err(format!(
            "{} results for {} sequences",
            resp.results.len(),
            req.sequences.len()
        ));
    }
    if resp.k > req.k {
        return Err(format!("k = {} where {} was asked", resp.k, req.k));
    }
    for (i, (seq, s)) in req.sequences.iter().zip(&resp.results).enumerate() {
        let rows = seq.len().saturating_sub(1 + req.start_of(i));
        if s.rows != rows {
            return Err(format!(
                "results[{i}]: {} rows where {rows} were expected",
                s.rows
            ));
        }
        if s.k != resp.k {
            return Err(format!(
                "results[{i}]: k = {} where the response says {}",
                s.k, resp.k
            ));
        }
        s.check_shapes().map_err(|m| format!("results[{i}]: {m}"))?;
        // Candidate ids: one log-prob per asked id of every row.
        let asked = req
            .ids
            .as_ref()
            .and_then(|ids| ids.get(i))
            .and_then(|rows| rows.first());
        if let Some(m) = asked.map(Vec::len) {
            if s.m != m {
                return Err(format!(
                    "results[{i}]: {} candidate log-probs per row where {m} ids were asked",
                    s.m
                ));
            }
        }
    }
    Ok(())
}

/// (type, message, field) of an error answer: the server's `ErrorBody` (JSON or MessagePack),
/// else the start of the body as text.
fn error_body(
    ct: Option<&str>,
    body: &[u8],
    status: StatusCode,
) -> (String, String, Option<String>) {
    let parsed: Option<ErrorBody> = match Format::from_content_type(ct) {
        Format::Msgpack => rmp_serde::from_slice(body).ok(),
        Format::Json => serde_json::from_slice(body).ok(),
    };
    match parsed {
        Some(b) => (b.error.kind, b.error.message, b.error.field),
        None => {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)])
                .trim()
                .to_string();
            let msg = if text.is_empty() {
                status.canonical_reason().unwrap_or("error").to_string()
            } else {
                text
            };
            (status.as_str().to_string(), msg, None)
        }
    }
}

/// An error with its causes (reqwest's own message is terse: "error sending request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s += &format!(": {m}");
        }
        cur = c.source();
    }
    s
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdistill_shared::protocol::{SequenceScores, ValuesKind};

    #[test]
    fn endpoints_keep_path_prefixes() {
        let u = |s: &str| Url::parse(s).unwrap();
        assert_eq!(
            endpoint(&u("http://h:1"), TOPK_PATH).as_str(),
            "http://h:1/topk_logits"
        );
        assert_eq!(
            endpoint(&u("http://h:1/"), INFO_PATH).as_str(),
            "http://h:1/v1/info"
        );
        assert_eq!(
            endpoint(&u("https://h/teacher/?x=1"), HEALTH_PATH).as_str(),
            "https://h/teacher/health"
        );
    }

    #[test]
    fn responses_are_checked_against_the_request() {
        let req = TopkRequest {
            sequences: vec![vec![1, 2, 3, 4], vec![5, 6]],
            k: 2,
            temperature: 1.0,
            start: 0,
            starts: Some(vec![1, 0]),
            values: ValuesKind::Logprobs,
            ids: None,
        };
        let seq = |rows: usize| SequenceScores {
            rows,
            k: 2,
            topk_ids: vec![0; rows * 2],
            topk_values: vec![0.0; rows * 2],
            target_logprobs: vec![0.0; rows],
            logsumexp: vec![0.0; rows],
            ..Default::default()
        };
        let mut resp = TopkResponse {
            k: 2,
            values: ValuesKind::Logprobs,
            temperature: 1.0,
            model: "m".into(),
            with_ids: false,
            // 4 tokens from 1: rows 2 (predicting tokens 2 and 3); 2 tokens from 0: 1 row.
            results: vec![seq(2), seq(1)],
        };
        check_response(&req, &resp).unwrap();
        resp.results[0] = seq(3);
        assert!(check_response(&req, &resp)
            .unwrap_err()
            .contains("results[0]"));
        resp.results.pop();
        assert!(check_response(&req, &resp).is_err());
        // Candidate ids: every row answers as many ids as were asked.
        let req = TopkRequest {
            ids: Some(vec![vec![vec![5, 6, 7]; 2], vec![vec![5, 6, 7]; 1]]),
            ..req
        };
        let with_m = |rows: usize, m: usize| SequenceScores {
            m,
            ids_logprobs: vec![-1.0; rows * m],
            ..seq(rows)
        };
        resp.results = vec![with_m(2, 3), with_m(1, 3)];
        check_response(&req, &resp).unwrap();
        resp.results[1] = with_m(1, 2);
        let err = check_response(&req, &resp).unwrap_err();
        assert!(err.contains("results[1]") && err.contains("3 ids"), "{err}");
    }

    #[test]
    fn error_bodies_are_surfaced() {
        let body = br#"{"error":{"type":"invalid_request","message":"id 99 >= vocab","field":"sequences[0][1]"}}"#;
        let (k, m, f) = error_body(Some("application/json"), body, StatusCode::BAD_REQUEST);
        assert_eq!(
            (k.as_str(), m.as_str(), f.as_deref()),
            ("invalid_request", "id 99 >= vocab", Some("sequences[0][1]"))
        );
        let (_, m, _) = error_body(None, b"plain failure", StatusCode::BAD_GATEWAY);
        assert_eq!(m, "plain failure");
        let (_, m, _) = error_body(None, b"", StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(m, "Service Unavailable");
    }
}
