//! Phi-3 / Phi-4-mini: Llama's block with fused `qkv_proj` and `gate_up_proj`, partial rotary
//! (`partial_rotary_factor`), a sliding window on every layer when configured, and LongRoPE
//! (`longrope`/`su`) for the long-context variants (the RoPE module handles both).

use super::facts::{
    ArchFacts, AttentionBias, AttentionFacts, InitDefaults, RopeFacts, SlidingLayers, WindowFacts,
    WindowSwitch,
};
use super::layers::{linear, Attention, Block, Ffn, GateUp, GatedMlp, Norm, Qkv};
use super::llama::BASE;
use super::spec::LayerSpec;
use candle_core::Result;
use candle_nn::VarBuilder;

/// Phi-3's facts: a window on every layer only when set, a top-level
/// `original_max_position_embeddings` that wins over the scaling's own, no attention biases.
pub(crate) const FACTS: ArchFacts = ArchFacts {
    name: "Phi-3",
    model_types: &["phi3"],
    cli_name: "phi3",
    hf_class: "Phi3ForCausalLM",
    window: WindowFacts {
        default: None,
        switch: WindowSwitch::WhenSet,
        layers: SlidingLayers::All,
    },
    rope: RopeFacts {
        default_theta: 10_000.0,
        local_base: None,
        top_level_original_max: true,
    },
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
    block,
    ..BASE
};

fn block(spec: &LayerSpec, vb: &VarBuilder) -> Result<Block> {
    let (h, hq, hkv, d) = (spec.hidden, spec.heads, spec.kv_heads, spec.head_dim);
    let (eps, inter) = (spec.eps, spec.intermediate);
    // Read in the order of the forward pass (see `llama::block_with`).
    let input_norm = Norm::load(vb, "input_layernorm", h, eps, false)?;
    let av = vb.pp("self_attn");
    let attn = Attention {
        qkv: Qkv::Fused(linear(&av, "qkv_proj", (h, (hq + 2 * hkv) * d), false)?),
        o: linear(&av, "o_proj", (hq * d, h), false)?,
        qk_norm: None,
        n_heads: hq,
        n_kv: hkv,
        head_dim: d,
        scale: spec.attention_scale,
        window: spec.window,
    };
    let ffn_norm = Norm::load(vb, "post_attention_layernorm", h, eps, false)?;
    let mv = vb.pp("mlp");
    let mlp = GatedMlp {
        gate_up: GateUp::Fused(linear(&mv, "gate_up_proj", (h, 2 * inter), false)?),
        down: linear(&mv, "down_proj", (inter, h), false)?,
        act: spec.activation,
    };
    Ok(Block {
        input_norm,
        attn,
        post_attn_norm: None,
        ffn_norm,
        ffn: Ffn::Dense(mlp),
        post_ffn_norm: None,
    })
}
