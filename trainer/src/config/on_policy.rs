//! `[on_policy]`: used by `trainer on-policy` only.

use serde::{Deserialize, Serialize};

/// `[on_policy]`: the student samples completions of the data's prompts and the teacher scores them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnPolicyConfig {
    /// Share of steps that are on-policy (drawn per step from the run's seeded RNG); the others
    /// train off-policy on the data's own prompt + completion (TRL GKD's λ).
    pub lambda: f64,
    /// Also train on the prompt's positions (scored by the teacher); default: completion only.
    pub include_prompt: bool,
    /// Sampling settings (see docs/evaluation.md).
    pub generation: crate::generate::GenerationConfig,
}

impl Default for OnPolicyConfig {
    fn default() -> Self {
        OnPolicyConfig {
            lambda: 1.0,
            include_prompt: false,
            generation: crate::generate::GenerationConfig {
                max_new_tokens: 64,
                stop_strings: vec!["\n\n".into(), "\nQ:".into()],
                ..Default::default()
            },
        }
    }
}
