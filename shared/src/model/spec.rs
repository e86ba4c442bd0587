//! One decoder layer as its configuration resolves it ([`LayerSpec`]), and the small enums the
//! configuration and the layers both name. What building a layer reads, resolved once from
//! `config.json` and the architecture's facts ([`super::config::ModelConfig::layer_spec`]), so
//! that the architectures' files and the layers import neither the configuration nor the
//! architecture table.

/// The attention of one layer: over every earlier position, or over the last `sliding_window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Full,
    Sliding,
}

impl LayerKind {
    /// The name transformers gives it in `layer_types` and per-type `rope_parameters`.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Full => "full_attention",
            LayerKind::Sliding => "sliding_attention",
        }
    }
}

/// The MLP activation (`hidden_act`, or Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    /// `gelu`: the exact (erf) form.
    GeluErf,
}

/// A sparse mixture-of-experts layer's settings (Qwen3-MoE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeSpec {
    pub experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's MLP width (`moe_intermediate_size`).
    pub intermediate: usize,
    /// Renormalise the chosen experts' router weights.
    pub norm_topk_prob: bool,
}

/// One layer as its architecture builds it.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    /// Its index in the stack (`model.layers.N`).
    pub index: usize,
    pub kind: LayerKind,
    pub hidden: usize,
    /// The dense MLP's width.
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// RMSNorm's epsilon.
    pub eps: f64,
    pub activation: Activation,
    /// The softmax scale of the attention scores.
    pub attention_scale: f64,
    /// The sliding window of this layer, if it slides.
    pub window: Option<usize>,
    /// Biases of the (q/k/v, o) projections.
    pub biases: (bool, bool),
    /// Per-head q/k RMSNorm: `Some(plus_one)` (`true`: Gemma's `1 + weight`).
    pub qk_norm: Option<bool>,
    /// `Some`: the MLP is a sparse mixture of experts.
    pub moe: Option<MoeSpec>,
}
