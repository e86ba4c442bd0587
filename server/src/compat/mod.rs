//! The engine's faces for the APIs other trainers already speak (see `docs/protocol.md`):
//! vLLM's `/v1/models`, `/v1/completions`, `/tokenize`, `/detokenize` ([`vllm`]) and SGLang's
//! `/generate` ([`sglang`]). Each decodes its body into a [`ScoreSpec`](crate::validation::ScoreSpec),
//! runs the one engine (same batcher, cache, limits and auth as `/topk_logits`) and encodes the
//! answer in that API's shape. Unknown fields are accepted and ignored, as those servers do.
//! Bodies are decoded into typed requests whose inputs stay raw JSON until `admit` has
//! counted them against the limits: nothing is tokenized or copied before it is admitted.

mod admit;
pub mod sglang;
pub mod vllm;

use crate::body::{error_response, read_body, require_map};
use crate::error::ApiError;
use crate::scoring::NextToken;
use crate::state::AppState;
use crate::vocab::Vocab;
use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::sync::Arc;
use xdistill_shared::codec::Format;

/// Paths of the compatible routes (for metrics labels).
pub const ROUTES: &[&str] = &[
    "/v1/models",
    "/v1/completions",
    "/tokenize",
    "/detokenize",
    "/generate",
];

/// The compatible routes, merged into the main router (auth and metrics layers included).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/models", get(vllm::models))
        .route("/v1/completions", post(vllm::completions))
        .route("/tokenize", post(vllm::tokenize))
        .route("/detokenize", post(vllm::detokenize))
        .route("/generate", post(sglang::generate))
}

/// `Ok(response)` or the error's response (one error shape on every route).
fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(error_response)
}

/// Reads a JSON body (these APIs speak only JSON); [`decode`] then reads its fields.
async fn read_json(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Vec<u8>, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let mime = ct.to_str().unwrap_or("").split(';').next().unwrap_or("");
        let mime = mime.trim();
        if !mime.is_empty() && !mime.eq_ignore_ascii_case(xdistill_shared::codec::JSON) {
            return Err(ApiError::UnsupportedMediaType(mime.to_string()));
        }
    }
    read_body(st, headers, body).await
}

/// The request's fields, borrowed from `bytes`: a JSON object with named fields (a positional
/// array is refused), its large inputs left as raw JSON for [`admit`] to count.
fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    require_map(Format::Json, bytes)?;
    serde_json::from_slice(bytes).map_err(|e| ApiError::Malformed(format!("invalid JSON: {e}")))
}

/// `messages` (chat) is refused on every route, whether or not a prompt comes with it.
fn refuse_messages(messages: Option<&RawValue>) -> Result<(), ApiError> {
    match messages {
        Some(_) => Err(ApiError::unsupported(
            "messages",
            "chat messages are not supported (no chat template): send `prompt`",
        )),
        None => Ok(()),
    }
}

/// A JSON answer from already-encoded bytes.
fn json_bytes(body: Vec<u8>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(xdistill_shared::codec::JSON),
        )],
        body,
    )
        .into_response()
}

/// Encodes `value` as JSON off the async threads ([`crate::encode::off_thread`]).
async fn encode_json<T: serde::Serialize + Send + 'static>(
    st: &AppState,
    value: T,
) -> Result<Response, ApiError> {
    let bytes = crate::encode::off_thread(&st.metrics, move || serde_json::to_vec(&value)).await?;
    Ok(json_bytes(bytes))
}

/// One input of a batch: token ids, or text for the teacher's tokenizer.
#[derive(Debug, Clone, PartialEq)]
enum Input {
    Ids(Vec<u32>),
    Text(String),
}

/// Inputs as these APIs accept them: one (`[ids]`, `"text"`) or a batch (`[[ids], ...]`,
/// `["text", ...]`). `batch` says which, since a single input gets a single answer in SGLang.
#[derive(Debug, Clone, PartialEq)]
struct Inputs {
    items: Vec<Input>,
    batch: bool,
}

/// Token ids of every input (text is tokenized off the async threads).
async fn tokenize_inputs(
    vocab: &Arc<Vocab>,
    inputs: Inputs,
    add_special: bool,
) -> Result<Vec<Vec<u32>>, ApiError> {
    if inputs.items.iter().all(|i| matches!(i, Input::Ids(_))) {
        return Ok(inputs
            .items
            .into_iter()
            .map(|i| match i {
                Input::Ids(ids) => ids,
                Input::Text(_) => Vec::new(),
            })
            .collect());
    }
    let vocab = vocab.clone();
    tokio::task::spawn_blocking(move || {
        inputs
            .items
            .into_iter()
            .map(|i| match i {
                Input::Ids(ids) => Ok(ids),
                Input::Text(t) => vocab.encode(&t, add_special).map_err(ApiError::Internal),
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
}

/// Temperature as both APIs take it: absent = 1; 0 = greedy next token and unscaled log-probs;
/// otherwise it divides the logits. Returns (the scores' temperature, greedy?).
fn temperature_of(t: Option<f64>, field: &str) -> Result<(f32, bool), ApiError> {
    match t {
        None => Ok((1.0, false)),
        Some(0.0) => Ok((1.0, true)),
        Some(t) if t.is_finite() && t > 0.0 && (t as f32) > 0.0 => Ok((t as f32, false)),
        Some(t) => Err(ApiError::invalid(
            field,
            format!("temperature must be finite and >= 0, got {t}"),
        )),
    }
}

/// How the one generated token (`max_tokens: 1`) is chosen. Unseeded draws take a seed made from
/// the inputs, so equal requests get equal answers (and share cache entries).
fn next_token_mode(greedy: bool, seed: Option<u64>, sequences: &[Vec<u32>]) -> NextToken {
    if greedy {
        return NextToken::Greedy;
    }
    let seed = seed.unwrap_or_else(|| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        sequences.hash(&mut h);
        h.finish()
    });
    NextToken::Sample { seed }
}

/// vLLM sends -inf log-probs as -9999.0 (JSON has no infinity); never NaN.
fn wire_logprob(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// Seconds since the Unix epoch (`created`).
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A request id like vLLM's `cmpl-…`.
fn request_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:x}{n:06x}", unix_now())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_zero_is_greedy_and_unscaled() {
        assert_eq!(temperature_of(None, "t").unwrap(), (1.0, false));
        assert_eq!(temperature_of(Some(0.0), "t").unwrap(), (1.0, true));
        assert_eq!(temperature_of(Some(0.5), "t").unwrap(), (0.5, false));
        assert!(temperature_of(Some(-1.0), "t").is_err());
        assert!(temperature_of(Some(f64::NAN), "t").is_err());
        assert!(temperature_of(Some(1e-300), "t").is_err());
    }

    #[test]
    fn unseeded_draws_depend_on_the_inputs_only() {
        let a = next_token_mode(false, None, &[vec![1, 2]]);
        assert_eq!(a, next_token_mode(false, None, &[vec![1, 2]]));
        assert_ne!(a, next_token_mode(false, None, &[vec![1, 3]]));
        assert_eq!(
            next_token_mode(false, Some(9), &[vec![1]]),
            NextToken::Sample { seed: 9 }
        );
        assert_eq!(next_token_mode(true, Some(9), &[]), NextToken::Greedy);
        assert_eq!(wire_logprob(f32::NEG_INFINITY), -9999.0);
        assert_eq!(wire_logprob(-1.5), -1.5);
    }
}
