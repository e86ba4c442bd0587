//! `config.json` of the decoders we implement, read as transformers reads it: both RoPE
//! conventions (`rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`, flat or per
//! layer type), the layer types (full or sliding-window attention), and the keys of each
//! architecture, with the defaults its facts ([`Arch::facts`]) give. Every setting that would
//! change the math and is not implemented is refused by name in [`ModelConfig::validate`]:
//! never a silent wrong answer.

use super::error::invalid;
use super::facts::{ArchFacts, SlidingLayers, WindowSwitch};
use super::spec::{LayerSpec, MoeSpec};
use serde::{Deserialize, Serialize};

pub use super::arch::Arch;
pub use super::error::ModelConfigError;
pub use super::rope::RopeParams;
pub use super::spec::{Activation, LayerKind};

/// The stored name of parameter `name` in a multimodal checkpoint whose text model lives under
/// `prefix` (`model.X` → `prefix + X`; an untied head stays `lm_head`, or
/// `language_model.lm_head` in the older layout).
pub(crate) fn stored_name(prefix: &str, name: &str) -> String {
    match name.strip_prefix("model.") {
        Some(rest) => format!("{prefix}{rest}"),
        None if prefix == "language_model.model." => format!("language_model.{name}"),
        None => name.to_string(),
    }
}

/// Qwen3-MoE's sparse MLP settings (absent for dense models).
///
/// The expert count has two names: transformers ≤ 5.23 writes `num_experts`, 5.24 and later
/// `num_local_experts` (and reads either). Both are kept as read, so a config is written back
/// under the name it came with; read the count through [`MoeConfig::experts`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// The expert count as transformers ≤ 5.23 writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<usize>,
    /// The expert count as transformers ≥ 5.24 writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_topk_prob: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_only_layers: Option<Vec<usize>>,
}

impl MoeConfig {
    /// The expert count: `num_local_experts` or `num_experts`, 0 when neither is set (a dense
    /// model). When both are set and disagree [`ModelConfig::validate`] refuses the config;
    /// before that, `num_local_experts` wins, as in transformers ≥ 5.24.
    pub fn experts(&self) -> usize {
        self.num_local_experts.or(self.num_experts).unwrap_or(0)
    }

    /// The key the expert count was read from, for messages (`num_experts` when neither is
    /// set: the name every transformers version reads).
    pub fn experts_key(&self) -> &'static str {
        if self.num_local_experts.is_some() {
            "num_local_experts"
        } else {
            "num_experts"
        }
    }
}

/// Window and layer-type keys (Mistral, Phi-3, Gemma 3, the Qwen families).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WindowConfig {
    /// Absent (`None`: the architecture's default, as transformers), `null` (`Some(None)`: no
    /// window) or a width.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub sliding_window: Option<Option<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_window_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3: every n-th layer is global (default 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_pattern: Option<usize>,
}

/// Gemma 3's own keys.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GemmaConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_activation: Option<String>,
    /// Attention scale is `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "whole_as_int"
    )]
    pub query_pre_attn_scalar: Option<f64>,
    /// The RoPE base of sliding layers (transformers ≤ 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
}

/// Keys that change the math and that no decoder here implements, read only to refuse such a
/// model by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UnimplementedKeys {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_bidirectional_attention: Option<bool>,
}

/// The fields of `config.json` the decoders need; unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// The RoPE base of transformers ≤ 4 (read through [`ModelConfig::rope`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeParams>,
    /// transformers ≥ 5 writes RoPE settings here, flat (`{"rope_theta": …, "rope_type": …}`)
    /// or per layer type (`{"full_attention": {…}, "sliding_attention": {…}}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    /// Phi-3 keeps these at the top level.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
    #[serde(flatten)]
    pub window: WindowConfig,
    #[serde(flatten)]
    pub moe: MoeConfig,
    #[serde(flatten)]
    pub gemma: GemmaConfig,
    #[serde(flatten)]
    pub unimplemented: UnimplementedKeys,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama, Mistral, Gemma 3: bias on q/k/v/o. Qwen2 always has q/k/v bias (and no o bias).
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Written so transformers does not fall back on an architecture default outside the
    /// vocabulary (Phi-3's is 32000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<serde_json::Value>,
    /// Where the text model's weights live when it is the text tower of a multimodal checkpoint
    /// (`model.language_model.` or `language_model.model.` instead of `model.`); set by
    /// [`crate::hf::ModelDir::open`], never written.
    #[serde(skip)]
    pub weight_prefix: Option<String>,
}

/// A key that is present, `null` included (`Some(None)`); an absent one stays `None`.
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// Writes a whole number as an integer (transformers' strict config types want `int` there).
fn whole_as_int<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(x) if x.fract() == 0.0 && x.abs() < 1e15 => s.serialize_some(&(*x as i64)),
        Some(x) => s.serialize_some(x),
        None => s.serialize_none(),
    }
}

fn default_max_pos() -> usize {
    4096
}
fn default_eps() -> f64 {
    1e-6
}

impl ModelConfig {
    pub fn arch(&self) -> Result<Arch, ModelConfigError> {
        Arch::parse(&self.model_type)
    }
    /// The facts of the architecture `model_type` names.
    pub fn facts(&self) -> Result<&'static ArchFacts, ModelConfigError> {
        Ok(self.arch()?.facts())
    }
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }
    /// EOS ids (`eos_token_id` may be a number or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        ids_of(self.eos_token_id.as_ref())
    }
    pub fn bos_id(&self) -> Option<u32> {
        ids_of(self.bos_token_id.as_ref()).first().copied()
    }

    /// The MLP activation.
    pub fn activation(&self) -> Result<Activation, ModelConfigError> {
        let default = self.facts()?.activation;
        let (key, name) = match (&self.gemma.hidden_activation, &self.hidden_act) {
            (Some(a), _) => ("hidden_activation", a.as_str()),
            (None, Some(a)) => ("hidden_act", a.as_str()),
            (None, None) => (default.key, default.default),
        };
        match name {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" => Ok(Activation::GeluTanh),
            "gelu" => Ok(Activation::GeluErf),
            other => invalid(format!(
                "{key} {other:?} is not implemented (silu, gelu, gelu_pytorch_tanh are)"
            )),
        }
    }

    /// `sliding_window` as transformers reads it: the key's value, or when absent the
    /// architecture's default.
    fn window_setting(&self) -> Option<usize> {
        match self.window.sliding_window {
            Some(w) => w,
            None => self.facts().ok()?.window.default,
        }
    }

    /// The sliding window in force, if any (the Qwen families need `use_sliding_window: true`).
    pub fn sliding_window(&self) -> Option<usize> {
        match self.facts().ok()?.window.switch {
            WindowSwitch::Never => None,
            WindowSwitch::UseSlidingWindow if self.window.use_sliding_window != Some(true) => None,
            WindowSwitch::UseSlidingWindow | WindowSwitch::WhenSet => self.window_setting(),
        }
    }

    /// The attention kind of every layer, as transformers decides it: `layer_types` when given,
    /// else the architecture's rule (Gemma 3's pattern, Qwen's `max_window_layers`, or every
    /// layer when a window is set).
    pub fn layer_kinds(&self) -> Result<Vec<LayerKind>, ModelConfigError> {
        let rule = self.facts()?.window.layers;
        let n = self.num_hidden_layers;
        if let Some(types) = &self.window.layer_types {
            if types.len() != n {
                return invalid(format!(
                    "layer_types has {} entries for {n} layers",
                    types.len()
                ));
            }
            return types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(LayerKind::Full),
                    "sliding_attention" => Ok(LayerKind::Sliding),
                    other => invalid(format!(
                        "layer_types entry {other:?} is not implemented (full_attention and \
                         sliding_attention are)"
                    )),
                })
                .collect();
        }
        let window = self.sliding_window().is_some();
        Ok((0..n)
            .map(|i| {
                let sliding = match rule {
                    SlidingLayers::AllButEveryNth(default) => {
                        let p = self.window.sliding_window_pattern.unwrap_or(default);
                        !(i + 1).is_multiple_of(p.max(1))
                    }
                    SlidingLayers::FromMaxWindowLayers(default) => {
                        window && i >= self.window.max_window_layers.unwrap_or(default)
                    }
                    SlidingLayers::All => window,
                };
                if sliding {
                    LayerKind::Sliding
                } else {
                    LayerKind::Full
                }
            })
            .collect())
    }

    /// The window of one layer: `Some` only on sliding layers when a window is set.
    pub fn layer_window(&self, kind: LayerKind) -> Option<usize> {
        match kind {
            LayerKind::Sliding => self
                .window_setting()
                .filter(|_| self.sliding_window().is_some()),
            LayerKind::Full => None,
        }
    }

    /// `rope_parameters` split per layer type (`None`: flat or absent).
    fn nested_rope(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        let obj = self.rope_parameters.as_ref()?.as_object()?;
        (!obj.is_empty() && obj.values().all(|v| v.is_object() || v.is_null())).then_some(obj)
    }

    /// The RoPE settings of one layer type, standardised as transformers does: the base from
    /// `rope_parameters` or `rope_theta` (Gemma 3's sliding layers: `rope_local_base_freq`),
    /// `partial_rotary_factor` and `original_max_position_embeddings` filled in.
    pub fn rope(&self, kind: LayerKind) -> Result<RopeParams, ModelConfigError> {
        let rope = self.facts()?.rope;
        let local = rope.local_base.filter(|_| kind == LayerKind::Sliding);
        let parse = |v: &serde_json::Value, what: &str| {
            serde_json::from_value::<RopeParams>(v.clone())
                .map_err(|e| ModelConfigError::Invalid(format!("{what}: {e}")))
        };
        let mut p = if let Some(nested) = self.nested_rope() {
            match nested.get(kind.name()) {
                Some(v) if v.is_object() => parse(v, &format!("rope_parameters.{}", kind.name()))?,
                _ if kind == LayerKind::Sliding && rope.local_base.is_none() => {
                    // A model without sliding layers needs no entry for them.
                    match nested.get(LayerKind::Full.name()) {
                        Some(v) => parse(v, "rope_parameters.full_attention")?,
                        None => RopeParams::default(),
                    }
                }
                _ => RopeParams {
                    rope_type: "default".into(),
                    ..Default::default()
                },
            }
        } else if let Some(v) = &self.rope_parameters {
            if !v.is_object() {
                return invalid("rope_parameters must be an object");
            }
            if local.is_some() {
                RopeParams::default()
            } else {
                parse(v, "rope_parameters")?
            }
        } else if local.is_some() {
            RopeParams::default()
        } else {
            self.rope_scaling.clone().unwrap_or_default()
        };
        if p.rope_type.is_empty() {
            p.rope_type = "default".into();
        }
        if p.rope_theta.is_none() {
            p.rope_theta = Some(match local {
                Some(base) => self.gemma.rope_local_base_freq.unwrap_or(base),
                None => self.rope_theta.unwrap_or(rope.default_theta),
            });
        }
        if p.partial_rotary_factor.is_none() {
            p.partial_rotary_factor = self.partial_rotary_factor;
        }
        if matches!(p.kind(), "llama3" | "yarn" | "longrope") {
            // Phi-3 keeps it at the top level, and there it wins (as in transformers).
            if let Some(o) = self
                .original_max_position_embeddings
                .filter(|_| rope.top_level_original_max)
            {
                p.original_max_position_embeddings = Some(o);
            }
            if p.original_max_position_embeddings.is_none() {
                p.original_max_position_embeddings = Some(self.max_position_embeddings);
            }
        }
        Ok(p)
    }

    /// The RoPE base of full-attention layers.
    pub fn rope_theta(&self) -> f64 {
        self.rope(LayerKind::Full)
            .ok()
            .and_then(|p| p.rope_theta)
            .unwrap_or(10_000.0)
    }

    /// The RoPE scaling of full-attention layers, `None` for plain RoPE.
    pub fn rope_scaling(&self) -> Result<Option<RopeParams>, ModelConfigError> {
        Ok(Some(self.rope(LayerKind::Full)?).filter(|p| p.kind() != "default"))
    }

    /// The number of rotated dimensions of each head (`partial_rotary_factor` × head_dim).
    pub fn rotary_dim(&self, kind: LayerKind) -> Result<usize, ModelConfigError> {
        let f = self.rope(kind)?.partial_rotary_factor.unwrap_or(1.0);
        Ok((self.head_dim() as f64 * f) as usize)
    }

    /// Whether layer `l` has a sparse MoE block (Qwen3-MoE's `decoder_sparse_step` and
    /// `mlp_only_layers`).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        let m = &self.moe;
        self.facts().is_ok_and(|f| f.moe)
            && m.experts() > 0
            && !m.mlp_only_layers.as_deref().unwrap_or(&[]).contains(&l)
            && (l + 1).is_multiple_of(m.decoder_sparse_step.unwrap_or(1).max(1))
    }

    /// The attention scale: Gemma 3's `query_pre_attn_scalar^-1/2`, else `head_dim^-1/2`.
    pub fn attention_scale(&self) -> f64 {
        match self.facts().ok().and_then(|f| f.query_pre_attn_scalar) {
            Some(default) => 1.0 / self.gemma.query_pre_attn_scalar.unwrap_or(default).sqrt(),
            None => 1.0 / (self.head_dim() as f64).sqrt(),
        }
    }

    /// Layer `index` of attention `kind` as its architecture builds it: this configuration and
    /// the architecture's facts resolved once, into what the layer's weights and math read.
    pub fn layer_spec(&self, index: usize, kind: LayerKind) -> Result<LayerSpec, ModelConfigError> {
        let facts = self.facts()?;
        let m = &self.moe;
        Ok(LayerSpec {
            index,
            kind,
            hidden: self.hidden_size,
            intermediate: self.intermediate_size,
            heads: self.num_attention_heads,
            kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            eps: self.rms_norm_eps,
            activation: self.activation()?,
            attention_scale: self.attention_scale(),
            window: self.layer_window(kind),
            biases: facts.attention.bias.of(self.attention_bias),
            qk_norm: facts.attention.qk_norm.then_some(facts.norm_plus_one),
            moe: self.is_moe_layer(index).then(|| MoeSpec {
                experts: m.experts(),
                top_k: m.num_experts_per_tok.unwrap_or(1),
                intermediate: m.moe_intermediate_size.unwrap_or(0),
                norm_topk_prob: m.norm_topk_prob.unwrap_or(false),
            }),
        })
    }

    /// Checks one layer type's RoPE: an implemented type with the parameters it needs.
    fn validate_rope_kind(&self, kind: LayerKind) -> Result<(), ModelConfigError> {
        let rot = self.rotary_dim(kind)?;
        self.rope(kind)?.validate(rot, self.head_dim())
    }

    /// Checks the RoPE settings: the conventions agree, and each layer type's is implemented.
    fn validate_rope(&self) -> Result<(), ModelConfigError> {
        if let (Some(top), Some(p)) = (self.rope_theta, &self.rope_parameters) {
            if let Some(t) = p.get("rope_theta").and_then(serde_json::Value::as_f64) {
                if (top - t).abs() > 1e-9 * t {
                    return invalid(format!(
                        "rope_theta {top} and rope_parameters.rope_theta {t} disagree"
                    ));
                }
            }
        }
        if let Some(nested) = self.nested_rope() {
            for key in nested.keys() {
                if key != "full_attention" && key != "sliding_attention" {
                    return invalid(format!(
                        "rope_parameters for layer type {key:?} is not implemented"
                    ));
                }
            }
        }
        let kinds = self.layer_kinds()?;
        for kind in [LayerKind::Full, LayerKind::Sliding] {
            if kinds.contains(&kind) || kind == LayerKind::Full {
                self.validate_rope_kind(kind)?;
            }
        }
        Ok(())
    }

    /// Refuses keys that change the math but are not implemented.
    fn validate_unimplemented(&self) -> Result<(), ModelConfigError> {
        let u = &self.unimplemented;
        if u.mlp_bias == Some(true) {
            return invalid("mlp_bias true is not implemented");
        }
        for (key, v) in [
            ("attn_logit_softcapping", &u.attn_logit_softcapping),
            ("final_logit_softcapping", &u.final_logit_softcapping),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return invalid(format!("{key} is not implemented"));
            }
        }
        if u.use_bidirectional_attention == Some(true) {
            return invalid("use_bidirectional_attention true is not implemented (causal only)");
        }
        if self.window.sliding_window == Some(Some(0)) {
            return invalid("sliding_window must be > 0");
        }
        Ok(())
    }

    fn validate_moe(&self) -> Result<(), ModelConfigError> {
        if !self.facts()?.moe {
            return Ok(());
        }
        let m = &self.moe;
        if let (Some(old), Some(new)) = (m.num_experts, m.num_local_experts) {
            if old != new {
                return invalid(format!(
                    "num_experts ({old}) and num_local_experts ({new}) disagree: both name the \
                     expert count (transformers ≤ 5.23 writes num_experts, 5.24 and later \
                     num_local_experts); keep one of them, set to the number of experts the \
                     weights hold"
                ));
            }
        }
        let experts = m.experts();
        let top_k = m.num_experts_per_tok.unwrap_or(0);
        if experts > 0 && !(1..=experts).contains(&top_k) {
            return invalid(format!(
                "num_experts_per_tok ({top_k}) must be in 1..={} ({experts})",
                m.experts_key()
            ));
        }
        if experts > 0 && m.moe_intermediate_size.unwrap_or(0) == 0 {
            return invalid("moe_intermediate_size must be > 0");
        }
        Ok(())
    }

    /// Checks the invariants the decoder relies on, and refuses every setting that would change
    /// the math but is not implemented (naming the key).
    pub fn validate(&self) -> Result<(), ModelConfigError> {
        self.arch()?;
        // Sizes first: what follows lists the layers, so their count must be bounded.
        crate::model_check::check_limits(self)?;
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return invalid("vocab_size, hidden_size and num_hidden_layers must be positive");
        }
        if self.num_attention_heads == 0 || self.kv_heads() == 0 {
            return invalid("attention heads must be positive");
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return invalid(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if self.head_dim() == 0 {
            return invalid("head_dim must be positive");
        }
        if !self.head_dim().is_multiple_of(2) {
            return invalid(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim()
            ));
        }
        self.validate_unimplemented()?;
        self.validate_rope()?;
        self.validate_moe()?;
        self.activation()?;
        Ok(())
    }
}

/// The token ids of a config value (a number or a list of numbers); what is not a token id
/// (negative, fractional, past u32, not a number) is left out rather than cast into another id.
fn ids_of(v: Option<&serde_json::Value>) -> Vec<u32> {
    let id = |x: &serde_json::Value| x.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(id).collect(),
        Some(x) => id(x).into_iter().collect(),
        None => vec![],
    }
}
