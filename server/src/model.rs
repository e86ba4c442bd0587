//! Loading the teacher: a Hugging Face directory or a GGUF file → a [`Decoder`] plus the facts
//! `/v1/info` reports.

use crate::vocab::Vocab;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::Path;
use std::sync::Arc;
use xdistill_shared::device::{device_name, dtype_for, dtype_name, parse_device};
use xdistill_shared::gguf::{GgufError, GgufModel, WeightMode};
use xdistill_shared::hf::{HfError, ModelConfig, ModelDir};
use xdistill_shared::model::{Decoder, Ops};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Hf(#[from] xdistill_shared::hf::HfError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
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
    /// Where the weights came from (`/v1/info` `weights`): `safetensors`, or `gguf` with the
    /// file's quantization (`gguf Q4_1+Q6_K`), dequantized at load to `dtype`, or
    /// `gguf Q4_1+Q6_K (quantized matmuls)` with `--gguf-weights quantized`.
    pub weights: String,
    /// How logits become scores (`/v1/info` `lm_head`): `fused`, `full` or `device`; set by the
    /// worker once it has chosen its scoring path.
    pub lm_head: &'static str,
    /// The teacher's `tokenizer.json`, served at `GET /tokenizer.json`.
    pub tokenizer_json: bytes::Bytes,
    /// The tokenizer and every id's text, for the compatible routes.
    pub vocab: Arc<Vocab>,
    /// Width of the hidden states (the LM head's input).
    pub hidden_size: usize,
    /// The LM head as `/v1/head` serves it (set by the worker once the weights are loaded);
    /// `None`: no hidden-state or head route.
    pub head: Option<Arc<crate::head_file::HeadServe>>,
    /// The start-up probe's result (set by the worker once it has scored it; `/v1/info`).
    pub probe: Option<xdistill_shared::protocol::ProbeInfo>,
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
    let tokenizer_json = xdistill_shared::hf::read_capped(
        &dir.tokenizer,
        xdistill_shared::hf::limits::TOKENIZER_JSON,
        "tokenizer.json",
    )?;
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
        weights: "safetensors".into(),
        lm_head: "full",
        tokenizer_json: tokenizer_json.into(),
        vocab: Arc::new(Vocab::build(tok, tok_vocab.min(logits_size)).map_err(LoadError::Config)?),
        hidden_size: dir.config.hidden_size,
        head: None,
        probe: None,
    })
}

/// Start-up checks that need no weights: a model that would serve wrong or no answers is refused
/// with a message naming the file and key. Returns the tokenizer's vocabulary size.
pub fn check_dir(dir: &ModelDir, tok: &tokenizers::Tokenizer) -> Result<usize, LoadError> {
    let cfg_file = dir.path.join("config.json");
    let where_ = format!("in {}", cfg_file.display());
    check_sizes(
        &dir.config,
        tok,
        &dir.tokenizer.display().to_string(),
        &where_,
    )
}

/// The checks of [`check_dir`] for any source: `tok_name` names the tokenizer, `where_` where
/// the config was read.
fn check_sizes(
    config: &ModelConfig,
    tok: &tokenizers::Tokenizer,
    tok_name: &str,
    where_: &str,
) -> Result<usize, LoadError> {
    let tok_vocab = tok.get_vocab_size(true);
    let rows = config.vocab_size;
    if tok_vocab > rows {
        return Err(LoadError::Config(format!(
            "{tok_name} has {tok_vocab} ids but the model's embedding has {rows} rows (vocab_size \
             {where_}): the tokenizer does not belong to this model"
        )));
    }
    if config.max_position_embeddings == 0 {
        return Err(LoadError::Config(format!(
            "max_position_embeddings is 0 {where_}: no sequence could be scored"
        )));
    }
    Ok(tok_vocab)
}

/// The facts of a GGUF file (see [`read_facts`]): the tokenizer is the one rebuilt from its
/// metadata, served as `tokenizer.json`.
pub fn gguf_facts(g: &GgufModel, dtype: DType, device: &Device) -> Result<ModelFacts, LoadError> {
    let arch = g.config.arch().map_err(HfError::from)?;
    let tok = g.load_tokenizer()?;
    let where_ = format!("from the metadata of {}", g.path.display());
    let tok_vocab = check_sizes(&g.config, &tok, "the GGUF tokenizer", &where_)?;
    let logits_size = g.config.vocab_size;
    Ok(ModelFacts {
        architecture: arch.hf_class().into(),
        rope_theta: g.config.rope_theta(),
        rope_scaling: "default".into(),
        sliding_window: None,
        sliding_layers: 0,
        model_type: arch.model_type().into(),
        vocab_size: tok_vocab.min(logits_size),
        logits_size,
        max_position_embeddings: g.config.max_position_embeddings,
        dtype: dtype_name(dtype).into(),
        device: device_name(device),
        tokenizer_sha256: g.tokenizer_sha256(),
        fingerprint: g.fingerprint()?,
        weights: format!("gguf {}", g.quantization()),
        lm_head: "full",
        tokenizer_json: g.tokenizer_json.clone().into_bytes().into(),
        vocab: Arc::new(Vocab::build(tok, tok_vocab.min(logits_size)).map_err(LoadError::Config)?),
        hidden_size: g.config.hidden_size,
        head: None,
        probe: None,
    })
}

/// `--check-args`: opens `path` (a model directory or a GGUF file) and runs the start-up checks
/// without loading weights; returns the model's `max_position_embeddings`.
pub fn check_model(path: &Path) -> Result<usize, LoadError> {
    if xdistill_shared::gguf::is_gguf(path) {
        let g = GgufModel::open(path)?;
        let tok = g.load_tokenizer()?;
        check_sizes(
            &g.config,
            &tok,
            "the GGUF tokenizer",
            "in the GGUF metadata",
        )?;
        return Ok(g.config.max_position_embeddings);
    }
    let dir = ModelDir::open(path)?;
    let tok = dir.load_tokenizer()?;
    check_dir(&dir, &tok)?;
    Ok(dir.config.max_position_embeddings)
}

/// Opens the device and the model: a directory (weights memory-mapped) or a GGUF file (weights
/// dequantized to `dtype` at load).
pub fn load(path: &Path, device: &str, dtype: &str) -> Result<(Decoder, ModelFacts), LoadError> {
    load_with(path, device, dtype, WeightMode::Dequantize)
}

/// [`load`], with a GGUF file's weights held as `gguf` says (dequantized, or the projections
/// kept quantized for candle's quantized matmuls). [`WeightMode::Quantized`] is refused for a
/// model directory: its weights are not quantized.
pub fn load_with(
    path: &Path,
    device: &str,
    dtype: &str,
    gguf: WeightMode,
) -> Result<(Decoder, ModelFacts), LoadError> {
    let device = parse_device(device)?;
    let dtype = dtype_for(dtype, &device)?;
    if xdistill_shared::gguf::is_gguf(path) {
        let g = GgufModel::open(path)?;
        let mut facts = gguf_facts(&g, dtype, &device)?;
        facts.weights = g.weights_label(gguf);
        let decoder = g.decoder(gguf, dtype, &device)?;
        return Ok((decoder, facts));
    }
    if gguf == WeightMode::Quantized {
        return Err(LoadError::Config(format!(
            "--gguf-weights quantized needs a GGUF file; {} is a model directory",
            path.display()
        )));
    }
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
