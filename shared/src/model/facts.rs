//! What sets one architecture apart, as plain data ([`ArchFacts`]): the types each
//! architecture's file fills in and the configuration reads. The table of architectures is
//! [`super::arch`].

use super::layers::Block;
use super::spec::LayerSpec;
use candle_nn::VarBuilder;

/// Builds one layer, as its spec says, under `vb` (`model.layers.N`).
pub(crate) type BlockFn = fn(&LayerSpec, &VarBuilder) -> candle_core::Result<Block>;

/// What sets one architecture apart: its names, the defaults transformers fills in for it, and
/// the shape of its layers. Plain data, except the function that builds a layer.
pub struct ArchFacts {
    /// How help and messages name it (`Gemma 3`).
    pub name: &'static str,
    /// `config.json` `model_type` values read as this architecture; the first is written.
    pub model_types: &'static [&'static str],
    /// The name `init-model --arch` takes (also accepted as a `model_type`).
    pub cli_name: &'static str,
    /// The `architectures[0]` transformers expects.
    pub hf_class: &'static str,
    /// A multimodal checkpoint's top-level `model_type` whose `text_config` is this model
    /// (Gemma 3's `gemma3`); the text config gets `model_types[0]` when it names none.
    pub multimodal_model_type: Option<&'static str>,
    /// The MLP activation when the config names none.
    pub activation: ActivationDefault,
    /// Sliding-window attention: its default, what switches it on, which layers use it.
    pub window: WindowFacts,
    /// RoPE defaults.
    pub rope: RopeFacts,
    /// `Some(default)`: the attention scale is `query_pre_attn_scalar^-1/2` (Gemma 3), with
    /// this default; `None`: `head_dim^-1/2`.
    pub query_pre_attn_scalar: Option<f64>,
    /// RMSNorm scales by `1 + weight` (Gemma), so a norm weight is initialised to zero.
    pub norm_plus_one: bool,
    /// The embedding is multiplied by √hidden (Gemma).
    pub embed_scale: bool,
    /// The biases and q/k norms of the attention projections.
    pub attention: AttentionFacts,
    /// Sparse mixture-of-experts MLPs (the `moe` keys are read; the model cannot be a student).
    pub moe: bool,
    /// What `init-model` writes beyond the flags.
    pub init: InitDefaults,
    /// transformers' config class has `mlp_bias` (written as `false`).
    pub has_mlp_bias_key: bool,
    /// The GGUF `general.architecture` that maps onto this decoder, if any.
    pub gguf: Option<GgufFacts>,
    /// Builds one layer.
    pub(crate) block: BlockFn,
}

/// The activation key an architecture's config class uses, and its default.
#[derive(Debug, Clone, Copy)]
pub struct ActivationDefault {
    /// `hidden_act`, or Gemma's `hidden_activation`.
    pub key: &'static str,
    /// transformers' name of the default activation (`silu`, `gelu_pytorch_tanh`).
    pub default: &'static str,
}

/// The usual `hidden_act: silu`.
pub(crate) const SILU: ActivationDefault = ActivationDefault {
    key: "hidden_act",
    default: "silu",
};

/// How an architecture reads `sliding_window` and its companions.
#[derive(Debug, Clone, Copy)]
pub struct WindowFacts {
    /// `sliding_window` when the key is absent (transformers' config default).
    pub default: Option<usize>,
    /// What puts the window in force.
    pub switch: WindowSwitch,
    /// Which layers slide when `layer_types` is not given.
    pub layers: SlidingLayers,
}

/// What puts a configured window in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSwitch {
    /// Never: the architecture has no window (Llama).
    Never,
    /// Being set (explicitly or by default).
    WhenSet,
    /// `use_sliding_window: true` as well (the Qwen families).
    UseSlidingWindow,
}

/// Which layers are sliding-window layers (when `layer_types` is absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlidingLayers {
    /// Every layer, when the window is in force.
    All,
    /// Layers from `max_window_layers` (this default) on, when the window is in force.
    FromMaxWindowLayers(usize),
    /// All but every n-th (`sliding_window_pattern`, this default), window or not (Gemma 3).
    AllButEveryNth(usize),
}

/// RoPE defaults.
#[derive(Debug, Clone, Copy)]
pub struct RopeFacts {
    /// The base when the config gives none.
    pub default_theta: f64,
    /// `Some(default)`: sliding layers have their own plain RoPE, based on
    /// `rope_local_base_freq` (this default) unless per-type `rope_parameters` say otherwise
    /// (Gemma 3); `None`: they share the full layers' RoPE.
    pub local_base: Option<f64>,
    /// A top-level `original_max_position_embeddings` wins over the scaling's own (Phi-3).
    pub top_level_original_max: bool,
}

/// The biases and q/k norms of the attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionFacts {
    pub bias: AttentionBias,
    /// Per-head RMSNorm on q and k (`q_norm`, `k_norm`).
    pub qk_norm: bool,
}

/// Which attention projections have a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionBias {
    /// `attention_bias` on q, k, v and o.
    FromConfig,
    /// Fixed by the architecture, whatever the config says.
    Fixed { qkv: bool, o: bool },
}

impl AttentionBias {
    /// The (q/k/v, o) biases, given the config's `attention_bias`.
    pub fn of(self, attention_bias: bool) -> (bool, bool) {
        match self {
            AttentionBias::FromConfig => (attention_bias, attention_bias),
            AttentionBias::Fixed { qkv, o } => (qkv, o),
        }
    }
}

/// What `init-model` writes for an architecture beyond its flags.
#[derive(Debug, Clone, Copy)]
pub struct InitDefaults {
    /// `rope_theta`.
    pub rope_theta: f64,
    /// `head_dim` is written even when it is `hidden / heads`.
    pub explicit_head_dim: bool,
}

/// How a GGUF file of this architecture is read.
#[derive(Debug, Clone, Copy)]
pub struct GgufFacts {
    /// `general.architecture`.
    pub name: &'static str,
    /// Without `attention.key_length`, the head dimension is `rope.dimension_count`.
    pub head_dim_from_rope: bool,
    /// `attention_bias` follows the tensors (`blk.0.attn_q.bias`); otherwise it is `false`.
    pub attention_bias_from_tensors: bool,
}
