//! Llama, Mistral, Ministral, Qwen2 and Qwen3: one block shape, and the facts of each. They
//! differ only in attention biases (`attention_bias`; Qwen2's fixed q/k/v bias; none in
//! Mistral and Ministral), Qwen3's per-head q/k RMSNorm, and sliding windows (Mistral on every
//! layer, Ministral on the layers `layer_types` names, Qwen2/3 above `max_window_layers`).

use super::facts::{
    ArchFacts, AttentionBias, AttentionFacts, GgufFacts, InitDefaults, RopeFacts, SlidingLayers,
    WindowFacts, WindowSwitch, SILU,
};
use super::layers::{Attention, Block, Ffn, GatedMlp, Norm};
use super::spec::LayerSpec;
use candle_core::Result;
use candle_nn::VarBuilder;

/// The common case, which each architecture's facts start from (`..BASE`) and say where they
/// differ: SiLU, a window on every layer when set (4096 unless set), plain RoPE based at 10,000,
/// `attention_bias` on q/k/v/o without q/k norms, a dense Llama-shaped block; `init-model`
/// writes `rope_theta` 1,000,000. The names are empty: each architecture sets its own.
pub(crate) const BASE: ArchFacts = ArchFacts {
    name: "",
    model_types: &[],
    cli_name: "",
    hf_class: "",
    multimodal_model_type: None,
    activation: SILU,
    window: WindowFacts {
        default: Some(4096),
        switch: WindowSwitch::WhenSet,
        layers: SlidingLayers::All,
    },
    rope: RopeFacts {
        default_theta: 10_000.0,
        local_base: None,
        top_level_original_max: false,
    },
    query_pre_attn_scalar: None,
    norm_plus_one: false,
    embed_scale: false,
    attention: AttentionFacts {
        bias: AttentionBias::FromConfig,
        qk_norm: false,
    },
    moe: false,
    init: InitDefaults {
        rope_theta: 1_000_000.0,
        explicit_head_dim: false,
    },
    has_mlp_bias_key: false,
    gguf: None,
    block,
};

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
pub(crate) fn attention(spec: &LayerSpec, vb: &VarBuilder) -> Result<Attention> {
    Attention::load(spec, &vb.pp("self_attn"))
}

/// One block: pre-norm attention, then a pre-norm SwiGLU MLP.
pub(crate) fn block(spec: &LayerSpec, vb: &VarBuilder) -> Result<Block> {
    block_with(spec, vb, |spec, mv| dense_mlp(spec, mv).map(Ffn::Dense))
}

/// The dense SwiGLU MLP under `mv` (`…mlp`).
pub(crate) fn dense_mlp(spec: &LayerSpec, mv: &VarBuilder) -> Result<GatedMlp> {
    GatedMlp::load(mv, spec.hidden, spec.intermediate, spec.activation)
}

/// A block whose MLP `ffn` builds from `…mlp` (Qwen3-MoE's sparse layers).
pub(crate) fn block_with(
    spec: &LayerSpec,
    vb: &VarBuilder,
    ffn: impl FnOnce(&LayerSpec, &VarBuilder) -> Result<Ffn>,
) -> Result<Block> {
    let (h, eps) = (spec.hidden, spec.eps);
    // Read in the order of the forward pass (it fixes `param_specs`' order, and so which draws
    // of a seeded `init-model` land where).
    let input_norm = Norm::load(vb, "input_layernorm", h, eps, false)?;
    let attn = attention(spec, vb)?;
    let ffn_norm = Norm::load(vb, "post_attention_layernorm", h, eps, false)?;
    let ffn = ffn(spec, &vb.pp("mlp"))?;
    Ok(Block {
        input_norm,
        attn,
        post_attn_norm: None,
        ffn_norm,
        ffn,
        post_ffn_norm: None,
    })
}
