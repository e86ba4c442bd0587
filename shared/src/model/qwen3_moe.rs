//! Qwen3-MoE: Qwen3's attention with sparse mixture-of-experts MLPs. Each token's router
//! softmax picks its `num_experts_per_tok` experts (renormalised when `norm_topk_prob`); the
//! expert loop then runs each expert once over all the tokens routed to it. Layers in
//! `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP. The sparse MLP
//! itself is a layer beside the dense one ([`SparseMoe`], in `layers.rs`).

use super::arch::{
    ArchFacts, AttentionBias, AttentionFacts, InitDefaults, SlidingLayers, WindowFacts,
    WindowSwitch, BASE,
};
use super::config::{LayerKind, ModelConfig};
use super::decoder::{Block, Ffn};
use super::layers::SparseMoe;
use candle_core::Result;
use candle_nn::VarBuilder;

/// Qwen3-MoE's facts: Qwen3's attention; the window, when `use_sliding_window` switches it on,
/// on every layer.
pub(crate) const FACTS: ArchFacts = ArchFacts {
    name: "Qwen3-MoE",
    model_types: &["qwen3_moe"],
    cli_name: "qwen3-moe",
    hf_class: "Qwen3MoeForCausalLM",
    window: WindowFacts {
        default: Some(4096),
        switch: WindowSwitch::UseSlidingWindow,
        layers: SlidingLayers::All,
    },
    attention: AttentionFacts {
        bias: AttentionBias::FromConfig,
        qk_norm: true,
    },
    moe: true,
    init: InitDefaults {
        rope_theta: 1_000_000.0,
        explicit_head_dim: true,
    },
    block,
    ..BASE
};

/// One block: Qwen3's, with the sparse MLP on MoE layers.
fn block(cfg: &ModelConfig, vb: &VarBuilder, l: usize, kind: LayerKind) -> Result<Block> {
    super::llama::block_with(cfg, vb, kind, |cfg, mv| {
        Ok(if cfg.is_moe_layer(l) {
            Ffn::Moe(SparseMoe::load(cfg, mv)?)
        } else {
            Ffn::Dense(super::llama::dense_mlp(cfg, mv)?)
        })
    })
}
