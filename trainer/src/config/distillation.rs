//! `[distillation]`: the run's length, cadence and how several teachers combine.

use super::{invalid, ConfigError, Validate};
use serde::{Deserialize, Serialize};

/// `[distillation]`: the run's length and cadence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillationConfig {
    /// Records per optimizer step (global batch).
    pub num_prompts_per_step: usize,
    /// The run stops after this many steps or `max_num_epochs` epochs, whichever comes first.
    pub max_num_steps: u64,
    pub max_num_epochs: u64,
    /// Seeds data shuffling, the validation split and the trainer's RNG.
    pub seed: u64,
    /// Validate every this many steps (0: never, except at start/end).
    pub val_period: u64,
    pub val_at_start: bool,
    pub val_at_end: bool,
    /// Cap on validation records used per validation (absent: all).
    pub max_val_samples: Option<usize>,
    /// With several `[[teachers]]`: each record learns from the teacher it names (`route`), or
    /// from the weighted mixture of all of them (`ensemble`).
    pub teachers: TeacherMode,
}

/// How a student learns from several teachers (`distillation.teachers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TeacherMode {
    /// Each record from the teacher named by `data.teacher_field` (or `data.default_teacher`).
    #[default]
    Route,
    /// Every record from the weighted mixture of the teachers' distributions
    /// (docs/losses.md, "Ensembles").
    Ensemble,
}

impl Default for DistillationConfig {
    fn default() -> Self {
        DistillationConfig {
            num_prompts_per_step: 8,
            max_num_steps: 1000,
            max_num_epochs: 1,
            seed: 42,
            val_period: 0,
            val_at_start: false,
            val_at_end: false,
            max_val_samples: None,
            teachers: TeacherMode::Route,
        }
    }
}

impl Validate for DistillationConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        let r = self;
        let key = |name: &str| format!("{at}.{name}");
        if r.num_prompts_per_step == 0 {
            return Err(invalid(&key("num_prompts_per_step"), "must be at least 1"));
        }
        if r.max_num_steps == 0 {
            return Err(invalid(&key("max_num_steps"), "must be at least 1"));
        }
        if r.max_num_epochs == 0 {
            return Err(invalid(&key("max_num_epochs"), "must be at least 1"));
        }
        Ok(())
    }
}
