//! `trainer init-model`: a randomly initialised model of any architecture we serve, in Hugging
//! Face layout (transformers loads it unchanged). The command-line front end of
//! [`xdistill_shared::init`]: [`Args`] is an [`InitSpec`] with flags.

use anyhow::Result;
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::PathBuf;
use xdistill_shared::hf::{Arch, ModelConfig};
use xdistill_shared::init::{init_model_dir, InitFeatures, InitSpec};

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Architecture (its `init-model` name; the architectures' facts list them).
    #[arg(long, value_parser = Arch::ALL.map(Arch::cli_name))]
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

pub use xdistill_shared::init::tokenizer_facts;

impl From<&Features> for InitFeatures {
    fn from(f: &Features) -> InitFeatures {
        InitFeatures {
            sliding_window: f.sliding_window,
            max_window_layers: f.max_window_layers,
            sliding_window_pattern: f.sliding_window_pattern,
            rope_scaling: f.rope_scaling.clone(),
            partial_rotary_factor: f.partial_rotary_factor,
            original_max_position_embeddings: f.original_max_position_embeddings,
            attention_bias: f.attention_bias,
            experts: f.experts,
            experts_per_tok: f.experts_per_tok,
            moe_intermediate_size: f.moe_intermediate_size,
            norm_topk_prob: f.norm_topk_prob,
            decoder_sparse_step: f.decoder_sparse_step,
            mlp_only_layers: f.mlp_only_layers.clone(),
        }
    }
}

impl From<&Args> for InitSpec {
    fn from(a: &Args) -> InitSpec {
        InitSpec {
            arch: a.arch.clone(),
            tokenizer: a.tokenizer.clone(),
            hidden_size: a.hidden_size,
            layers: a.layers,
            heads: a.heads,
            kv_heads: a.kv_heads,
            intermediate_size: a.intermediate_size,
            head_dim: a.head_dim,
            pad_vocab_to: a.pad_vocab_to,
            max_position_embeddings: a.max_position_embeddings,
            tie_embeddings: a.tie_embeddings,
            init_std: a.init_std,
            seed: a.seed,
            out: a.out.clone(),
            features: (&a.features).into(),
        }
    }
}

/// The config of the model `a` describes (see [`xdistill_shared::init::build_config`]).
pub fn build_config(a: &Args) -> Result<ModelConfig> {
    xdistill_shared::init::build_config(&a.into())
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
    let (cfg, n) = init_model_dir(&(&a).into())?;
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
