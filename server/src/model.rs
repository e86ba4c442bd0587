//! Loading the teacher: a Hugging Face directory → a [`Decoder`] plus the facts `/v1/info` reports.

use crate::vocab::Vocab;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::Path;
use std::sync::Arc;
use xdistill_shared::device::{device_name, dtype_for, dtype_name, parse_device};
use xdistill_shared::hf::{HfError, ModelDir};
use xdistill_shared::model::{Decoder, Ops};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Hf(#[from] xdistill_shared::hf::HfError),
    #[error(transparent)]
    Device(#[from] xdistill_shared::device::DeviceError),
    #[error("loading weights: {0}")]
    Weights(#[from] candle_core::Error),
    #[error("{0}")]
    Config(String),
}

/// What the server knows about its model, besides the weights.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub architecture: String,
    /// RoPE base and scaling type as applied (`/v1/info`).
    pub rope_theta: f64,
    pub rope_scaling: String,
    /// The window of sliding-attention layers and their number (`/v1/info`).
    pub sliding_window: Option<usize>,
    pub sliding_layers: usize,
    pub model_type: String,
    /// Valid ids: `< vocab_size` (the tokenizer's vocabulary incl. added tokens).
    pub vocab_size: usize,
    /// Rows of the LM head (≥ `vocab_size` when padded).
    pub logits_size: usize,
    pub max_position_embeddings: usize,
    pub dtype: String,
    pub device: String,
    pub tokenizer_sha256: String,
    pub fingerprint: String,
    /// How logits become scores (`/v1/info` `lm_head`): `fused`, `full` or `device`; set by the
    /// worker once it has chosen its scoring path.
    pub lm_head: &'static str,
    /// The teacher's `tokenizer.json`, served at `GET /tokenizer.json`.
    pub tokenizer_json: bytes::Bytes,
    /// The tokenizer and every id's text, for the compatible routes.
    pub vocab: Arc<Vocab>,
}

/// Reads everything but the weights, and decodes every id once for the compatible routes.
pub fn read_facts(dir: &ModelDir, dtype: DType, device: &Device) -> Result<ModelFacts, LoadError> {
    let arch = dir.config.arch().map_err(HfError::from)?;
    let kinds = dir.config.layer_kinds().map_err(HfError::from)?;
    let sliding: Vec<usize> = kinds
        .iter()
        .filter_map(|&k| dir.config.layer_window(k))
        .collect();
    let tok = dir.load_tokenizer()?;
    let tok_vocab = check_dir(dir, &tok)?;
    let logits_size = dir.config.vocab_size;
    let tokenizer_json = std::fs::read(&dir.tokenizer)
        .map_err(|e| LoadError::Config(format!("reading {}: {e}", dir.tokenizer.display())))?;
    Ok(ModelFacts {
        architecture: arch.hf_class().into(),
        rope_theta: dir.config.rope_theta(),
        rope_scaling: dir
            .config
            .rope_scaling()
            .map_err(HfError::from)?
            .map_or_else(|| "default".to_string(), |s| s.kind().to_string()),
        sliding_window: sliding.first().copied(),
        sliding_layers: sliding.len(),
        model_type: arch.model_type().into(),
        vocab_size: tok_vocab.min(logits_size),
        logits_size,
        max_position_embeddings: dir.config.max_position_embeddings,
        dtype: dtype_name(dtype).into(),
        device: device_name(device),
        tokenizer_sha256: dir.tokenizer_sha256()?,
        fingerprint: dir.fingerprint()?,
        lm_head: "full",
        tokenizer_json: tokenizer_json.into(),
        vocab: Arc::new(Vocab::build(tok, tok_vocab.min(logits_size))),
    })
}

/// Start-up checks that need no weights: a model that would serve wrong or no answers is refused
/// with a message naming the file and key. Returns the tokenizer's vocabulary size.
pub fn check_dir(dir: &ModelDir, tok: &tokenizers::Tokenizer) -> Result<usize, LoadError> {
    let cfg_file = dir.path.join("config.json");
    let tok_vocab = tok.get_vocab_size(true);
    let rows = dir.config.vocab_size;
    if tok_vocab > rows {
        return Err(LoadError::Config(format!(
            "{} has {tok_vocab} ids but the model's embedding has {rows} rows (vocab_size in {}): \
             the tokenizer does not belong to this model",
            dir.tokenizer.display(),
            cfg_file.display()
        )));
    }
    if dir.config.max_position_embeddings == 0 {
        return Err(LoadError::Config(format!(
            "max_position_embeddings is 0 in {}: no sequence could be scored",
            cfg_file.display()
        )));
    }
    Ok(tok_vocab)
}

/// Opens the device and the directory and memory-maps the weights.
pub fn load(path: &Path, device: &str, dtype: &str) -> Result<(Decoder, ModelFacts), LoadError> {
    let device = parse_device(device)?;
    let dtype = dtype_for(dtype, &device)?;
    let dir = ModelDir::open(path)?;
    let facts = read_facts(&dir, dtype, &device)?;
    // SAFETY: the safetensors files are memory-mapped read-only; undefined behaviour would need
    // another process to truncate or rewrite them while mapped. candle copies every tensor out of
    // the map into its own storage while the decoder is built, so the map is only read here, and
    // model directories are written atomically (temporary name + rename), never edited in place.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&dir.weights, dtype, &device)? };
    let decoder = Decoder::new(&dir.config, vb, Ops::Fused)?;
    Ok((decoder, facts))
}
