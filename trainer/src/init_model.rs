//! `trainer init-model`: a randomly initialised model of any architecture we serve, in Hugging
//! Face layout (transformers loads it unchanged).

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::PathBuf;
use xdistill_shared::hf::{write_model_dir, Arch, LayerKind, ModelConfig, RopeParams};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Architecture: qwen3, qwen2, llama, mistral, gemma3, phi3 or qwen3-moe.
    #[arg(long, value_parser = ["qwen3", "qwen2", "llama", "mistral", "gemma3", "phi3", "qwen3-moe"])]
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
    #[command(flatten)]
    pub features: Features,
}

/// Architecture features beyond the dense Llama shape (each off or at transformers' default
/// unless given).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Features {
    /// Sliding-window attention of this many positions (Mistral, Phi-3 and Qwen: every layer
    /// from `--max-window-layers` on; Gemma 3: its local layers, default 4096).
    #[arg(long)]
    pub sliding_window: Option<usize>,
    /// Qwen2/Qwen3: layers below this index keep full attention.
    #[arg(long, default_value_t = 0)]
    pub max_window_layers: usize,
    /// Gemma 3: every n-th layer is global, the others local (default 6).
    #[arg(long)]
    pub sliding_window_pattern: Option<usize>,
    /// `rope_scaling` as JSON, e.g. '{"rope_type":"yarn","factor":4.0,
    /// "original_max_position_embeddings":512}' (Gemma 3: its global layers).
    #[arg(long)]
    pub rope_scaling: Option<String>,
    /// Phi-3: the fraction of each head that is rotated.
    #[arg(long)]
    pub partial_rotary_factor: Option<f64>,
    /// Phi-3: the context length before LongRoPE scaling.
    #[arg(long)]
    pub original_max_position_embeddings: Option<usize>,
    /// Bias on the q/k/v/o projections (Llama, Qwen3, Gemma 3).
    #[arg(long)]
    pub attention_bias: bool,
    /// Qwen3-MoE: number of experts (default 8).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Qwen3-MoE: experts per token (default 2).
    #[arg(long)]
    pub experts_per_tok: Option<usize>,
    /// Qwen3-MoE: each expert's intermediate size (default --intermediate-size / 2).
    #[arg(long)]
    pub moe_intermediate_size: Option<usize>,
    /// Qwen3-MoE: renormalise the top-k router probabilities.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub norm_topk_prob: bool,
    /// Qwen3-MoE: every n-th layer is sparse.
    #[arg(long, default_value_t = 1)]
    pub decoder_sparse_step: usize,
    /// Qwen3-MoE: layers (0-based) that keep a dense MLP, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub mlp_only_layers: Vec<usize>,
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
    let explicit_head_dim = matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3);
    let f = &a.features;
    let rope_scaling = match &f.rope_scaling {
        Some(json) => Some(
            serde_json::from_str::<RopeParams>(json)
                .with_context(|| format!("--rope-scaling {json:?} is not a rope_scaling object"))?,
        ),
        None => None,
    };
    let mut cfg = ModelConfig {
        model_type: arch.model_type().into(),
        vocab_size,
        hidden_size: a.hidden_size,
        intermediate_size: a.intermediate_size,
        num_hidden_layers: a.layers,
        num_attention_heads: a.heads,
        num_key_value_heads: Some(a.kv_heads),
        head_dim: (explicit_head_dim || a.head_dim.is_some()).then_some(head_dim),
        max_position_embeddings: a.max_position_embeddings,
        rms_norm_eps: 1e-6,
        rope_theta: Some(match arch {
            Arch::Llama => 500_000.0,
            Arch::Mistral | Arch::Phi3 => 10_000.0,
            _ => 1_000_000.0,
        }),
        rope_scaling,
        rope_parameters: None,
        partial_rotary_factor: f.partial_rotary_factor,
        original_max_position_embeddings: f.original_max_position_embeddings,
        window: Default::default(),
        moe: Default::default(),
        gemma: Default::default(),
        unimplemented: Default::default(),
        tie_word_embeddings: a.tie_embeddings,
        attention_bias: f.attention_bias,
        hidden_act: (arch != Arch::Gemma3).then(|| "silu".into()),
        bos_token_id: bos.map(|b| b.into()),
        eos_token_id: match eos.as_slice() {
            [] => None,
            [one] => Some((*one).into()),
            many => Some(many.to_vec().into()),
        },
        pad_token_id: Some(eos.first().copied().unwrap_or(0).into()),
        weight_prefix: None,
    };
    match arch {
        Arch::Gemma3 => {
            let pattern = f.sliding_window_pattern.unwrap_or(6).max(1);
            cfg.window.sliding_window = Some(Some(f.sliding_window.unwrap_or(4096)));
            cfg.window.layer_types = Some(
                (0..a.layers)
                    .map(|i| {
                        let kind = if (i + 1) % pattern != 0 {
                            LayerKind::Sliding
                        } else {
                            LayerKind::Full
                        };
                        kind.name().to_string()
                    })
                    .collect(),
            );
            cfg.gemma.hidden_activation = Some("gelu_pytorch_tanh".into());
            cfg.gemma.query_pre_attn_scalar = Some(head_dim as f64);
            cfg.gemma.rope_local_base_freq = Some(10_000.0);
        }
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
            if let Some(w) = f.sliding_window {
                cfg.window.sliding_window = Some(Some(w));
                cfg.window.use_sliding_window = Some(true);
                cfg.window.max_window_layers = Some(f.max_window_layers);
            }
        }
        _ => cfg.window.sliding_window = f.sliding_window.map(Some),
    }
    if arch == Arch::Qwen3Moe {
        cfg.moe.num_experts = Some(f.experts.unwrap_or(8));
        cfg.moe.num_experts_per_tok = Some(f.experts_per_tok.unwrap_or(2));
        cfg.moe.moe_intermediate_size = Some(
            f.moe_intermediate_size
                .unwrap_or((a.intermediate_size / 2).max(1)),
        );
        cfg.moe.norm_topk_prob = Some(f.norm_topk_prob);
        cfg.moe.decoder_sparse_step = Some(f.decoder_sparse_step);
        cfg.moe.mlp_only_layers = Some(f.mlp_only_layers.clone());
    }
    if !explicit_head_dim && a.head_dim.is_none() && !a.hidden_size.is_multiple_of(a.heads.max(1)) {
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
