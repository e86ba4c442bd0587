//! What can go wrong talking to a teacher, and which failures are worth another attempt.

use reqwest::StatusCode;
use std::path::PathBuf;
use std::time::Duration;
use xdistill_shared::codec::CodecError;

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
    /// The answer is longer than any answer to the request can be (an endless body, a wrong
    /// URL serving a large file): not read further, not retried.
    #[error("{url}: the answer is longer than {limit} bytes, more than any answer to this request can be; not read further (is this URL a teacher?)")]
    TooLarge { url: String, limit: u64 },
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
    /// The downloaded head is not the one `/v1/info` names.
    #[error("{url}: the head file has SHA-256 {got} ({bytes} bytes), /v1/info names {expected} ({expected_bytes} bytes)")]
    HeadMismatch {
        url: String,
        expected: String,
        got: String,
        bytes: u64,
        expected_bytes: u64,
    },
    /// An answer carried another start-up probe hash than the one pinned: a replica (behind
    /// this URL) gives other numbers for the same model. Not retried.
    #[error(
        "{url}: the answer's {} is {got} where {expected} was pinned: a replica behind this URL \
         gives other numbers for the same model (another --dtype, device or scoring path?); \
         refusing to mix them",
        xdistill_shared::protocol::PROBE_HEADER
    )]
    ProbeChanged {
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
