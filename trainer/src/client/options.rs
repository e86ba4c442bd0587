//! Connection and retry settings of a teacher client, from a `[teacher]` / `[[teachers]]` entry.

use crate::config::{ConfigError, TeacherConfig};
use std::time::Duration;

/// Connection and retry settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientOptions {
    /// Whole-request timeout (sending, teacher compute, receiving).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// Total time one call may spend retrying before it fails.
    pub max_wait: Duration,
    /// Optional cap on attempts per call.
    pub max_attempts: Option<u32>,
    /// First retry delay; doubles per failure up to `backoff_max` (then ±50 % jitter).
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Sent as `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions::from_teacher_config(&TeacherConfig::default(), None)
    }
}

impl ClientOptions {
    fn from_teacher_config(t: &TeacherConfig, api_key: Option<String>) -> ClientOptions {
        ClientOptions {
            timeout: t.timeout(),
            connect_timeout: t.connect_timeout(),
            max_wait: t.max_wait(),
            max_attempts: t.max_attempts,
            backoff_initial: t.backoff_initial(),
            backoff_max: t.backoff_max(),
            api_key,
        }
    }

    /// From `[teacher]`, reading the API key from the environment variable it names.
    pub fn from_config(t: &TeacherConfig) -> Result<ClientOptions, ConfigError> {
        Ok(Self::from_teacher_config(t, t.api_key()?))
    }
}
