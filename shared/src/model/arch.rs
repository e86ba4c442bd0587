//! The decoder families we implement and every fact that sets one apart, in one table: each
//! architecture's file holds its [`ArchFacts`], and [`Arch::facts`] is the only place that maps
//! an [`Arch`] to them. `config`, `init`, `hf`, `gguf`, the decoder and the trainer's student ask
//! the facts; none of them matches on `Arch`.
//!
//! Adding an architecture touches exactly these files:
//! 1. its own file, `shared/src/model/<name>.rs`: a `pub(crate) const FACTS: ArchFacts`
//!    (starting from `BASE`) and, when its layer differs from the ones already written, the
//!    `block` function the facts name (a Llama-shaped family instead adds a const to
//!    `llama.rs`);
//! 2. `shared/src/model/mod.rs`: `mod <name>;` (not for a const in an existing file);
//! 3. this file: one line in the `registry!` call below;
//! 4. tests: a transformers parity case in `trainer/tests/fixtures/hf/make_fixtures.py` (rerun
//!    it to refresh `fixtures.json`), a tiny model of it in `shared/tests/model.rs` and, when it
//!    may be a student, in `trainer/tests/student.rs`;
//! 5. docs: its row in `docs/models.md`'s table.
//!
//! `init-model --arch`, `teacher --help`, the refusals of unknown `model_type`s and GGUF
//! architectures, and the student's list of dense architectures all read this table.

use super::config::{LayerKind, ModelConfig};
use super::decoder::Block;
use super::error::ModelConfigError;
use super::{gemma3, llama, phi3, qwen3_moe};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

/// Builds layer `l` (of attention `kind`) under `vb` (`model.layers.l`).
pub(crate) type BlockFn =
    fn(&ModelConfig, &VarBuilder, usize, LayerKind) -> candle_core::Result<Block>;

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

/// The common case, which each architecture's facts start from (`..BASE`) and say where they
/// differ: SiLU, a window on every layer when set (4096 unless set), plain RoPE based at 10,000,
/// `attention_bias` on q/k/v/o without q/k norms, a dense Llama-shaped block; `init-model`
/// writes `rope_theta` 1,000,000. The names are empty: each architecture sets its own.
pub(crate) const BASE: ArchFacts = ArchFacts {
    name: "",
    model_types: &[],
    cli_name: "",
    hf_class: "",
    multimodal_model_type: None,
    activation: SILU,
    window: WindowFacts {
        default: Some(4096),
        switch: WindowSwitch::WhenSet,
        layers: SlidingLayers::All,
    },
    rope: RopeFacts {
        default_theta: 10_000.0,
        local_base: None,
        top_level_original_max: false,
    },
    query_pre_attn_scalar: None,
    norm_plus_one: false,
    embed_scale: false,
    attention: AttentionFacts {
        bias: AttentionBias::FromConfig,
        qk_norm: false,
    },
    moe: false,
    init: InitDefaults {
        rope_theta: 1_000_000.0,
        explicit_head_dim: false,
    },
    has_mlp_bias_key: false,
    gguf: None,
    block: llama::block,
};

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
    /// The (q/k/v, o) biases of `cfg`.
    pub fn of(self, cfg: &ModelConfig) -> (bool, bool) {
        match self {
            AttentionBias::FromConfig => (cfg.attention_bias, cfg.attention_bias),
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

/// Declares [`Arch`], [`Arch::ALL`] and [`Arch::facts`] from one line per architecture.
macro_rules! registry {
    ($($(#[$doc:meta])* $variant:ident => $facts:path,)*) => {
        /// The decoder families we implement (the facts of each: [`Arch::facts`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(rename_all = "lowercase")]
        pub enum Arch {
            $($(#[$doc])* $variant,)*
        }

        impl Arch {
            /// Every architecture, in the order help and messages list them.
            pub const ALL: [Arch; [$(stringify!($variant)),*].len()] = [$(Arch::$variant),*];

            /// The facts of this architecture.
            pub fn facts(self) -> &'static ArchFacts {
                match self {
                    $(Arch::$variant => &$facts,)*
                }
            }
        }
    };
}

registry! {
    Llama => llama::LLAMA,
    Mistral => llama::MISTRAL,
    Ministral => llama::MINISTRAL,
    Qwen2 => llama::QWEN2,
    Qwen3 => llama::QWEN3,
    Qwen3Moe => qwen3_moe::FACTS,
    Gemma3 => gemma3::FACTS,
    Phi3 => phi3::FACTS,
}

impl Arch {
    /// From `config.json`'s `model_type` (or the `init-model --arch` name).
    pub fn parse(s: &str) -> Result<Arch, ModelConfigError> {
        Arch::ALL
            .into_iter()
            .find(|a| {
                let f = a.facts();
                f.model_types.contains(&s) || f.cli_name == s
            })
            .ok_or_else(|| {
                let supported = list_names(|f| Some(f.model_types[0].into()));
                ModelConfigError::UnsupportedArch(s.to_string(), supported)
            })
    }
    /// The architecture a GGUF `general.architecture` maps onto.
    pub fn from_gguf(name: &str) -> Option<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.facts().gguf.is_some_and(|g| g.name == name))
    }
    /// The architecture whose multimodal checkpoints have the top-level `model_type` `wrapper`.
    pub fn from_multimodal(wrapper: &str) -> Option<Arch> {
        Arch::ALL
            .into_iter()
            .find(|a| a.facts().multimodal_model_type == Some(wrapper))
    }
    /// The `model_type` transformers writes.
    pub fn model_type(self) -> &'static str {
        self.facts().model_types[0]
    }
    /// The name `init-model --arch` takes.
    pub fn cli_name(self) -> &'static str {
        self.facts().cli_name
    }
    /// The `architectures[0]` transformers expects.
    pub fn hf_class(self) -> &'static str {
        self.facts().hf_class
    }
}

/// What `name` says of each architecture it names, joined by `", "` in [`Arch::ALL`]'s order:
/// the lists in help and messages.
pub fn list_names(name: impl Fn(&ArchFacts) -> Option<String>) -> String {
    Arch::ALL
        .iter()
        .filter_map(|a| name(a.facts()))
        .collect::<Vec<_>>()
        .join(", ")
}
