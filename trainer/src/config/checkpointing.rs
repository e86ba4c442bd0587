//! `[checkpointing]`: where the run writes and what it keeps.

use super::{invalid, ConfigError, Validate};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::path::PathBuf;

/// `[checkpointing]`: where the run writes and what it keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointingConfig {
    pub enabled: bool,
    /// The run's output directory: `step_N/`, `final/`, `metrics.jsonl` (`--output` overrides).
    pub checkpoint_dir: PathBuf,
    /// Save every this many steps (the last step is always saved when enabled).
    pub save_period: u64,
    /// Keep this many checkpoints; `None` (TOML `"all"`): every one. The newest is always kept.
    #[serde(with = "keep_top_k")]
    pub keep_top_k: Option<usize>,
    /// Rank checkpoints by this metric (from `trainer_state.json`'s `metrics`) instead of by step.
    pub metric_name: Option<String>,
    pub higher_is_better: bool,
    /// With `--resume`, start over from step 0 on purpose when nothing valid is left to resume
    /// from although a previous run left traces (`step_N.corrupt/`, a non-empty
    /// `metrics.jsonl`); without it such a resume is an error. The old `metrics.jsonl` is set
    /// aside, never appended to (`--start-fresh`, or `--set checkpointing.start_fresh=true`).
    pub start_fresh: bool,
    /// Where what the trainer derives from its teachers is kept: their tokenizers, the
    /// projection maps between tokenizers, their LM heads (`transport = "hidden"`), each under
    /// a name made of its content's hash. Absent: `checkpoint_dir`. Runs that share one (a
    /// sweep, a resumed series) build and download each of them once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
}

impl Default for CheckpointingConfig {
    fn default() -> Self {
        CheckpointingConfig {
            enabled: true,
            checkpoint_dir: PathBuf::from("runs/off_policy"),
            save_period: 100,
            keep_top_k: Some(3),
            metric_name: None,
            higher_is_better: false,
            start_fresh: false,
            cache_dir: None,
        }
    }
}

impl Validate for CheckpointingConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        let c = self;
        let key = |name: &str| format!("{at}.{name}");
        if c.checkpoint_dir.as_os_str().is_empty() {
            return Err(invalid(&key("checkpoint_dir"), "must not be empty"));
        }
        if c.cache_dir
            .as_ref()
            .is_some_and(|d| d.as_os_str().is_empty())
        {
            return Err(invalid(
                &key("cache_dir"),
                "must not be empty (leave it out for checkpoint_dir)",
            ));
        }
        if c.enabled && c.save_period == 0 {
            return Err(invalid(&key("save_period"), "must be at least 1"));
        }
        if c.keep_top_k == Some(0) {
            return Err(invalid(
                &key("keep_top_k"),
                "must be at least 1 (or \"all\" to keep every checkpoint)",
            ));
        }
        Ok(())
    }
}

/// `checkpointing.keep_top_k`: a count, or `"all"` for `None` (TOML has no null, and an absent
/// key is the default, 3).
mod keep_top_k {
    use super::*;

    const WANT: &str = "checkpointing.keep_top_k must be a number of checkpoints or \"all\"";

    pub fn serialize<S: Serializer>(v: &Option<usize>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u64(*n as u64),
            None => s.serialize_str("all"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
        super::super::number_or_word(d, "all", WANT)
    }
}
