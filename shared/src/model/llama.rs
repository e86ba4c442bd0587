//! Llama, Mistral, Ministral, Qwen2 and Qwen3: one block shape, and the facts of each. They
//! differ only in attention biases (`attention_bias`; Qwen2's fixed q/k/v bias; none in
//! Mistral and Ministral), Qwen3's per-head q/k RMSNorm, and sliding windows (Mistral on every
//! layer, Ministral on the layers `layer_types` names, Qwen2/3 above `max_window_layers`).

use super::arch::{
    ArchFacts, AttentionBias, AttentionFacts, GgufFacts, InitDefaults, SlidingLayers, WindowFacts,
    WindowSwitch, BASE,
};
use super::config::{LayerKind, ModelConfig};
use super::decoder::{Block, Ffn};
use super::layers::{Attention, GatedMlp, Norm};
use candle_core::Result;
use candle_nn::VarBuilder;

/// Llama: no window, `attention_bias` on all four projections.
pub(crate) const LLAMA: ArchFacts = ArchFacts {
    name: "Llama",
    model_types: &["llama"],
    cli_name: "llama",
    hf_class: "LlamaForCausalLM",
    window: WindowFacts {
        default: None,
        switch: WindowSwitch::Never,
        layers: SlidingLayers::All,
    },
    init: InitDefaults {
        rope_theta: 500_000.0,
        explicit_head_dim: false,
    },
    has_mlp_bias_key: true,
    gguf: Some(GgufFacts {
        name: "llama",
        head_dim_from_rope: true,
        attention_bias_from_tensors: true,
    }),
    ..BASE
};

/// Mistral: a window on every layer (4096 unless set), no biases.
pub(crate) const MISTRAL: ArchFacts = ArchFacts {
    name: "Mistral",
    model_types: &["mistral"],
    cli_name: "mistral",
    hf_class: "MistralForCausalLM",
    attention: AttentionFacts {
        bias: AttentionBias::Fixed {
            qkv: false,
            o: false,
        },
        qk_norm: false,
    },
    init: InitDefaults {
        rope_theta: 10_000.0,
        explicit_head_dim: false,
    },
    ..BASE
};

/// Ministral (`MinistralForCausalLM`): Mistral's layer with a window per layer from
/// `layer_types` (every layer when it is absent and `sliding_window` is set). transformers
/// 5.24's Ministral does not derive `head_dim` (it fails on `None`), so `init-model` writes it.
pub(crate) const MINISTRAL: ArchFacts = ArchFacts {
    name: "Ministral",
    model_types: &["ministral"],
    cli_name: "ministral",
    hf_class: "MinistralForCausalLM",
    init: InitDefaults {
        rope_theta: 10_000.0,
        explicit_head_dim: true,
    },
    ..MISTRAL
};

/// Qwen2: q/k/v always biased (o never), the window switched on by `use_sliding_window` above
/// `max_window_layers`.
pub(crate) const QWEN2: ArchFacts = ArchFacts {
    name: "Qwen2",
    model_types: &["qwen2"],
    cli_name: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    window: QWEN_WINDOW,
    attention: AttentionFacts {
        bias: AttentionBias::Fixed {
            qkv: true,
            o: false,
        },
        qk_norm: false,
    },
    gguf: Some(GgufFacts {
        name: "qwen2",
        head_dim_from_rope: false,
        attention_bias_from_tensors: false,
    }),
    ..BASE
};

/// Qwen3: Qwen2's window, `attention_bias` on all four projections, per-head q/k norms.
pub(crate) const QWEN3: ArchFacts = ArchFacts {
    name: "Qwen3",
    model_types: &["qwen3"],
    cli_name: "qwen3",
    hf_class: "Qwen3ForCausalLM",
    window: QWEN_WINDOW,
    attention: AttentionFacts {
        bias: AttentionBias::FromConfig,
        qk_norm: true,
    },
    init: InitDefaults {
        rope_theta: 1_000_000.0,
        explicit_head_dim: true,
    },
    gguf: Some(GgufFacts {
        name: "qwen3",
        head_dim_from_rope: false,
        attention_bias_from_tensors: false,
    }),
    ..BASE
};

/// The Qwen families' window: switched on by `use_sliding_window`, 4096 unless set, on the
/// layers from `max_window_layers` (default 28).
const QWEN_WINDOW: WindowFacts = WindowFacts {
    default: Some(4096),
    switch: WindowSwitch::UseSlidingWindow,
    layers: SlidingLayers::FromMaxWindowLayers(28),
};

/// The attention of layer `vb` (`…layers.N`): `self_attn.{q,k,v,o}_proj` with the biases the
/// architecture's facts say, and its q/k norms when it has them.
pub(crate) fn attention(cfg: &ModelConfig, vb: &VarBuilder, kind: LayerKind) -> Result<Attention> {
    let facts = cfg.facts().map_err(candle_core::Error::wrap)?;
    let biases = facts.attention.bias.of(cfg);
    let qk_norm = facts.attention.qk_norm.then_some(facts.norm_plus_one);
    Attention::load(cfg, &vb.pp("self_attn"), kind, biases, qk_norm)
}

/// One block: pre-norm attention, then a pre-norm SwiGLU MLP.
pub(crate) fn block(
    cfg: &ModelConfig,
    vb: &VarBuilder,
    _: usize,
    kind: LayerKind,
) -> Result<Block> {
    block_with(cfg, vb, kind, |cfg, mv| dense_mlp(cfg, mv).map(Ffn::Dense))
}

/// The dense SwiGLU MLP under `mv` (`…mlp`).
pub(crate) fn dense_mlp(cfg: &ModelConfig, mv: &VarBuilder) -> Result<GatedMlp> {
    let act = cfg.activation().map_err(candle_core::Error::wrap)?;
    GatedMlp::load(mv, cfg.hidden_size, cfg.intermediate_size, act)
}

/// A block whose MLP `ffn` builds from `…mlp` (Qwen3-MoE's sparse layers).
pub(crate) fn block_with(
    cfg: &ModelConfig,
    vb: &VarBuilder,
    kind: LayerKind,
    ffn: impl FnOnce(&ModelConfig, &VarBuilder) -> Result<Ffn>,
) -> Result<Block> {
    let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
    // Read in the order of the forward pass (it fixes `param_specs`' order, and so which draws
    // of a seeded `init-model` land where).
    let input_norm = Norm::load(vb, "input_layernorm", h, eps, false)?;
    let attn = attention(cfg, vb, kind)?;
    let ffn_norm = Norm::load(vb, "post_attention_layernorm", h, eps, false)?;
    let ffn = ffn(cfg, &vb.pp("mlp"))?;
    Ok(Block {
        input_norm,
        attn,
        post_attn_norm: None,
        ffn_norm,
        ffn,
        post_ffn_norm: None,
    })
}
