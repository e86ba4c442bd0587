//! Random models, reproducible from a seed: what `trainer init-model` writes (its flags are an
//! [`InitSpec`]) and what tests build tiny models from.

use crate::hf::{write_model_dir, Arch, LayerKind, ModelConfig, RopeParams};
use crate::model::arch::{SlidingLayers, WindowSwitch};
use crate::model::{param_specs, Init};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[doc(hidden)]
pub use xdistill_cpu_kernels::lcg_noise;

/// Random parameters for `cfg` on the CPU (f32), reproducible from `seed`: one ChaCha8 stream
/// over the parameters in `param_specs` order, normals by Box–Muller (one draw pair per value).
pub fn random_params(
    cfg: &ModelConfig,
    init_std: f64,
    seed: u64,
) -> candle_core::Result<HashMap<String, Tensor>> {
    random_params_of(cfg, init_std, seed, |_| true)
}

/// The tensors of [`random_params`] whose names `wanted` accepts, with the same values: the
/// stream skips the other tensors' draws (four ChaCha8 words per normal value) instead of
/// making them. A test teacher that replaces the embedding and the LM head, most of a small
/// model's values, by another seed's draws no longer draws them twice.
pub fn random_params_of(
    cfg: &ModelConfig,
    init_std: f64,
    seed: u64,
    wanted: impl Fn(&str) -> bool,
) -> candle_core::Result<HashMap<String, Tensor>> {
    /// ChaCha8 words per normal value: two `random::<f64>()` draws, a `u64` (two words) each.
    const WORDS_PER_NORMAL: u128 = 4;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = HashMap::new();
    for spec in param_specs(cfg, init_std) {
        let n: usize = spec.shape.iter().product();
        if !wanted(&spec.name) {
            if let Init::Normal(_) = spec.init {
                rng.set_word_pos(rng.get_word_pos() + WORDS_PER_NORMAL * n as u128);
            }
            continue;
        }
        let data: Vec<f32> = match spec.init {
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
            Init::Normal(std) => (0..n)
                .map(|_| {
                    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                    let u2: f64 = rng.random::<f64>();
                    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * std) as f32
                })
                .collect(),
        };
        out.insert(spec.name, Tensor::from_vec(data, spec.shape, &Device::Cpu)?);
    }
    Ok(out)
}

/// Cap on the parameter count [`build_config`] accepts (f32 weights: 64 GiB).
pub const MAX_INIT_PARAMETERS: u128 = 16 << 30;

pub use crate::model_check::MAX_ROPE_TABLE;

/// What a random model is made from: the fields of `trainer init-model`'s flags (that command is
/// a command-line front end to this), without the command-line parser.
#[derive(Debug, Clone)]
pub struct InitSpec {
    /// An architecture's `init-model --arch` name ([`Arch::cli_name`]) or `model_type`.
    pub arch: String,
    /// tokenizer.json whose vocabulary sets the embedding size; copied into the model directory.
    pub tokenizer: PathBuf,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    /// Head dimension (default hidden_size / heads).
    pub head_dim: Option<usize>,
    /// Round the vocabulary up to a multiple of this (padded rows are masked when serving).
    pub pad_vocab_to: usize,
    pub max_position_embeddings: usize,
    pub tie_embeddings: bool,
    /// Standard deviation of the normal initialisation of weight matrices.
    pub init_std: f64,
    pub seed: u64,
    /// The model directory to write.
    pub out: PathBuf,
    pub features: InitFeatures,
}

/// Architecture features beyond the dense Llama shape (each off or at transformers' default
/// unless given); `Default` is what `init-model` uses when no flag is given.
#[derive(Debug, Clone)]
pub struct InitFeatures {
    /// Sliding-window attention of this many positions (Mistral, Phi-3 and Qwen: every layer
    /// from `max_window_layers` on; Gemma 3: its local layers, default 4096).
    pub sliding_window: Option<usize>,
    /// Qwen2/Qwen3: layers below this index keep full attention.
    pub max_window_layers: usize,
    /// Gemma 3: every n-th layer is global, the others local (default 6).
    pub sliding_window_pattern: Option<usize>,
    /// `rope_scaling` as JSON (Gemma 3: its global layers).
    pub rope_scaling: Option<String>,
    /// Phi-3: the fraction of each head that is rotated.
    pub partial_rotary_factor: Option<f64>,
    /// Phi-3: the context length before LongRoPE scaling.
    pub original_max_position_embeddings: Option<usize>,
    /// Bias on the q/k/v/o projections (Llama, Qwen3, Gemma 3).
    pub attention_bias: bool,
    /// Qwen3-MoE: number of experts (default 8).
    pub experts: Option<usize>,
    /// Qwen3-MoE: experts per token (default 2).
    pub experts_per_tok: Option<usize>,
    /// Qwen3-MoE: each expert's intermediate size (default intermediate_size / 2).
    pub moe_intermediate_size: Option<usize>,
    /// Qwen3-MoE: renormalise the top-k router probabilities.
    pub norm_topk_prob: bool,
    /// Qwen3-MoE: every n-th layer is sparse.
    pub decoder_sparse_step: usize,
    /// Qwen3-MoE: layers (0-based) that keep a dense MLP.
    pub mlp_only_layers: Vec<usize>,
}

impl Default for InitFeatures {
    fn default() -> Self {
        InitFeatures {
            sliding_window: None,
            max_window_layers: 0,
            sliding_window_pattern: None,
            rope_scaling: None,
            partial_rotary_factor: None,
            original_max_position_embeddings: None,
            attention_bias: false,
            experts: None,
            experts_per_tok: None,
            moe_intermediate_size: None,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
        }
    }
}

/// Vocabulary size including added tokens, and the BOS/EOS ids the tokenizer config names.
pub fn tokenizer_facts(path: &Path) -> Result<(usize, Option<u32>, Vec<u32>)> {
    let tok = crate::hf::load_tokenizer(path)?;
    let vocab = tok.get_vocab_size(true);
    // tokenizer_config.json (beside tokenizer.json) names bos/eos as strings.
    let mut bos = None;
    let mut eos = Vec::new();
    let cfg_path = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = crate::hf::read_capped(
        &cfg_path,
        crate::hf::limits::TOKENIZER_CONFIG_JSON,
        "tokenizer_config.json",
    ) {
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

/// The `config.json` of the model `a` describes (transformers' layout for its architecture),
/// validated and refused when its parameters could not be created in memory.
pub fn build_config(a: &InitSpec) -> Result<ModelConfig> {
    let arch = Arch::parse(&a.arch)?;
    let facts = arch.facts();
    let (vocab, bos, eos) = tokenizer_facts(&a.tokenizer)?;
    if a.pad_vocab_to == 0 {
        bail!("--pad-vocab-to must be at least 1");
    }
    let vocab_size = vocab.div_ceil(a.pad_vocab_to) * a.pad_vocab_to;
    let head_dim = a.head_dim.unwrap_or(a.hidden_size / a.heads.max(1));
    let explicit_head_dim = facts.init.explicit_head_dim;
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
        rope_theta: Some(facts.init.rope_theta),
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
        hidden_act: None,
        bos_token_id: bos.map(|b| b.into()),
        eos_token_id: match eos.as_slice() {
            [] => None,
            [one] => Some((*one).into()),
            many => Some(many.to_vec().into()),
        },
        pad_token_id: Some(eos.first().copied().unwrap_or(0).into()),
        weight_prefix: None,
    };
    // The activation under the key the architecture's config class reads.
    let act = Some(facts.activation.default.to_string());
    match facts.activation.key {
        "hidden_activation" => cfg.gemma.hidden_activation = act,
        _ => cfg.hidden_act = act,
    }
    let w = facts.window;
    match (w.layers, w.switch) {
        (SlidingLayers::AllButEveryNth(default), _) => {
            let pattern = f.sliding_window_pattern.unwrap_or(default).max(1);
            cfg.window.sliding_window = Some(f.sliding_window.or(w.default));
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
        }
        (_, WindowSwitch::UseSlidingWindow) => {
            if let Some(w) = f.sliding_window {
                cfg.window.sliding_window = Some(Some(w));
                cfg.window.use_sliding_window = Some(true);
                cfg.window.max_window_layers = Some(f.max_window_layers);
            }
        }
        _ => cfg.window.sliding_window = f.sliding_window.map(Some),
    }
    if facts.query_pre_attn_scalar.is_some() {
        cfg.gemma.query_pre_attn_scalar = Some(head_dim as f64);
    }
    cfg.gemma.rope_local_base_freq = facts.rope.local_base;
    if facts.moe {
        // `num_experts`: the name every transformers version reads (5.24 maps it onto its
        // `num_local_experts`; 5.23 and earlier know no other).
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
    // The size first: it names the flags (`validate` names the config keys).
    check_init_size(&cfg)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Builds the config of `a`, draws its parameters and writes the model directory `a.out`
/// (config.json, model.safetensors, the tokenizer). Returns the config and the parameter count.
pub fn init_model_dir(a: &InitSpec) -> Result<(ModelConfig, usize)> {
    let cfg = build_config(a)?;
    let params = random_params(&cfg, a.init_std, a.seed)?;
    let n: usize = params.values().map(|t| t.elem_count()).sum();
    write_model_dir(&a.out, &cfg, &params, &a.tokenizer)
        .with_context(|| format!("writing {}", a.out.display()))?;
    Ok((cfg, n))
}

/// Refuses a `max_position_embeddings` whose RoPE tables would not fit ([`MAX_ROPE_TABLE`]).
pub fn check_rope(cfg: &ModelConfig) -> Result<()> {
    Ok(crate::model_check::check_rope(cfg)?)
}

/// Parameter count of `cfg` (an upper bound, in f64 so that no product overflows), computed
/// without listing the parameters (so an absurd layer count costs nothing).
pub fn parameter_count(cfg: &ModelConfig) -> f64 {
    let (h, i, v) = (
        cfg.hidden_size as f64,
        cfg.intermediate_size as f64,
        cfg.vocab_size as f64,
    );
    let (hq, hkv, d) = (
        cfg.num_attention_heads as f64,
        cfg.kv_heads() as f64,
        cfg.head_dim() as f64,
    );
    // Norms, q/k/v/o (with biases and q/k norms as an upper bound), gate/up/down.
    let per_layer = 2.0 * h
        + 2.0 * (hq * d) * h
        + 2.0 * (hkv * d) * h
        + 3.0 * i * h
        + (hq * d + 2.0 * hkv * d + h)
        + 2.0 * d;
    // Qwen3-MoE: every expert and the router, on every layer (an upper bound).
    let m = &cfg.moe;
    let experts = m.experts() as f64;
    let per_layer =
        per_layer + experts * (3.0 * m.moe_intermediate_size.unwrap_or(0) as f64 * h + h);
    let heads = if cfg.tie_word_embeddings { 1.0 } else { 2.0 };
    heads * v * h + h + cfg.num_hidden_layers as f64 * per_layer
}

/// Refuses configs whose parameters cannot be created in memory.
pub fn check_init_size(cfg: &ModelConfig) -> Result<()> {
    let n = parameter_count(cfg);
    if n > MAX_INIT_PARAMETERS as f64 {
        bail!(
            "the model would have {n:.3e} parameters ({:.1} GiB in f32), over the cap of \
             {MAX_INIT_PARAMETERS} ({} GiB): check --layers, --hidden-size, \
             --intermediate-size, --heads, --head-dim and the vocabulary",
            n * 4.0 / (1u64 << 30) as f64,
            (MAX_INIT_PARAMETERS * 4) >> 30
        );
    }
    check_rope(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any subset of the tensors, drawn with the others skipped, has the whole draw's values bit
    /// for bit (a tied and an untied model: the LM head last or absent; Qwen3's q/k norms of
    /// ones between normal tensors).
    #[test]
    fn a_subset_of_the_parameters_has_the_whole_draws_values() {
        let tok = xdistill_testkit::tokenizer_json("llama2");
        for tie in [false, true] {
            let cfg = build_config(&InitSpec {
                arch: "qwen3".into(),
                tokenizer: tok.clone(),
                hidden_size: 16,
                layers: 2,
                heads: 2,
                kv_heads: 1,
                intermediate_size: 24,
                head_dim: None,
                pad_vocab_to: 1,
                max_position_embeddings: 64,
                tie_embeddings: tie,
                init_std: 0.5,
                seed: 9,
                out: PathBuf::new(),
                features: Default::default(),
            })
            .unwrap();
            let all = random_params(&cfg, 0.5, 9).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            };
            let heads = |n: &str| n == "model.embed_tokens.weight" || n == "lm_head.weight";
            let layer = |n: &str| n.starts_with("model.layers.1.");
            type Pick<'a> = (&'a str, &'a dyn Fn(&str) -> bool);
            let picks: [Pick; 4] = [
                ("heads", &heads),
                ("all but the heads", &|n| !heads(n)),
                ("layer 1", &layer),
                ("the last tensor", &|n| {
                    n == param_specs(&cfg, 0.5).last().unwrap().name
                }),
            ];
            for (what, wanted) in picks {
                let some = random_params_of(&cfg, 0.5, 9, wanted).unwrap();
                let mut names: Vec<_> = some.keys().cloned().collect();
                names.sort();
                let mut want: Vec<_> = all.keys().filter(|n| wanted(n)).cloned().collect();
                want.sort();
                assert!(!names.is_empty(), "{what}: some tensors");
                assert_eq!(names, want, "{what} (tied: {tie})");
                for n in &names {
                    assert_eq!(bits(&some[n]), bits(&all[n]), "{what}: {n} (tied: {tie})");
                }
            }
        }
    }
}
