//! `[logger]`: console output.

use super::{invalid, ConfigError, Validate};
use serde::{Deserialize, Serialize};

/// `[logger]`: console output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggerConfig {
    /// Write a log line every this many steps (also when the progress bar is hidden).
    pub log_every: u64,
    /// Show a progress bar (hidden anyway when stderr is not a terminal or `CI` is set).
    pub progress_bar: bool,
}

impl Default for LoggerConfig {
    fn default() -> Self {
        LoggerConfig {
            log_every: 10,
            progress_bar: true,
        }
    }
}

impl Validate for LoggerConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        if self.log_every == 0 {
            return Err(invalid(&format!("{at}.log_every"), "must be at least 1"));
        }
        Ok(())
    }
}
