//! Answers encoded off the async threads (an answer with many positions takes milliseconds to
//! encode), each encoding timed into `xdistill_response_encode_duration_seconds`: the phase
//! between the worker's scores and the bytes on the wire.

use crate::error::ApiError;
use crate::metrics::Metrics;
use std::time::Instant;

/// Runs `encode` on a blocking thread and records its time in `metrics`.
pub async fn off_thread<T, E>(
    metrics: &Metrics,
    encode: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, ApiError>
where
    T: Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let (out, seconds) = tokio::task::spawn_blocking(move || {
        let t0 = Instant::now();
        let out = encode();
        (out, t0.elapsed().as_secs_f64())
    })
    .await
    .map_err(|e| ApiError::Internal(format!("encoder task failed: {e}")))?;
    metrics.response_encode_duration.observe(seconds);
    out.map_err(|e| ApiError::Internal(format!("encoding the answer: {e}")))
}
