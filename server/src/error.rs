//! The one error type of the HTTP layer: each variant maps to a status, a JSON [`ErrorBody`]
//! and a short label reused in metrics.

use crate::scoring::ScoringError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use xdistill_shared::protocol::{ErrorBody, ErrorDetail};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The body is not valid JSON / MessagePack for the request type (incl. unknown fields).
    #[error("malformed body: {0}")]
    Malformed(String),
    /// A field has a value the server refuses; `field` names it (e.g. `sequences[3][17]`).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// The body did not arrive within `--body-timeout-secs`.
    #[error("the request body did not arrive within {0} s")]
    BodyTimeout(f64),
    /// The body arrives slower than `--min-body-rate`.
    #[error("the request body arrives too slowly: {received} bytes in {seconds:.1} s, under --min-body-rate {min_rate} bytes/s")]
    BodyTooSlow {
        received: usize,
        seconds: f64,
        min_rate: u64,
    },
    #[error("body larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// The request alone needs more tokens than the queue may ever hold.
    /// `field` is the route's name for its inputs (`sequences`, `prompt`, `input_ids`).
    #[error("request of {tokens} tokens exceeds --max-queue-tokens {limit}")]
    RequestTooLarge {
        field: String,
        tokens: usize,
        limit: usize,
    },
    /// More sequences than `--max-sequences` in one request.
    #[error("{sequences} sequences exceed --max-sequences {limit}; split the request")]
    TooManySequences {
        field: String,
        sequences: usize,
        limit: usize,
    },
    /// The answer, as the route encodes it, would exceed `--max-answer-bytes` (`what` says
    /// which estimate: "of scores", "of JSON").
    #[error("the answer would take {bytes} bytes {what}, over --max-answer-bytes {limit}; lower k or split the request")]
    AnswerTooLarge {
        field: String,
        bytes: usize,
        limit: usize,
        what: &'static str,
    },
    /// An input refused while it was read, before any work: more text or ids than any
    /// admissible request can hold, or a small field of outsized JSON.
    #[error("{field}: {message}")]
    InputTooLarge { field: String, message: String },
    #[error("queue full ({queued} of {limit} tokens admitted); retry later")]
    QueueFull {
        queued: usize,
        limit: usize,
        retry_after_s: u64,
    },
    #[error("unsupported content type {0:?}: send application/json or application/msgpack")]
    UnsupportedMediaType(String),
    /// A `Content-Encoding` the server does not decode (it decodes none).
    #[error("unsupported content encoding {0:?}: send the body uncompressed (identity)")]
    UnsupportedEncoding(String),
    /// The request asks for something this server does not do (e.g. `max_tokens: 2`: it
    /// scores, it does not generate), or over a limit phrased as vLLM phrases it.
    #[error("{field}: {message}")]
    Unsupported { field: String, message: String },
    /// A compatible route named a model this server does not serve.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("model is still loading")]
    NotReady,
    #[error("server is shutting down")]
    ShuttingDown,
    /// The client already holds `--max-connections-per-client` connections.
    #[error("this client address already has {limit} connections open (--max-connections-per-client); reuse them or retry later")]
    TooManyConnections { limit: usize },
    /// The model worker thread has ended: nothing can be scored until the server restarts.
    #[error("the model worker has stopped (the server log says why); this server cannot score until it is restarted")]
    WorkerStopped,
    #[error("no route {0}")]
    NotFound(String),
    /// The request line or headers could not be parsed (answered by the connection layer).
    #[error("the request line or headers could not be parsed")]
    BadRequestHead,
    /// A request head that breaks HTTP/1.1 framing rules (RFC 9112), e.g. no `Host` or
    /// `chunked` twice.
    #[error("{0}")]
    BadFraming(String),
    /// A transfer coding the server does not implement (RFC 9112 §6.1: 501).
    #[error("transfer coding {0:?} is not implemented: send the body with Content-Length or as a lone `chunked`")]
    TransferCodingNotImplemented(String),
    #[error("the request target is too long")]
    UriTooLong,
    #[error("the request headers are too large")]
    HeadersTooLarge,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("internal error: {0}")]
    Internal(String),
    /// The hidden-state and head routes are not available for this model (the message says
    /// why, e.g. a head dtype with no wire format).
    #[error("the hidden-state and head routes are not available for this model: {0}")]
    NoHead(String),
    /// `GET /v1/head` with a `Range` that starts past the end of the head file (RFC 9110 §15.5.17).
    #[error("the range {range:?} lies outside the head file's {len} bytes")]
    RangeNotSatisfiable { range: String, len: u64 },
    /// A sequence got no scores: the request's fault (4xx) or the model's or the server's
    /// (5xx); [`ApiError::status`] and [`ApiError::label`] tell them apart.
    #[error("{0}")]
    Scoring(ScoringError),
}

impl ApiError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn unsupported(field: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Unsupported {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The error a status written by the connection layer itself stands for (hyper answers
    /// unparsable heads on its own, with an empty body; [`crate::accept`] gives them this one's).
    pub fn of_connection_status(status: u16) -> Option<ApiError> {
        match status {
            400 => Some(ApiError::BadRequestHead),
            414 => Some(ApiError::UriTooLong),
            431 => Some(ApiError::HeadersTooLarge),
            _ => None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Malformed(_)
            | ApiError::Unsupported { .. }
            | ApiError::BadRequestHead
            | ApiError::BadFraming(_) => StatusCode::BAD_REQUEST,
            ApiError::TransferCodingNotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::UriTooLong => StatusCode::URI_TOO_LONG,
            ApiError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BodyTimeout(_) | ApiError::BodyTooSlow { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::PayloadTooLarge { .. }
            | ApiError::InputTooLarge { .. }
            | ApiError::RequestTooLarge { .. }
            | ApiError::TooManySequences { .. }
            | ApiError::AnswerTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::QueueFull { .. }
            | ApiError::NotReady
            | ApiError::TooManyConnections { .. }
            | ApiError::ShuttingDown
            | ApiError::WorkerStopped => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::UnsupportedMediaType(_) | ApiError::UnsupportedEncoding(_) => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::NoHead(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::RangeNotSatisfiable { .. } => StatusCode::RANGE_NOT_SATISFIABLE,
            ApiError::Scoring(e) => match e {
                // The request's: the same request fails the same way.
                ScoringError::TemperatureOverflow { .. } => StatusCode::UNPROCESSABLE_ENTITY,
                ScoringError::WorkerStopped => StatusCode::SERVICE_UNAVAILABLE,
                // The model's or the server's.
                ScoringError::NonFiniteLogits { .. }
                | ScoringError::NonFiniteHidden { .. }
                | ScoringError::Forward(_)
                | ScoringError::Panicked(_) => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }

    /// Machine-readable class: the `error.type` of the body and the metrics label.
    pub fn label(&self) -> &'static str {
        match self {
            ApiError::Malformed(_) => "malformed_body",
            ApiError::Unsupported { .. } => "unsupported_request",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::BodyTimeout(_) => "body_timeout",
            ApiError::BodyTooSlow { .. } => "body_too_slow",
            ApiError::Invalid { .. } => "invalid_request",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::RequestTooLarge { .. } => "request_too_large",
            ApiError::TooManySequences { .. } => "too_many_sequences",
            ApiError::AnswerTooLarge { .. } => "answer_too_large",
            ApiError::InputTooLarge { .. } => "input_too_large",
            ApiError::QueueFull { .. } => "queue_full",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::UnsupportedEncoding(_) => "unsupported_encoding",
            ApiError::Unauthorized => "unauthorized",
            ApiError::NotReady => "not_ready",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::TooManyConnections { .. } => "too_many_connections",
            ApiError::WorkerStopped => "worker_stopped",
            ApiError::NotFound(_) => "not_found",
            ApiError::BadRequestHead => "malformed_request",
            ApiError::BadFraming(_) => "bad_framing",
            ApiError::TransferCodingNotImplemented(_) => "transfer_coding_not_implemented",
            ApiError::UriTooLong => "uri_too_long",
            ApiError::HeadersTooLarge => "headers_too_large",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::Internal(_) => "internal_error",
            ApiError::NoHead(_) => "head_unavailable",
            ApiError::RangeNotSatisfiable { .. } => "range_not_satisfiable",
            ApiError::Scoring(e) => match e {
                ScoringError::TemperatureOverflow { .. } => "temperature_overflow",
                ScoringError::NonFiniteLogits { .. } => "non_finite_logits",
                ScoringError::NonFiniteHidden { .. } => "non_finite_hidden",
                ScoringError::Forward(_) => "forward_failed",
                ScoringError::Panicked(_) => "worker_panicked",
                ScoringError::WorkerStopped => "worker_stopped",
            },
        }
    }

    pub fn body(&self) -> ErrorBody {
        let field = match self {
            ApiError::Invalid { field, .. }
            | ApiError::Unsupported { field, .. }
            | ApiError::InputTooLarge { field, .. }
            | ApiError::RequestTooLarge { field, .. }
            | ApiError::TooManySequences { field, .. }
            | ApiError::AnswerTooLarge { field, .. } => Some(field.clone()),
            ApiError::ModelNotFound(_) => Some("model".into()),
            ApiError::Scoring(ScoringError::TemperatureOverflow { .. }) => {
                Some("temperature".into())
            }
            _ => None,
        };
        let message = match self {
            ApiError::Invalid { message, .. }
            | ApiError::Unsupported { message, .. }
            | ApiError::InputTooLarge { message, .. } => message.clone(),
            other => other.to_string(),
        };
        ErrorBody {
            error: ErrorDetail {
                kind: self.label().into(),
                message,
                param: field.clone(),
                field,
                code: Some(self.status().as_u16()),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = serde_json::to_vec(&self.body()).unwrap_or_else(|_| b"{}".to_vec());
        let mut resp = (status, body).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(xdistill_shared::codec::JSON),
        );
        match &self {
            ApiError::QueueFull { retry_after_s, .. } => {
                h.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
            }
            ApiError::NotReady | ApiError::ShuttingDown => {
                h.insert(header::RETRY_AFTER, HeaderValue::from(1u64));
            }
            ApiError::Unauthorized => {
                h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            ApiError::BadFraming(_)
            | ApiError::TransferCodingNotImplemented(_)
            | ApiError::BodyTimeout(_)
            | ApiError::BodyTooSlow { .. } => {
                // The body's framing cannot be trusted: nothing more is read on this connection.
                h.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            ApiError::RangeNotSatisfiable { len, .. } => {
                // RFC 9110 §14.4: the length the range was judged against.
                if let Ok(v) = HeaderValue::from_str(&format!("bytes */{len}")) {
                    h.insert(header::CONTENT_RANGE, v);
                }
            }
            ApiError::UnsupportedEncoding(_) => {
                // RFC 7694: the codings the server accepts.
                h.insert(
                    header::ACCEPT_ENCODING,
                    HeaderValue::from_static("identity"),
                );
            }
            _ => {}
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies() {
        let e = ApiError::invalid("sequences[3][17]", "id 999999 >= vocab size 1000");
        assert_eq!(e.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let b = e.body();
        assert_eq!(b.error.kind, "invalid_request");
        assert_eq!(b.error.field.as_deref(), Some("sequences[3][17]"));
        // The OpenAI names of the same facts.
        assert_eq!(b.error.param.as_deref(), Some("sequences[3][17]"));
        assert_eq!(b.error.code, Some(422));
        let json = serde_json::to_value(ApiError::Unauthorized.body()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"error": {"type": "unauthorized",
                "message": "missing or wrong bearer token", "param": null, "code": 401}})
        );
        let u = ApiError::unsupported("max_tokens", "at most 1");
        assert_eq!(u.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            ApiError::ModelNotFound("x".into()).status(),
            StatusCode::NOT_FOUND
        );
        let q = ApiError::QueueFull {
            queued: 10,
            limit: 10,
            retry_after_s: 2,
        }
        .into_response();
        assert_eq!(q.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(q.headers()[header::RETRY_AFTER], "2");
        let h = ApiError::NoHead("a head of U8".into());
        assert_eq!(
            (h.status(), h.label()),
            (StatusCode::NOT_IMPLEMENTED, "head_unavailable")
        );
    }

    /// A scoring failure the request caused is a 4xx naming the field; the model's or the
    /// server's are 5xx (503 once the worker is gone); each has its own label.
    #[test]
    fn scoring_failures_are_told_apart() {
        let client = ApiError::Scoring(ScoringError::TemperatureOverflow {
            temperature: 1e-45,
            field: "logsumexp",
            position: 3,
        });
        assert_eq!(client.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let b = client.body();
        assert_eq!(b.error.kind, "temperature_overflow");
        assert_eq!(b.error.field.as_deref(), Some("temperature"));
        assert!(b
            .error
            .message
            .starts_with("temperature 1e-45 overflows the scaled logits"));
        for (e, status, label) in [
            (
                ScoringError::NonFiniteLogits {
                    id: 7,
                    position: 1,
                    value: f32::NAN,
                },
                500,
                "non_finite_logits",
            ),
            (
                ScoringError::NonFiniteHidden {
                    element: 3,
                    position: 2,
                    value: f32::INFINITY,
                },
                500,
                "non_finite_hidden",
            ),
            (ScoringError::Forward("oom".into()), 500, "forward_failed"),
            (
                ScoringError::Panicked("boom".into()),
                500,
                "worker_panicked",
            ),
            (ScoringError::WorkerStopped, 503, "worker_stopped"),
        ] {
            let e = ApiError::Scoring(e);
            assert_eq!((e.status().as_u16(), e.label()), (status, label), "{e}");
            assert_eq!(e.body().error.field, None);
        }
    }
}
