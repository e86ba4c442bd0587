//! `trainer init-model`: a randomly initialised Llama/Qwen2/Qwen3 in Hugging Face layout.

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::PathBuf;
use xdistill_shared::hf::{write_model_dir, Arch, ModelConfig};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Architecture: qwen3, qwen2 or llama.
    #[arg(long, value_parser = ["qwen3", "qwen2", "llama"])]
    pub arch: String,
    /// tokenizer.json whose vocabulary sets the embedding size; copied into the model directory.
    #[arg(long)]
    pub tokenizer: PathBuf,
    #[arg(long, default_value_t = 64)]
    pub hidden_size: usize,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    pub intermediate_size: usize,
    /// Head dimension (default hidden_size / heads).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Round the vocabulary up to a multiple of this (padded rows are masked when serving).
    #[arg(long, default_value_t = 1)]
    pub pad_vocab_to: usize,
    #[arg(long, default_value_t = 2048)]
    pub max_position_embeddings: usize,
    #[arg(long)]
    pub tie_embeddings: bool,
    /// Standard deviation of the normal initialisation of weight matrices.
    #[arg(long, default_value_t = 0.02)]
    pub init_std: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub out: PathBuf,
}

/// Vocabulary size including added tokens, and the BOS/EOS ids the tokenizer config names.
pub fn tokenizer_facts(path: &std::path::Path) -> Result<(usize, Option<u32>, Vec<u32>)> {
    let tok = xdistill_shared::hf::load_tokenizer(path)?;
    let vocab = tok.get_vocab_size(true);
    // tokenizer_config.json (beside tokenizer.json) names bos/eos as strings.
    let mut bos = None;
    let mut eos = Vec::new();
    let cfg_path = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = std::fs::read(&cfg_path) {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&text) {
            let name = |k: &str| -> Option<String> {
                match v.get(k)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
                    _ => None,
                }
            };
            bos = name("bos_token").and_then(|s| tok.token_to_id(&s));
            if let Some(id) = name("eos_token").and_then(|s| tok.token_to_id(&s)) {
                eos.push(id);
            }
        }
    }
    Ok((vocab, bos, eos))
}

pub fn build_config(a: &Args) -> Result<ModelConfig> {
    let arch = Arch::parse(&a.arch)?;
    let (vocab, bos, eos) = tokenizer_facts(&a.tokenizer)?;
    if a.pad_vocab_to == 0 {
        bail!("--pad-vocab-to must be at least 1");
    }
    let vocab_size = vocab.div_ceil(a.pad_vocab_to) * a.pad_vocab_to;
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.heads.max(1));
    let cfg = ModelConfig {
        model_type: arch.model_type().into(),
        vocab_size,
        hidden_size: a.hidden_size,
        intermediate_size: a.intermediate_size,
        num_hidden_layers: a.layers,
        num_attention_heads: a.heads,
        num_key_value_heads: Some(a.kv_heads),
        head_dim: if arch == Arch::Qwen3 || a.head_dim.is_some() {
            Some(head_dim)
        } else {
            None
        },
        max_position_embeddings: a.max_position_embeddings,
        rms_norm_eps: 1e-6,
        rope_theta: if arch == Arch::Llama {
            500_000.0
        } else {
            1_000_000.0
        },
        rope_scaling: None,
        rope_parameters: None,
        unimplemented: Default::default(),
        tie_word_embeddings: a.tie_embeddings,
        attention_bias: false,
        hidden_act: Some("silu".into()),
        bos_token_id: bos.map(|b| b.into()),
        eos_token_id: match eos.as_slice() {
            [] => None,
            [one] => Some((*one).into()),
            many => Some(many.to_vec().into()),
        },
    };
    if arch != Arch::Qwen3 && a.head_dim.is_none() && !a.hidden_size.is_multiple_of(a.heads.max(1))
    {
        bail!(
            "--hidden-size ({}) must be a multiple of --heads ({})",
            a.hidden_size,
            a.heads
        );
    }
    cfg.validate()?;
    crate::model_check::check_init_size(&cfg)?;
    Ok(cfg)
}

/// Random parameters for `cfg`, reproducible from `seed` (see [`xdistill_shared::init`]).
pub fn random_params(
    cfg: &ModelConfig,
    init_std: f64,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    Ok(xdistill_shared::init::random_params(cfg, init_std, seed)?)
}

pub fn run(a: Args) -> Result<()> {
    let cfg = build_config(&a)?;
    let params = random_params(&cfg, a.init_std, a.seed)?;
    let n: usize = params.values().map(|t| t.elem_count()).sum();
    write_model_dir(&a.out, &cfg, &params, &a.tokenizer)
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote {} ({} {} layers, hidden {}, vocab {}, {:.2}M parameters)",
        a.out.display(),
        cfg.model_type,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        n as f64 / 1e6
    );
    Ok(())
}
