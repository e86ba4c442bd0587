//! Optimisation: AdamW with f32 master weights, learning-rate schedules, global gradient-norm
//! clipping and gradient accumulation over micro-batches.

pub mod accumulate;
pub mod adamw;
pub mod clip;
pub mod schedule;

pub use accumulate::{GradAccumulator, Grads};
pub use adamw::{AdamW, AdamWConfig, OptimizerState};
pub use clip::{clip_grad_norm, clip_scale, clip_to, grad_norm, norm_of, sq_norms};
pub use schedule::ScheduleConfig;

fn default_max_grad_norm() -> f64 {
    1.0
}

/// The `[optim]` section of a run config:
///
/// ```toml
/// [optim]
/// adamw = { lr = 1e-4, weight_decay = 0.01 }
/// schedule = { type = "cosine", warmup_steps = 100, min_lr = 1e-6 }
/// max_grad_norm = 1.0
/// ```
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    #[serde(default)]
    pub adamw: AdamWConfig,
    #[serde(default)]
    pub schedule: ScheduleConfig,
    /// Global gradient-norm limit (default 1.0); 0 = no clipping (log the norm anyway).
    #[serde(default = "default_max_grad_norm")]
    pub max_grad_norm: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            adamw: AdamWConfig::default(),
            schedule: ScheduleConfig::default(),
            max_grad_norm: default_max_grad_norm(),
        }
    }
}

impl OptimConfig {
    pub fn validate(&self) -> Result<()> {
        self.adamw.validate()?;
        self.schedule.validate(self.adamw.lr)?;
        let m = self.max_grad_norm;
        if !(m.is_finite() && m >= 0.0) {
            return Err(OptimError::Config {
                field: "max_grad_norm",
                message: format!("must be >= 0 (0 = no clipping), got {m}"),
            });
        }
        Ok(())
    }

    /// The learning rate of update `step` (0-based) of a run of `total_steps` updates.
    pub fn lr(&self, total_steps: usize, step: usize) -> f64 {
        self.schedule.lr(self.adamw.lr, total_steps, step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optim_section_parses_with_defaults() {
        #[derive(serde::Deserialize)]
        struct W {
            optim: OptimConfig,
        }
        let w: W = toml::from_str(
            "[optim]\nadamw = { lr = 3e-4, weight_decay = 0.0 }\n\
             schedule = { type = \"linear\", warmup_steps = 10 }\n",
        )
        .unwrap();
        assert_eq!(w.optim.adamw.lr, 3e-4);
        assert_eq!(w.optim.adamw.beta2, 0.999);
        assert_eq!(w.optim.max_grad_norm, 1.0);
        w.optim.validate().unwrap();
        // 10 warmup updates of 100: update 4 gets 5/10 of the peak.
        assert!((w.optim.lr(100, 4) - 1.5e-4).abs() < 1e-18);
        assert!(toml::from_str::<W>("[optim]\nlr = 1e-4\n").is_err());
        let bad: W = toml::from_str("[optim]\nmax_grad_norm = -1.0\n").unwrap();
        assert!(bad.optim.validate().is_err());
    }
}

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
