//! Optimisation: AdamW with f32 master weights, learning-rate schedules, global gradient-norm
//! clipping and gradient accumulation over micro-batches.

pub mod accumulate;
pub mod adamw;
pub mod clip;
pub mod schedule;

pub use accumulate::GradAccumulator;
pub use adamw::{AdamW, AdamWConfig, OptimizerState};
pub use clip::{clip_grad_norm, grad_norm};
pub use schedule::ScheduleConfig;

/// Errors of the optimiser: a state that does not fit the parameters, or candle.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("optimizer state: {0}")]
    State(String),
    #[error("invalid optimizer config `{field}`: {message}")]
    Config {
        field: &'static str,
        message: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, OptimError>;
