//! Qwen3-MoE: Qwen3's attention with sparse mixture-of-experts MLPs. Each token's router
//! softmax picks its `num_experts_per_tok` experts (renormalised when `norm_topk_prob`); the
//! expert loop then runs each expert once over all the tokens routed to it. Layers in
//! `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP. The sparse MLP
//! itself is a layer beside the dense one ([`SparseMoe`], in `layers.rs`).

use super::facts::{
    ArchFacts, AttentionBias, AttentionFacts, InitDefaults, SlidingLayers, WindowFacts,
    WindowSwitch,
};
use super::layers::{Block, Ffn, SparseMoe};
use super::llama::BASE;
use super::spec::LayerSpec;
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
fn block(spec: &LayerSpec, vb: &VarBuilder) -> Result<Block> {
    super::llama::block_with(spec, vb, |spec, mv| {
        Ok(match spec.moe {
            Some(moe) => Ffn::Moe(SparseMoe::load(spec, moe, mv)?),
            None => Ffn::Dense(super::llama::dense_mlp(spec, mv)?),
        })
    })
}
