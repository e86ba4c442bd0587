//! Gemma 3 (text): the embedding scaled by √hidden, RMSNorm scaling by `1 + weight`, norms
//! before *and* after attention and MLP, q/k norms, a GeGLU MLP (gelu tanh), local
//! (sliding-window) and global layers with their own RoPE bases, and `query_pre_attn_scalar`.
//! The decoder applies the embedding scale; this file builds one block.

use super::config::{LayerKind, ModelConfig};
use super::decoder::{Block, Ffn};
use super::layers::{linear, Attention, GatedMlp, Norm, Qkv};
use candle_core::Result;
use candle_nn::VarBuilder;

pub(crate) fn block(cfg: &ModelConfig, vb: &VarBuilder, kind: LayerKind) -> Result<Block> {
    let (h, hq, hkv, d) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.head_dim(),
    );
    let eps = cfg.rms_norm_eps;
    let bias = cfg.attention_bias;
    let norm = |name: &str| Norm::load(vb, name, h, eps, true);
    // Read in the order of the forward pass (see `llama::block_with`).
    let input_norm = norm("input_layernorm")?;
    let av = vb.pp("self_attn");
    let q = linear(&av, "q_proj", (h, hq * d), bias)?;
    let k = linear(&av, "k_proj", (h, hkv * d), bias)?;
    let v = linear(&av, "v_proj", (h, hkv * d), bias)?;
    let o = linear(&av, "o_proj", (hq * d, h), bias)?;
    let qk_norm = Some((
        Norm::load(&av, "q_norm", d, eps, true)?,
        Norm::load(&av, "k_norm", d, eps, true)?,
    ));
    let attn = Attention {
        qkv: Qkv::Separate { q, k, v },
        o,
        qk_norm,
        n_heads: hq,
        n_kv: hkv,
        head_dim: d,
        scale: cfg.attention_scale(),
        window: cfg.layer_window(kind),
    };
    let post_attn_norm = Some(norm("post_attention_layernorm")?);
    let ffn_norm = norm("pre_feedforward_layernorm")?;
    let act = cfg.activation().map_err(candle_core::Error::wrap)?;
    let ffn = Ffn::Dense(GatedMlp::load(&vb.pp("mlp"), h, cfg.intermediate_size, act)?);
    Ok(Block {
        input_norm,
        attn,
        post_attn_norm,
        ffn_norm,
        ffn,
        post_ffn_norm: Some(norm("post_feedforward_layernorm")?),
    })
}
