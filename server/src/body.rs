//! A request's body read within its limits (size, time, pace, encoding, a map of named
//! fields), and an [`ApiError`] as a response with its metrics label: what every route shares.

use crate::error::ApiError;
use crate::state::{AppState, BodyPace};
use axum::body::Body;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use xdistill_shared::codec::Format;

/// The error label of a response, for metrics (set by [`error_response`]).
#[derive(Clone, Copy)]
pub(crate) struct Outcome(pub(crate) &'static str);

pub(crate) fn error_response(e: ApiError) -> Response {
    let label = e.label();
    let mut r = e.into_response();
    r.extensions_mut().insert(Outcome(label));
    r
}

/// Reads the body within `--body-timeout-secs` (408 beyond) and `--max-body-bytes` (413). A
/// `Content-Encoding` other than `identity` is refused with 415 before the body is read: the
/// server decodes none, and would otherwise parse compressed bytes as JSON.
pub(crate) async fn read_body(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Vec<u8>, ApiError> {
    for v in headers.get_all(header::CONTENT_ENCODING) {
        let v = String::from_utf8_lossy(v.as_bytes());
        for coding in v.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if !coding.eq_ignore_ascii_case("identity") {
                return Err(ApiError::UnsupportedEncoding(coding.to_string()));
            }
        }
    }
    let t = st.config.body_timeout;
    let within = read_body_within(headers, body, st.config.max_body_bytes, st.config.body_pace);
    tokio::time::timeout(t, within)
        .await
        .map_err(|_| ApiError::BodyTimeout(t.as_secs_f64()))?
}

/// Reads at most `limit` bytes of body; more is a 413, refused on the declared Content-Length
/// before a byte of the body is read. The buffer grows with what arrives, never with what is
/// declared: a client that declares 64 MiB and sends one byte costs one byte, not an
/// allocation of 64 MiB that thousands of such connections would multiply.
///
/// Each chunk must arrive while the body's average rate since its start is at least
/// `pace.min_rate` (after `pace.grace`): a trickling client is answered 408 in seconds.
async fn read_body_within(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    pace: BodyPace,
) -> Result<Vec<u8>, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let mut buf = Vec::new();
    let mut stream = body.into_data_stream();
    let start = tokio::time::Instant::now();
    loop {
        let next = match pace.allowed(buf.len()) {
            None => stream.next().await,
            Some(allowed) => tokio::time::timeout_at(start + allowed, stream.next())
                .await
                .map_err(|_| ApiError::BodyTooSlow {
                    received: buf.len(),
                    seconds: start.elapsed().as_secs_f64(),
                    min_rate: pace.min_rate,
                })?,
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| ApiError::Malformed(format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

/// A request is a map of named fields: a JSON object or a MessagePack map. A positional array
/// (`[[[1,2,3]],2]`, which serde would otherwise take as the fields in order) is refused, and an
/// empty body or a `null` one is named as such.
pub(crate) fn require_map(format: Format, bytes: &[u8]) -> Result<(), ApiError> {
    let (what, first) = match format {
        Format::Json => (
            "JSON object",
            bytes.iter().find(|b| !b.is_ascii_whitespace()),
        ),
        Format::Msgpack => ("MessagePack map", bytes.first()),
    };
    let is_map = match (format, first) {
        (_, None) => {
            return Err(ApiError::Malformed(format!(
                "the request body is empty: expected a {what} with named fields"
            )))
        }
        (Format::Json, Some(&b)) => b == b'{',
        // fixmap, map 16, map 32.
        (Format::Msgpack, Some(&b)) => (0x80..=0x8f).contains(&b) || b == 0xde || b == 0xdf,
    };
    let null = match format {
        Format::Json => bytes.trim_ascii() == b"null",
        Format::Msgpack => bytes == [0xc0],
    };
    if is_map {
        Ok(())
    } else if null {
        Err(ApiError::Malformed(format!(
            "the request body is {}: expected a {what} with named fields",
            match format {
                Format::Json => "JSON null",
                Format::Msgpack => "MessagePack nil",
            }
        )))
    } else {
        Err(ApiError::Malformed(format!(
            "expected a {what} with named fields (positional arrays are not accepted)"
        )))
    }
}
