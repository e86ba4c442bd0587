//! Learning-rate schedules: linear warmup, then constant, linear or cosine decay to `min_lr`.
//!
//! A pure function of the update index `step` (0 for the first update): warmup gives
//! `peak·(step + 1)/warmup` for `step < warmup`, so the first update is not wasted at lr 0 and
//! update `warmup − 1` reaches the peak; then `progress = (step − warmup)/(total − warmup)`
//! (clamped to [0, 1]) drives the decay, reaching `min_lr` at `step = total`.

use serde::{Deserialize, Serialize};

use super::{OptimError, Result};

/// Schedule shape, TOML e.g. `schedule = { type = "cosine", warmup_steps = 100, min_lr = 1e-6 }`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ScheduleConfig {
    /// Warmup, then the peak learning rate.
    Constant {
        #[serde(default)]
        warmup_steps: usize,
    },
    /// Warmup, then a straight line from the peak to `min_lr`.
    Linear {
        #[serde(default)]
        warmup_steps: usize,
        #[serde(default)]
        min_lr: f64,
    },
    /// Warmup, then half a cosine from the peak to `min_lr`.
    Cosine {
        #[serde(default)]
        warmup_steps: usize,
        #[serde(default)]
        min_lr: f64,
    },
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        ScheduleConfig::Cosine {
            warmup_steps: 0,
            min_lr: 0.0,
        }
    }
}

impl ScheduleConfig {
    /// `min_lr` must lie in `[0, peak_lr]`.
    pub fn validate(&self, peak_lr: f64) -> Result<()> {
        match *self {
            ScheduleConfig::Linear { min_lr, .. } | ScheduleConfig::Cosine { min_lr, .. }
                if !(min_lr.is_finite() && (0.0..=peak_lr).contains(&min_lr)) =>
            {
                Err(OptimError::Config {
                    field: "schedule.min_lr",
                    message: format!("must be in [0, lr = {peak_lr}], got {min_lr}"),
                })
            }
            _ => Ok(()),
        }
    }

    /// The learning rate of update `step` (0-based) of a run of `total_steps` updates.
    pub fn lr(&self, peak_lr: f64, total_steps: usize, step: usize) -> f64 {
        let (warmup, min_lr) = match *self {
            ScheduleConfig::Constant { warmup_steps } => (warmup_steps, peak_lr),
            ScheduleConfig::Linear {
                warmup_steps,
                min_lr,
            }
            | ScheduleConfig::Cosine {
                warmup_steps,
                min_lr,
            } => (warmup_steps, min_lr),
        };
        if step < warmup {
            return peak_lr * (step + 1) as f64 / warmup as f64;
        }
        let progress = if total_steps > warmup {
            ((step - warmup) as f64 / (total_steps - warmup) as f64).min(1.0)
        } else {
            1.0
        };
        let frac = match self {
            ScheduleConfig::Constant { .. } => 1.0,
            ScheduleConfig::Linear { .. } => 1.0 - progress,
            ScheduleConfig::Cosine { .. } => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        min_lr + (peak_lr - min_lr) * frac
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-15 + 1e-12 * b.abs(), "{a} vs {b}");
    }

    #[test]
    fn cosine_values_at_known_steps() {
        // peak 1e-3, min 1e-5, 10 warmup updates, 110 in all: the decay spans 100 updates.
        let s = ScheduleConfig::Cosine {
            warmup_steps: 10,
            min_lr: 1e-5,
        };
        let lr = |step| s.lr(1e-3, 110, step);
        close(lr(0), 1e-4); // 1/10 of the peak
        close(lr(4), 5e-4); // 5/10
        close(lr(9), 1e-3); // end of warmup = peak
        close(lr(10), 1e-3); // progress 0: cos 0 = 1
        close(lr(60), 1e-5 + (1e-3 - 1e-5) * 0.5); // progress 1/2: cos(π/2) = 0
                                                   // progress 1/4: (1 + cos(π/4))/2 = (1 + √2/2)/2
        close(lr(35), 1e-5 + (1e-3 - 1e-5) * (1.0 + 0.5f64.sqrt()) / 2.0);
        close(lr(110), 1e-5);
        close(lr(500), 1e-5);
        // Monotone non-increasing after warmup.
        assert!((10..110).all(|t| lr(t + 1) <= lr(t)));
    }

    #[test]
    fn linear_and_constant_shapes() {
        let l = ScheduleConfig::Linear {
            warmup_steps: 0,
            min_lr: 0.0,
        };
        close(l.lr(2.0, 100, 0), 2.0);
        close(l.lr(2.0, 100, 25), 1.5);
        close(l.lr(2.0, 100, 100), 0.0);
        let c = ScheduleConfig::Constant { warmup_steps: 4 };
        close(c.lr(2.0, 100, 1), 1.0);
        close(c.lr(2.0, 100, 99), 2.0);
    }

    #[test]
    fn parses_from_toml_and_validates() {
        #[derive(Deserialize)]
        struct W {
            schedule: ScheduleConfig,
        }
        let w: W =
            toml::from_str("schedule = { type = \"cosine\", warmup_steps = 100, min_lr = 1e-6 }")
                .unwrap();
        assert_eq!(
            w.schedule,
            ScheduleConfig::Cosine {
                warmup_steps: 100,
                min_lr: 1e-6
            }
        );
        assert!(w.schedule.validate(1e-4).is_ok());
        assert!(w.schedule.validate(1e-7).is_err());
        assert!(toml::from_str::<W>("schedule = { type = \"cosine\", warmup = 1 }").is_err());
    }
}
