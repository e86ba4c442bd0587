//! Qwen3-MoE: Qwen3's attention with sparse mixture-of-experts MLPs. Each token's router
//! softmax picks its `num_experts_per_tok` experts (renormalised when `norm_topk_prob`); the
//! expert loop then runs each expert once over all the tokens routed to it. Layers in
//! `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP.
//!
//! Experts load from the Hub layout (`mlp.experts.N.{gate,up,down}_proj.weight`) or from
//! transformers 5's fused tensors (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj`
//! `[E, H, I]`).

use super::arch::{
    ArchFacts, AttentionBias, AttentionFacts, InitDefaults, SlidingLayers, WindowFacts,
    WindowSwitch, BASE,
};
use super::config::{LayerKind, ModelConfig};
use super::decoder::{Block, Ffn};
use super::layers::{linear, GateUp, GatedMlp, Linear, Ops};
use candle_core::{DType, Result, Tensor};
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

/// The sparse MLP of one layer.
pub(crate) struct SparseMoe {
    /// Router `[E, H]`.
    router: Linear,
    experts: Vec<GatedMlp>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    fn load(cfg: &ModelConfig, vb: &VarBuilder) -> Result<SparseMoe> {
        let m = &cfg.moe;
        let (h, e) = (cfg.hidden_size, m.experts());
        let inter = m.moe_intermediate_size.unwrap_or(0);
        let act = cfg.activation().map_err(candle_core::Error::wrap)?;
        let router = linear(vb, "gate", (h, e), false)?;
        let ev = vb.pp("experts");
        let experts = if ev.contains_tensor("gate_up_proj") {
            let gate_up = ev.get((e, 2 * inter, h), "gate_up_proj")?;
            let down = ev.get((e, h, inter), "down_proj")?;
            (0..e)
                .map(|i| {
                    Ok(GatedMlp {
                        gate_up: GateUp::Fused(Linear::new(gate_up.get(i)?, None)),
                        down: Linear::new(down.get(i)?, None),
                        act,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..e)
                .map(|i| GatedMlp::load(&ev.pp(i), h, inter, act))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(SparseMoe {
            router,
            experts,
            top_k: m.num_experts_per_tok.unwrap_or(1),
            norm_topk_prob: m.norm_topk_prob.unwrap_or(false),
        })
    }

    /// `x`: [B, T, H] → [B, T, H].
    pub fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let h = *dims.last().unwrap_or(&0);
        let flat = x.reshape(((), h))?; // [N, H]
                                        // 1. Route: softmax over experts in f32, top-k per token (on the host: [N, E] is small).
        let probs = candle_nn::ops::softmax_last_dim(
            &self.router.forward(&flat, ops)?.to_dtype(DType::F32)?,
        )?
        .to_vec2::<f32>()?;
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (tok, row) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let picked = &order[..self.top_k.min(order.len())];
            let sum: f32 = picked.iter().map(|&e| row[e]).sum();
            for &e in picked {
                let w = if self.norm_topk_prob {
                    row[e] / sum
                } else {
                    row[e]
                };
                routed[e].0.push(tok as u32);
                routed[e].1.push(w);
            }
        }
        // 2. Each expert once over its tokens, weighted, added back in expert order.
        let mut out = flat.zeros_like()?;
        for (expert, (tokens, weights)) in self.experts.iter().zip(routed) {
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let idx = Tensor::from_vec(tokens, n, x.device())?;
            let w = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(x.dtype())?;
            let y = expert.forward(&flat.index_select(&idx, 0)?, ops)?; // [n, H]
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        out.reshape(dims)
    }
}

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
