//! Why a `config.json` cannot be served: one error for the config, its RoPE and its
//! architecture (a leaf, so that `config.rs`, `rope.rs` and `arch.rs` share it without a cycle).

/// Why a `config.json` cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    /// A `model_type` no architecture reads, and every architecture's `model_type`.
    #[error("unsupported model_type {0:?} (supported: {1})")]
    UnsupportedArch(String, String),
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// A [`ModelConfigError::Invalid`] saying `m`.
pub(super) fn invalid<T>(m: impl Into<String>) -> Result<T, ModelConfigError> {
    Err(ModelConfigError::Invalid(m.into()))
}
