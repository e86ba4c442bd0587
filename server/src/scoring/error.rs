//! Why one sequence got no scores. Each cause says whose fault it is: the HTTP layer maps it,
//! in one place ([`crate::error::ApiError::status`] and [`crate::error::ApiError::label`]), to
//! a 4xx for the client's and a 5xx for the server's, with its own label in the metrics.

/// Why one sequence got no scores (the message names the cause).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScoringError {
    /// The client's: the request's temperature is so small that the scaled logits `z / τ`, or
    /// their spread, overflow an f32 (the logits themselves are finite).
    #[error(
        "temperature {temperature:?} overflows the scaled logits \
         (non-finite {field} at position {position})"
    )]
    TemperatureOverflow {
        temperature: f32,
        /// The first result field that came out non-finite.
        field: &'static str,
        position: usize,
    },
    /// The model's: its logits are not finite.
    #[error(
        "the model's logits are not finite (logit of id {id} at position {position} is {value})"
    )]
    NonFiniteLogits {
        id: usize,
        position: usize,
        value: f32,
    },
    /// The model's: a hidden state `/hidden_states` would return is not finite.
    #[error(
        "the model's hidden state is not finite (element {element} at position {position} is {value})"
    )]
    NonFiniteHidden {
        element: usize,
        position: usize,
        value: f32,
    },
    /// The model (or a tensor op around it) failed.
    #[error("forward failed: {0}")]
    Forward(String),
    /// The worker panicked while running the sequence (it keeps serving).
    #[error("worker panicked: {0}")]
    Panicked(String),
    /// The worker thread ended before the sequence ran.
    #[error("model worker stopped")]
    WorkerStopped,
}

impl From<candle_core::Error> for ScoringError {
    fn from(e: candle_core::Error) -> Self {
        ScoringError::Forward(e.to_string())
    }
}
