//! Gemma 3 (text): the embedding scaled by √hidden, RMSNorm scaling by `1 + weight`, norms
//! before *and* after attention and MLP, q/k norms, a GeGLU MLP (gelu tanh), local
//! (sliding-window) and global layers with their own RoPE bases, and `query_pre_attn_scalar`.
//! The decoder applies the embedding scale; this file builds one block.

use super::config::{LayerKind, ModelConfig};
use super::decoder::{Block, Ffn};
use super::layers::{Attention, GatedMlp, Norm};
use candle_core::Result;
use candle_nn::VarBuilder;

pub(crate) fn block(cfg: &ModelConfig, vb: &VarBuilder, kind: LayerKind) -> Result<Block> {
    let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
    let norm = |name: &str| Norm::load(vb, name, h, eps, true);
    let act = cfg.activation().map_err(candle_core::Error::wrap)?;
    let bias = cfg.attention_bias;
    // Read in the order of the forward pass (see `llama::block_with`).
    let input_norm = norm("input_layernorm")?;
    let attn = Attention::load(cfg, &vb.pp("self_attn"), kind, (bias, bias), Some(true))?;
    let post_attn_norm = Some(norm("post_attention_layernorm")?);
    let ffn_norm = norm("pre_feedforward_layernorm")?;
    let ffn = Ffn::Dense(GatedMlp::load(
        &vb.pp("mlp"),
        h,
        cfg.intermediate_size,
        act,
    )?);
    Ok(Block {
        input_norm,
        attn,
        post_attn_norm,
        ffn_norm,
        ffn,
        post_ffn_norm: Some(norm("post_feedforward_layernorm")?),
    })
}
