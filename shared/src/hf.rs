//! Hugging Face model directories: `config.json`, safetensors (single or sharded) and
//! `tokenizer.json`, for the Llama family (Llama, Qwen2, Qwen3).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{0}: no model.safetensors or model.safetensors.index.json")]
    NoWeights(PathBuf),
    #[error("{0}: no tokenizer.json")]
    NoTokenizer(PathBuf),
    #[error("unsupported model_type {0:?} (supported: qwen3, qwen2, llama)")]
    UnsupportedArch(String),
    #[error("invalid config: {0}")]
    InvalidConfig(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The decoder families we implement; they differ only in attention biases and q/k norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Qwen3,
    Qwen2,
    Llama,
}

impl Arch {
    pub fn parse(s: &str) -> Result<Arch, HfError> {
        match s {
            "qwen3" => Ok(Arch::Qwen3),
            "qwen2" => Ok(Arch::Qwen2),
            "llama" => Ok(Arch::Llama),
            other => Err(HfError::UnsupportedArch(other.to_string())),
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2 => "qwen2",
            Arch::Llama => "llama",
        }
    }
    /// The `architectures[0]` transformers expects.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
        }
    }
}

/// RoPE frequency scaling: `rope_scaling` (transformers ≤ 4) or the scaling fields of
/// `rope_parameters` (transformers ≥ 5). Only `llama3` is implemented; [`ModelConfig::validate`]
/// refuses every other type rather than serve wrong log-probs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: f64,
    #[serde(default)]
    pub low_freq_factor: f64,
    #[serde(default)]
    pub high_freq_factor: f64,
    #[serde(default)]
    pub original_max_position_embeddings: usize,
}

/// The fields of `config.json` the decoder needs; unknown fields are ignored.
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
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// transformers ≥ 5 writes RoPE settings here (`{"rope_theta": …, "rope_type": "default"}`)
    /// instead of top-level `rope_theta` / `rope_scaling`; read through
    /// [`ModelConfig::rope_theta`] and [`ModelConfig::rope_scaling`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<serde_json::Value>,
    /// Keys that change the math and that this decoder does not implement, read only to refuse
    /// such a model by name (never a silent wrong answer).
    #[serde(flatten)]
    pub unimplemented: UnimplementedKeys,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama: bias on q/k/v/o. Qwen2 always has q/k/v bias (and no o bias).
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

/// `config.json` keys this decoder does not implement (see [`ModelConfig::validate`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UnimplementedKeys {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_logit_softcapping: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_logit_softcapping: Option<serde_json::Value>,
}

fn default_max_pos() -> usize {
    4096
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}

impl ModelConfig {
    pub fn arch(&self) -> Result<Arch, HfError> {
        Arch::parse(&self.model_type)
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
    /// The RoPE base: `rope_parameters.rope_theta` (transformers ≥ 5) or `rope_theta`.
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(serde_json::Value::as_f64)
            .unwrap_or(self.rope_theta)
    }

    /// The RoPE scaling in force: from `rope_parameters` when it names a type other than
    /// `default`, else `rope_scaling` (a `default` type there is no scaling either).
    pub fn rope_scaling(&self) -> Result<Option<RopeScaling>, HfError> {
        let scaling = match &self.rope_parameters {
            Some(p) => match p.get("rope_type").or_else(|| p.get("type")) {
                None => self.rope_scaling.clone(),
                Some(_) => Some(
                    serde_json::from_value::<RopeScaling>(p.clone())
                        .map_err(|e| HfError::InvalidConfig(format!("rope_parameters: {e}")))?,
                ),
            },
            None => self.rope_scaling.clone(),
        };
        Ok(scaling.filter(|s| s.rope_type != "default"))
    }

    /// Checks the RoPE settings: one convention or two that agree, a type that is implemented.
    fn validate_rope(&self) -> Result<(), HfError> {
        let bad = |m: String| Err(HfError::InvalidConfig(m));
        if let Some(p) = &self.rope_parameters {
            let Some(obj) = p.as_object() else {
                return bad("rope_parameters must be an object".into());
            };
            if obj.values().all(serde_json::Value::is_object) && !obj.is_empty() {
                return bad(format!(
                    "rope_parameters per layer type ({}) is not supported: this decoder has one \
                     RoPE for every layer",
                    obj.keys().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
            if let Some(t) = obj.get("rope_theta") {
                let Some(t) = t.as_f64().filter(|t| t.is_finite() && *t > 0.0) else {
                    return bad(format!("rope_parameters.rope_theta must be > 0, got {t}"));
                };
                let top = self.rope_theta;
                if top != default_theta() && (top - t).abs() > 1e-9 * t {
                    return bad(format!(
                        "rope_theta {top} and rope_parameters.rope_theta {t} disagree"
                    ));
                }
            }
        }
        if let Some(s) = self.rope_scaling()? {
            match s.rope_type.as_str() {
                "llama3" => {
                    if !(s.factor > 0.0
                        && s.low_freq_factor > 0.0
                        && s.high_freq_factor > s.low_freq_factor
                        && s.original_max_position_embeddings > 0)
                    {
                        return bad(format!(
                            "rope scaling llama3 needs factor > 0, 0 < low_freq_factor < \
                             high_freq_factor and original_max_position_embeddings > 0, got {s:?}"
                        ));
                    }
                }
                other => {
                    return bad(format!(
                        "rope scaling type {other:?} (rope_scaling / rope_parameters.rope_type) \
                         is not implemented: only \"default\" and \"llama3\" are"
                    ))
                }
            }
        }
        Ok(())
    }

    /// Refuses keys that change the math but are not implemented.
    fn validate_unimplemented(&self) -> Result<(), HfError> {
        let u = &self.unimplemented;
        let bad = |m: String| Err(HfError::InvalidConfig(m));
        let window = u
            .sliding_window
            .as_ref()
            .and_then(serde_json::Value::as_u64);
        if let Some(w) = window {
            // Qwen configs carry a window with `use_sliding_window: false`: no window applies.
            if u.use_sliding_window != Some(false) && (w as usize) < self.max_position_embeddings {
                return bad(format!(
                    "sliding_window {w} (< max_position_embeddings {}) is not implemented: \
                     attention here is full-causal",
                    self.max_position_embeddings
                ));
            }
        }
        if u.mlp_bias == Some(true) {
            return bad("mlp_bias true is not implemented".into());
        }
        if let Some(f) = u.partial_rotary_factor {
            if f != 1.0 {
                return bad(format!(
                    "partial_rotary_factor {f} is not implemented (only 1)"
                ));
            }
        }
        for (key, v) in [
            ("attn_logit_softcapping", &u.attn_logit_softcapping),
            ("final_logit_softcapping", &u.final_logit_softcapping),
        ] {
            if v.as_ref().is_some_and(|v| !v.is_null()) {
                return bad(format!("{key} is not implemented"));
            }
        }
        Ok(())
    }

    /// Checks the invariants the decoder relies on, and refuses every setting that would change
    /// the math but is not implemented (naming the key).
    pub fn validate(&self) -> Result<(), HfError> {
        self.arch()?;
        self.validate_rope()?;
        self.validate_unimplemented()?;
        let bad = |m: String| Err(HfError::InvalidConfig(m));
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return bad("vocab_size, hidden_size and num_hidden_layers must be positive".into());
        }
        if self.num_attention_heads == 0 || self.kv_heads() == 0 {
            return bad("attention heads must be positive".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim()
            ));
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return bad(format!("hidden_act {act:?} is not supported (only silu)"));
            }
        }
        Ok(())
    }
}

fn ids_of(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => vec![],
    }
}

/// A model directory on disk.
#[derive(Debug, Clone)]
pub struct ModelDir {
    pub path: PathBuf,
    pub config: ModelConfig,
    /// Safetensors files, in a stable order.
    pub weights: Vec<PathBuf>,
    pub tokenizer: PathBuf,
}

impl ModelDir {
    /// Opens `dir`, parsing `config.json` and locating weights and tokenizer.
    pub fn open(dir: impl AsRef<Path>) -> Result<ModelDir, HfError> {
        let path = dir.as_ref().to_path_buf();
        let cfg_path = path.join("config.json");
        let text = std::fs::read(&cfg_path).map_err(io_err(&cfg_path))?;
        let config: ModelConfig =
            serde_json::from_slice(&text).map_err(|source| HfError::Json {
                path: cfg_path.clone(),
                source,
            })?;
        config.validate()?;
        let weights = weight_files(&path)?;
        let tokenizer = path.join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(HfError::NoTokenizer(path));
        }
        Ok(ModelDir {
            path,
            config,
            weights,
            tokenizer,
        })
    }

    /// sha256 of `tokenizer.json`, hex.
    pub fn tokenizer_sha256(&self) -> Result<String, HfError> {
        file_sha256(&self.tokenizer)
    }

    /// Loads the tokenizer.
    pub fn load_tokenizer(&self) -> Result<tokenizers::Tokenizer, HfError> {
        load_tokenizer(&self.tokenizer)
    }

    /// A stable fingerprint of the weights and config: sha256 over `config.json`, every
    /// safetensors header (names, dtypes, shapes, offsets) and the first 1 MiB of tensor data of
    /// each file. Cheap for 100 GB checkpoints, and changes whenever training changed the weights.
    pub fn fingerprint(&self) -> Result<String, HfError> {
        let mut h = Sha256::new();
        let cfg = self.path.join("config.json");
        h.update(std::fs::read(&cfg).map_err(io_err(&cfg))?);
        for w in &self.weights {
            let mut f = std::fs::File::open(w).map_err(io_err(w))?;
            let mut len = [0u8; 8];
            f.read_exact(&mut len).map_err(io_err(w))?;
            let n = u64::from_le_bytes(len).min(100 << 20);
            let mut head = vec![0u8; n as usize + (1 << 20)];
            let mut got = 0;
            loop {
                let r = f.read(&mut head[got..]).map_err(io_err(w))?;
                if r == 0 || got + r == head.len() {
                    got += r;
                    break;
                }
                got += r;
            }
            h.update(len);
            h.update(&head[..got]);
        }
        Ok(hex::encode(&h.finalize()[..16]))
    }
}

/// Safetensors files of `dir`: `model.safetensors`, or the shards named by the index.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(HfError::NoWeights(dir.to_path_buf()));
    }
    #[derive(Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = std::fs::read(&index).map_err(io_err(&index))?;
    let idx: Index = serde_json::from_slice(&text).map_err(|source| HfError::Json {
        path: index.clone(),
        source,
    })?;
    let files: BTreeSet<&String> = idx.weight_map.values().collect();
    let out: Vec<PathBuf> = files.into_iter().map(|f| dir.join(f)).collect();
    if let Some(missing) = out.iter().find(|p| !p.is_file()) {
        return Err(HfError::Io {
            path: missing.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "shard named in the index is missing",
            ),
        });
    }
    Ok(out)
}

pub fn file_sha256(path: &Path) -> Result<String, HfError> {
    let bytes = std::fs::read(path).map_err(io_err(path))?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, HfError> {
    tokenizers::Tokenizer::from_file(path)
        .map_err(|e| HfError::Tokenizer(format!("{}: {e}", path.display())))
}

/// Writes a model directory the teacher and transformers both load: `config.json` (with
/// `architectures` and `torch_dtype`), `model.safetensors` and `tokenizer.json`.
///
/// The directory is written under a temporary name beside `dir` and renamed into place, so a
/// crash never leaves a half-written model where a reader may find it.
pub fn write_model_dir(
    dir: &Path,
    config: &ModelConfig,
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
    tokenizer_json: &Path,
) -> Result<(), HfError> {
    let arch = config.arch()?;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    // Unique per process *and* call, so concurrent writers never share a staging directory.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(".{name}.tmp-{}-{seq}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;

    let mut cfg =
        serde_json::to_value(config).map_err(|e| HfError::InvalidConfig(e.to_string()))?;
    // The embedding's dtype names the checkpoint's (all tensors share one in practice).
    let dtype = tensors
        .get("model.embed_tokens.weight")
        .or_else(|| tensors.values().next())
        .map(|t| match t.dtype() {
            candle_core::DType::BF16 => "bfloat16",
            candle_core::DType::F16 => "float16",
            _ => "float32",
        })
        .unwrap_or("float32");
    if let Some(obj) = cfg.as_object_mut() {
        obj.insert("architectures".into(), serde_json::json!([arch.hf_class()]));
        obj.insert("torch_dtype".into(), serde_json::json!(dtype));
        obj.insert("hidden_act".into(), serde_json::json!("silu"));
        obj.insert("attention_dropout".into(), serde_json::json!(0.0));
        obj.insert("use_cache".into(), serde_json::json!(true));
        if arch == Arch::Qwen2 || arch == Arch::Qwen3 {
            obj.insert("use_sliding_window".into(), serde_json::json!(false));
            obj.insert(
                "max_window_layers".into(),
                serde_json::json!(config.num_hidden_layers),
            );
        }
        if arch == Arch::Llama {
            obj.insert("mlp_bias".into(), serde_json::json!(false));
        }
        obj.retain(|_, v| !v.is_null());
    }
    let cfg_path = tmp.join("config.json");
    let text =
        serde_json::to_vec_pretty(&cfg).map_err(|e| HfError::InvalidConfig(e.to_string()))?;
    std::fs::write(&cfg_path, text).map_err(io_err(&cfg_path))?;

    let st = tmp.join("model.safetensors");
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let owned: Vec<(String, candle_core::Tensor)> = tensors
        .iter()
        .map(|(k, v)| (k.clone(), v.contiguous().unwrap_or_else(|_| v.clone())))
        .collect();
    safetensors::serialize_to_file(owned.iter().map(|(k, v)| (k.as_str(), v)), Some(meta), &st)
        .map_err(|e| HfError::Io {
            path: st.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;

    let tok = tmp.join("tokenizer.json");
    std::fs::copy(tokenizer_json, &tok).map_err(io_err(tokenizer_json))?;
    let tok_cfg = tokenizer_json.with_file_name("tokenizer_config.json");
    if tok_cfg.is_file() {
        let dst = tmp.join("tokenizer_config.json");
        std::fs::copy(&tok_cfg, &dst).map_err(io_err(&tok_cfg))?;
    }
    // Copies inherit read-only modes from a read-only source; a model directory is ours to edit.
    for entry in std::fs::read_dir(&tmp).map_err(io_err(&tmp))?.flatten() {
        let mut perm = entry
            .metadata()
            .map_err(io_err(&entry.path()))?
            .permissions();
        #[cfg(unix)]
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o644);
        #[cfg(not(unix))]
        perm.set_readonly(false);
        std::fs::set_permissions(entry.path(), perm).map_err(io_err(&entry.path()))?;
    }
    // Durable before visible: flush every file, then rename the directory into place.
    for entry in std::fs::read_dir(&tmp).map_err(io_err(&tmp))?.flatten() {
        std::fs::File::open(entry.path())
            .and_then(|f| f.sync_all())
            .map_err(io_err(&entry.path()))?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io_err(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(io_err(dir))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qwen3_and_llama_configs() {
        let q: ModelConfig = serde_json::from_str(
            r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":8,"intermediate_size":16,
                "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,
                "eos_token_id":[3,4],"some_unknown_field":true}"#,
        )
        .unwrap();
        q.validate().unwrap();
        assert_eq!(q.eos_ids(), vec![3, 4]);
        assert_eq!(q.kv_heads(), 1);
        let l: ModelConfig = serde_json::from_str(
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,
                "num_hidden_layers":1,"num_attention_heads":2,"eos_token_id":2}"#,
        )
        .unwrap();
        assert_eq!(l.head_dim(), 4);
        assert_eq!(l.eos_ids(), vec![2]);
        let mut bad = l.clone();
        bad.model_type = "gpt2".into();
        assert!(matches!(bad.validate(), Err(HfError::UnsupportedArch(_))));
        bad = l.clone();
        bad.num_key_value_heads = Some(3);
        assert!(bad.validate().is_err());
    }
}
