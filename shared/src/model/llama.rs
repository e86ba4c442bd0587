//! Llama, Mistral, Qwen2 and Qwen3: one block shape. They differ only in attention biases
//! (`attention_bias`; Qwen2's fixed q/k/v bias; none in Mistral), Qwen3's per-head q/k RMSNorm, and
//! sliding windows (Mistral on every layer, Qwen2/3 above `max_window_layers`).

use super::config::{Arch, LayerKind, ModelConfig};
use super::decoder::{Block, Ffn};
use super::layers::{Attention, GatedMlp, Norm};
use candle_core::Result;
use candle_nn::VarBuilder;

/// The attention of layer `vb` (`…layers.N`): `self_attn.{q,k,v,o}_proj` (+ Qwen3's q/k norms).
pub(crate) fn attention(cfg: &ModelConfig, vb: &VarBuilder, kind: LayerKind) -> Result<Attention> {
    let arch = cfg.arch().map_err(candle_core::Error::wrap)?;
    // Qwen2: q/k/v always biased, o never; Mistral: none; the rest: `attention_bias` on all four.
    let biases = match arch {
        Arch::Qwen2 => (true, false),
        Arch::Mistral => (false, false),
        _ => (cfg.attention_bias, cfg.attention_bias),
    };
    let qk_norm = matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe).then_some(false);
    Attention::load(cfg, &vb.pp("self_attn"), kind, biases, qk_norm)
}

/// One block: pre-norm attention, then a pre-norm SwiGLU MLP.
pub(crate) fn block(cfg: &ModelConfig, vb: &VarBuilder, kind: LayerKind) -> Result<Block> {
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
