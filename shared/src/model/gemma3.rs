//! Gemma 3 (text): the embedding scaled by √hidden, RMSNorm scaling by `1 + weight`, norms
//! before *and* after attention and MLP, q/k norms, a GeGLU MLP (gelu tanh), local
//! (sliding-window) and global layers with their own RoPE bases, and `query_pre_attn_scalar`.
//! The decoder applies the embedding scale; this file holds its facts and builds one block.

use super::facts::{
    ActivationDefault, ArchFacts, AttentionBias, AttentionFacts, InitDefaults, RopeFacts,
    SlidingLayers, WindowFacts, WindowSwitch,
};
use super::layers::{Block, Ffn, Norm};
use super::llama::BASE;
use super::spec::LayerSpec;
use candle_core::Result;
use candle_nn::VarBuilder;

/// Gemma 3's facts. A multimodal checkpoint (`gemma3`, `Gemma3ForConditionalGeneration`) is
/// served through its text tower.
pub(crate) const FACTS: ArchFacts = ArchFacts {
    name: "Gemma 3",
    model_types: &["gemma3_text", "gemma3"],
    cli_name: "gemma3",
    hf_class: "Gemma3ForCausalLM",
    multimodal_model_type: Some("gemma3"),
    activation: ActivationDefault {
        key: "hidden_activation",
        default: "gelu_pytorch_tanh",
    },
    // Every 6th layer is global; the local ones always use the window (4096 unless set).
    window: WindowFacts {
        default: Some(4096),
        switch: WindowSwitch::WhenSet,
        layers: SlidingLayers::AllButEveryNth(6),
    },
    rope: RopeFacts {
        default_theta: 1_000_000.0,
        local_base: Some(10_000.0),
        top_level_original_max: false,
    },
    query_pre_attn_scalar: Some(256.0),
    norm_plus_one: true,
    embed_scale: true,
    attention: AttentionFacts {
        bias: AttentionBias::FromConfig,
        qk_norm: true,
    },
    init: InitDefaults {
        rope_theta: 1_000_000.0,
        explicit_head_dim: true,
    },
    block,
    ..BASE
};

fn block(spec: &LayerSpec, vb: &VarBuilder) -> Result<Block> {
    let (h, eps) = (spec.hidden, spec.eps);
    let norm = |name: &str| Norm::load(vb, name, h, eps, true);
    // Read in the order of the forward pass (see `llama::block_with`).
    let input_norm = norm("input_layernorm")?;
    // `attention_bias` on all four projections, q/k norms scaling by `1 + weight`.
    let attn = super::llama::attention(spec, vb)?;
    let post_attn_norm = Some(norm("post_attention_layernorm")?);
    let ffn_norm = norm("pre_feedforward_layernorm")?;
    let ffn = Ffn::Dense(super::llama::dense_mlp(spec, &vb.pp("mlp"))?);
    Ok(Block {
        input_norm,
        attn,
        post_attn_norm,
        ffn_norm,
        ffn,
        post_ffn_norm: Some(norm("post_feedforward_layernorm")?),
    })
}
