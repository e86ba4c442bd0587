//! The server's shared state: the start-up configuration, and what exists once the model is
//! loaded. Every route (native in [`crate::routes`], compatible in [`crate::compat`]) and the
//! [`crate::engine`] read it; it imports none of them.

use crate::batcher::Batcher;
use crate::cache::ScoreCache;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::model::ModelFacts;
use crate::request::RequestLimits;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use xdistill_shared::protocol::{
    FullVocabInfo, InfoResponse, Limits, HEAD_PATH, HIDDEN_PATH, PROTOCOL_VERSION,
};

/// Limits and options fixed at start-up.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub max_k: usize,
    /// `None`: the model's max_position_embeddings.
    pub max_seq_len: Option<usize>,
    pub max_batch_tokens: usize,
    pub max_queue_tokens: usize,
    pub max_sequences: usize,
    pub max_answer_bytes: usize,
    pub max_body_bytes: usize,
    pub max_wait_ms: u64,
    /// Longest a request may take to send its body (408 beyond).
    pub body_timeout: std::time::Duration,
    /// Slowest a body may arrive (408 below).
    pub body_pace: BodyPace,
    pub api_key: Option<String>,
    /// Scores do not depend on batching (`--batch-invariant`), reported by `/v1/info`.
    pub batch_invariant: bool,
    /// The model name of the compatible routes (`/v1/models`, the `model` field).
    pub served_model_name: String,
}

/// The slowest a body may arrive: `min_rate` bytes per second on average from its start, once
/// `grace` has passed (`min_rate` 0: no minimum).
#[derive(Debug, Clone, Copy)]
pub struct BodyPace {
    pub min_rate: u64,
    pub grace: std::time::Duration,
}

impl BodyPace {
    pub const NONE: BodyPace = BodyPace {
        min_rate: 0,
        grace: std::time::Duration::ZERO,
    };

    /// How long after the body's start `received` bytes may take to arrive (None: no bound).
    pub(crate) fn allowed(&self, received: usize) -> Option<std::time::Duration> {
        (self.min_rate > 0).then(|| {
            self.grace + std::time::Duration::from_secs_f64(received as f64 / self.min_rate as f64)
        })
    }
}

/// What exists only once the model is loaded.
pub struct Ready {
    pub facts: ModelFacts,
    pub limits: RequestLimits,
    pub info: InfoResponse,
    /// `/v1/info`'s `full_vocab`: the hidden-state and head routes, when the head is served.
    pub full_vocab: Option<FullVocabInfo>,
}

pub struct AppState {
    pub config: ServerConfig,
    pub ready: OnceLock<Ready>,
    pub batcher: Batcher,
    pub cache: ScoreCache,
    pub metrics: Arc<Metrics>,
}

impl AppState {
    /// Marks the model loaded; `/health` answers 200 from now on.
    pub fn set_ready(&self, facts: ModelFacts) -> Result<(), String> {
        let c = &self.config;
        let max_seq_len = c.max_seq_len.unwrap_or(facts.max_position_embeddings);
        if max_seq_len > facts.max_position_embeddings {
            return Err(format!(
                "--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings {}",
                facts.max_position_embeddings
            ));
        }
        let limits = RequestLimits {
            vocab_size: facts.vocab_size,
            max_k: c.max_k,
            max_seq_len,
            max_queue_tokens: c.max_queue_tokens,
            max_sequences: c.max_sequences,
            max_answer_bytes: c.max_answer_bytes,
        };
        let info = InfoResponse {
            protocol_version: PROTOCOL_VERSION,
            server_version: env!("CARGO_PKG_VERSION").into(),
            architecture: facts.architecture.clone(),
            model_type: facts.model_type.clone(),
            vocab_size: facts.vocab_size,
            logits_size: facts.logits_size,
            max_seq_len,
            dtype: facts.dtype.clone(),
            device: facts.device.clone(),
            tokenizer_sha256: facts.tokenizer_sha256.clone(),
            model_fingerprint: facts.fingerprint.clone(),
            limits: Limits {
                max_k: c.max_k,
                max_seq_len,
                max_batch_tokens: c.max_batch_tokens,
                max_queue_tokens: c.max_queue_tokens,
                max_body_bytes: c.max_body_bytes,
                max_wait_ms: c.max_wait_ms,
                max_sequences: c.max_sequences,
                max_answer_bytes: c.max_answer_bytes,
            },
            batch_invariant: c.batch_invariant,
            host_simd: xdistill_cpu_kernels::simd::Simd::current().name().into(),
            lm_head: facts.lm_head.into(),
            rope_theta: facts.rope_theta,
            rope_scaling: facts.rope_scaling.clone(),
            sliding_window: facts.sliding_window,
            sliding_layers: facts.sliding_layers,
            weights: facts.weights.clone(),
            probe: facts.probe.clone(),
        };
        let full_vocab = facts.head.as_ref().map(|h| FullVocabInfo {
            hidden_route: HIDDEN_PATH.into(),
            head_route: HEAD_PATH.into(),
            dtype: h.meta.dtype.name().into(),
            hidden_size: h.meta.hidden_size,
            head_rows: h.meta.head_rows,
            vocab_size: h.meta.vocab_size,
            tied: h.meta.tied,
            bias: h.meta.bias,
            logit_scale: h.meta.logit_scale,
            logit_softcap: h.meta.logit_softcap,
            head_fingerprint: h.fingerprint.clone(),
            head_bytes: h.len,
        });
        self.ready
            .set(Ready {
                facts,
                limits,
                info,
                full_vocab,
            })
            .map_err(|_| "model set twice".to_string())?;
        self.metrics.model_loaded.store(1, Relaxed);
        Ok(())
    }

    pub(crate) fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or(ApiError::NotReady)
    }
}
