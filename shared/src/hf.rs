//! Hugging Face model directories: `config.json`, safetensors (single or sharded) and
//! `tokenizer.json`. The `config.json` schema itself is [`crate::model::config`].

use serde::Deserialize;
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
    #[error(transparent)]
    Config(#[from] ModelConfigError),
    /// `config.json` refused by [`ModelConfig::validate`], with the file named.
    #[error("{}: {source}", path.display())]
    ConfigFile {
        path: PathBuf,
        source: ModelConfigError,
    },
    #[error("invalid config: {0}")]
    InvalidConfig(String),
    /// `config.json` and the safetensors headers disagree (said before any weight is loaded).
    #[error("{}: {message}", path.display())]
    ConfigVsWeights { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A file (or device) given as a model that is neither a GGUF file nor a directory.
    #[error(
        "{}: neither a GGUF file (it does not start with the GGUF magic) nor a model directory \
         (config.json, safetensors, tokenizer.json)",
        .0.display()
    )]
    NotAModel(PathBuf),
    /// A safetensors file that does not follow the format, or a tensor the model cannot use.
    #[error("{}: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    /// A file longer than any real one of its kind ([`read_capped`]), or one that never ends (a
    /// device in its place).
    #[error(
        "{}: more than {limit} bytes, far more than a {what} holds: refused rather than read into \
         memory",
        path.display()
    )]
    TooLarge {
        path: PathBuf,
        limit: u64,
        what: &'static str,
    },
}

/// The most bytes a model directory's small files may hold, far above any real model's (a
/// `config.json` is a few KB, an index a few MB, a `tokenizer.json` tens of MB): [`read_capped`]'s
/// limits, so that a file of gigabytes, or a device such as `/dev/zero` in a file's place, is
/// refused by name instead of read into memory.
pub mod limits {
    /// `config.json`.
    pub const CONFIG_JSON: u64 = 16 << 20;
    /// `model.safetensors.index.json`.
    pub const INDEX_JSON: u64 = 64 << 20;
    /// `tokenizer_config.json` (its chat templates included).
    pub const TOKENIZER_CONFIG_JSON: u64 = 64 << 20;
    /// `tokenizer.json`.
    pub const TOKENIZER_JSON: u64 = 512 << 20;
}

/// The bytes of `path` (a `what`, for the message), at most `limit` of them: a longer regular
/// file is refused before any byte is read, anything else (a pipe, a device) after `limit + 1`.
pub fn read_capped(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>, HfError> {
    let too_large = || HfError::TooLarge {
        path: path.to_path_buf(),
        limit,
        what,
    };
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let meta = f.metadata().map_err(io_err(path))?;
    if meta.is_file() && meta.len() > limit {
        return Err(too_large());
    }
    let mut out = Vec::with_capacity(if meta.is_file() {
        meta.len() as usize
    } else {
        0
    });
    f.take(limit + 1)
        .read_to_end(&mut out)
        .map_err(io_err(path))?;
    if out.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(out)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

use crate::model::arch::WindowSwitch;
pub use crate::model::config::{
    Activation, Arch, GemmaConfig, LayerKind, ModelConfig, ModelConfigError, MoeConfig, RopeParams,
    UnimplementedKeys, WindowConfig,
};

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
    /// Opens `dir`: parses and validates `config.json`, locates the weights and the tokenizer,
    /// and checks the config against the safetensors headers ([`check_experts`]); no tensor
    /// data is read.
    pub fn open(dir: impl AsRef<Path>) -> Result<ModelDir, HfError> {
        let path = dir.as_ref().to_path_buf();
        if path.exists() && !path.is_dir() {
            return Err(HfError::NotAModel(path));
        }
        let cfg_path = path.join("config.json");
        let text = read_capped(&cfg_path, limits::CONFIG_JSON, "config.json")?;
        let json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|source| HfError::Json {
                path: cfg_path.clone(),
                source,
            })?;
        let (json, multimodal) = text_config(json);
        let mut config: ModelConfig =
            serde_json::from_value(json).map_err(|source| HfError::Json {
                path: cfg_path.clone(),
                source,
            })?;
        config.validate().map_err(|source| HfError::ConfigFile {
            path: cfg_path.clone(),
            source,
        })?;
        let weights = weight_files(&path)?;
        let mut tensors = Vec::new();
        let mut shapes = crate::model_check::Shapes::new();
        for w in &weights {
            for t in safetensors_tensors(w)? {
                if !t.is_float() && (t.name.ends_with(".weight") || t.name.ends_with(".bias")) {
                    return Err(HfError::Safetensors {
                        path: w.clone(),
                        message: format!(
                            "tensor {:?} is stored as {}: a model weight is a float type \
                             (F32, F16, BF16, F64)",
                            t.name, t.dtype
                        ),
                    });
                }
                if let Some((_, first)) =
                    shapes.insert(t.name.clone(), (t.shape.clone(), w.clone()))
                {
                    return Err(HfError::Safetensors {
                        path: w.clone(),
                        message: format!(
                            "tensor {:?} is stored twice (also in {})",
                            t.name,
                            first.display()
                        ),
                    });
                }
                tensors.push((t.name, t.shape));
            }
        }
        if multimodal {
            config.weight_prefix = Some(text_tower_prefix(&tensors)?);
        }
        // Every size the config states, against the stored tensors, before anything is sized.
        crate::model_check::check_sizes(&config, &cfg_path, &shapes)?;
        check_experts(&config, &cfg_path, &tensors)?;
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

    /// A cheap fingerprint of the config and weights: the first 16 bytes (32 hex digits) of a
    /// sha256 over, in order, the bytes of `config.json`, then for each safetensors file in
    /// [`ModelDir::weights`] order (the single file, or the shards sorted by name) its first
    /// `8 + n + 1 MiB` bytes: the 8-byte header length `n`, the raw header JSON (every
    /// tensor's name, dtype, shape and offsets, and `__metadata__` if any) and the first 1 MiB
    /// of the tensor data (less where the file is shorter; `n` is capped at 100 MiB).
    ///
    /// It reads at most about 1 MiB per file, whatever the checkpoint's size, so it is a
    /// fingerprint and not a checksum: `tokenizer.json` is not part of it (see
    /// [`ModelDir::tokenizer_sha256`]), and an edit confined to tensor data past a file's first
    /// MiB leaves it unchanged. A training step updates every (unfrozen) parameter, those stored
    /// first included, so each saved step of a training run has its own fingerprint.
    pub fn fingerprint(&self) -> Result<String, HfError> {
        let mut h = Sha256::new();
        let cfg = self.path.join("config.json");
        h.update(read_capped(&cfg, limits::CONFIG_JSON, "config.json")?);
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

/// The text model of a `config.json`: the file itself, or the `text_config` of a multimodal
/// checkpoint (Gemma 3's `Gemma3ForConditionalGeneration`), with the top level's token ids and
/// tying where the text config has none. The flag says it came from a `text_config`.
fn text_config(mut json: serde_json::Value) -> (serde_json::Value, bool) {
    let Some(top) = json.as_object_mut() else {
        return (json, false);
    };
    let Some(serde_json::Value::Object(mut text)) = top.remove("text_config") else {
        return (json, false);
    };
    let wrapper = top.get("model_type").and_then(|m| m.as_str());
    if let Some(arch) = wrapper.and_then(Arch::from_multimodal) {
        text.entry("model_type")
            .or_insert_with(|| serde_json::json!(arch.model_type()));
    }
    for key in ["bos_token_id", "eos_token_id", "tie_word_embeddings"] {
        if let Some(v) = top.get(key) {
            text.entry(key).or_insert_with(|| v.clone());
        }
    }
    (serde_json::Value::Object(text), true)
}

/// Where a multimodal checkpoint keeps its text model's weights: `model.language_model.`
/// (transformers ≥ 4.52) or `language_model.model.` (earlier), found from the headers.
fn text_tower_prefix(tensors: &[(String, Vec<usize>)]) -> Result<String, HfError> {
    for (name, _) in tensors {
        for prefix in ["model.language_model.", "language_model.model."] {
            if name.starts_with(prefix) {
                return Ok(prefix.into());
            }
        }
    }
    Err(HfError::InvalidConfig(
        "config.json has a text_config, but no weight is named model.language_model.* or \
         language_model.model.*"
            .into(),
    ))
}

/// What one layer's MLP tensors say, from the safetensors headers.
#[derive(Default)]
struct LayerMlp {
    /// The first (by name) `mlp.experts.*` or `mlp.gate.weight` tensor: a sparse MoE block.
    sparse: Option<String>,
    /// The first (by name) other `mlp.*` tensor: a dense MLP.
    dense: Option<String>,
    /// Experts the tensors hold: per-expert `mlp.experts.N.*` (largest N + 1) or the first
    /// dimension of the fused `mlp.experts.gate_up_proj`.
    experts: Option<usize>,
}

/// Checks, from the safetensors headers alone (before any weight is loaded), that `config`
/// (read from `cfg_path`) and the weights agree on which layers hold a mixture-of-experts MLP
/// and on the expert count, and says where they disagree by config key and tensor name.
/// Without it a Qwen3-MoE `config.json` that lost its expert count (e.g. written with a key name
/// this reader did not know) builds dense MLPs and stops on a missing `mlp.gate_proj.weight`.
///
/// [`ModelDir::open`] calls it, so the teacher, the trainer and the evaluator all refuse such
/// a directory with the same message.
pub fn check_experts(
    config: &ModelConfig,
    cfg_path: &Path,
    tensors: &[(String, Vec<usize>)],
) -> Result<(), HfError> {
    let fail = |message: String| {
        Err(HfError::ConfigVsWeights {
            path: cfg_path.to_path_buf(),
            message,
        })
    };
    let prefix = config.weight_prefix.as_deref().unwrap_or("model.");
    let mut layers: std::collections::BTreeMap<usize, LayerMlp> = Default::default();
    for (name, shape) in tensors {
        let Some(rest) = name
            .strip_prefix(prefix)
            .and_then(|r| r.strip_prefix("layers."))
        else {
            continue;
        };
        let Some((l, rest)) = rest.split_once('.') else {
            continue;
        };
        let (Ok(l), Some(mlp)) = (l.parse::<usize>(), rest.strip_prefix("mlp.")) else {
            continue;
        };
        let layer = layers.entry(l).or_default();
        let first = |slot: &mut Option<String>| {
            if slot.as_ref().is_none_or(|s| name < s) {
                *slot = Some(name.clone());
            }
        };
        if let Some(e) = mlp.strip_prefix("experts.") {
            first(&mut layer.sparse);
            let held = match e.split_once('.') {
                Some((n, _)) => n.parse::<usize>().ok().map(|n| n + 1),
                None if e == "gate_up_proj" => shape.first().copied(),
                None => None,
            };
            layer.experts = layer.experts.max(held);
        } else if mlp == "gate.weight" {
            first(&mut layer.sparse);
        } else {
            first(&mut layer.dense);
        }
    }
    let moe_arch = config.facts()?.moe;
    let m = &config.moe;
    let key = m.experts_key();
    let experts = m.experts();
    // The keys that pick the MoE layers, as set (for messages).
    let layer_keys = || {
        let only = m.mlp_only_layers.as_deref().unwrap_or(&[]);
        format!(
            "`mlp_only_layers` = {only:?}, `decoder_sparse_step` = {}",
            m.decoder_sparse_step.unwrap_or(1)
        )
    };
    for (&l, layer) in &layers {
        let said_moe = config.is_moe_layer(l);
        match (&layer.sparse, said_moe) {
            (Some(t), false) if !moe_arch => {
                return fail(format!(
                    "model_type {:?} has dense MLPs, but the weights hold mixture-of-experts \
                     tensors ({prefix}layers.{l}.mlp.experts.*, e.g. {t}): a Qwen3-MoE checkpoint \
                     needs model_type \"qwen3_moe\" and its expert count in `num_experts` or \
                     `num_local_experts`",
                    config.model_type
                ));
            }
            (Some(t), false) if experts == 0 => {
                let held = layer
                    .experts
                    .map_or(String::new(), |n| format!(" ({n} in the weights)"));
                return fail(format!(
                    "the config sets no expert count (neither `num_experts` nor \
                     `num_local_experts`), so every layer would be built as a dense MLP, but the \
                     weights hold mixture-of-experts tensors ({prefix}layers.{l}.mlp.experts.*, \
                     e.g. {t}): set `num_local_experts` (the name transformers ≥ 5.24 writes) or \
                     `num_experts` (≤ 5.23) to the number of experts{held}"
                ));
            }
            (Some(t), false) => {
                return fail(format!(
                    "config keys {} make layer {l} a dense MLP, but the weights hold \
                     mixture-of-experts tensors there ({prefix}layers.{l}.mlp.experts.*, e.g. \
                     {t}): fix `mlp_only_layers` or `decoder_sparse_step`",
                    layer_keys()
                ));
            }
            (None, true) => {
                if let Some(t) = &layer.dense {
                    return fail(format!(
                        "config key `{key}` = {experts} (with {}) makes layer {l} a \
                         mixture-of-experts layer, but the weights hold a dense MLP there (e.g. \
                         {t}) and no {prefix}layers.{l}.mlp.experts.* tensor: fix \
                         `mlp_only_layers` or `decoder_sparse_step`, or remove `{key}` if the \
                         model is dense",
                        layer_keys()
                    ));
                }
            }
            (Some(_), true) => {
                if let Some(n) = layer.experts.filter(|&n| n != experts) {
                    return fail(format!(
                        "config key `{key}` = {experts} does not match the weights: \
                         {prefix}layers.{l}.mlp.experts.* hold {n} experts"
                    ));
                }
            }
            (None, false) => {}
        }
    }
    Ok(())
}

/// The largest safetensors header read (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One tensor of a safetensors header.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderTensor {
    pub name: String,
    /// The stored type as the header names it (`F32`, `BF16`, `I64`, …).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// `data_offsets`: where its bytes lie in the data region.
    pub offsets: (u64, u64),
}

impl HeaderTensor {
    /// Whether the stored type is a floating-point one.
    pub fn is_float(&self) -> bool {
        self.dtype.starts_with('F') || self.dtype == "BF16"
    }
}

/// Bytes per element of a safetensors dtype (`None`: not a type of the format).
fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// A JSON object's entries in order, duplicates kept (serde_json's map keeps the last).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some(e) = m.next_entry()? {
                    out.push(e);
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Names and shapes of the tensors of one safetensors file, from its header only
/// ([`safetensors_tensors`]).
pub fn safetensors_header(path: &Path) -> Result<Vec<(String, Vec<usize>)>, HfError> {
    Ok(safetensors_tensors(path)?
        .into_iter()
        .map(|t| (t.name, t.shape))
        .collect())
}

/// The tensors of one safetensors file, from its header only, checked as the format requires:
/// a header of at most 100 MB that is one JSON object, each name once, known dtypes,
/// `data_offsets` holding exactly the shape's bytes, and the tensors tiling the data region
/// (from 0 to the end of the file, no gap, no overlap).
pub fn safetensors_tensors(path: &Path) -> Result<Vec<HeaderTensor>, HfError> {
    let bad = |m: String| HfError::Safetensors {
        path: path.to_path_buf(),
        message: m,
    };
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| bad("not a safetensors file (too short)".into()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES || n.saturating_add(8) > file_len {
        return Err(bad(format!(
            "not a safetensors file (header length {n} for a file of {file_len} bytes)"
        )));
    }
    let mut head = vec![0u8; n as usize];
    f.read_exact(&mut head).map_err(io_err(path))?;
    let entries: Entries = serde_json::from_slice(&head)
        .map_err(|e| bad(format!("invalid safetensors header: {e}")))?;
    let data_len = file_len - 8 - n;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(entries.0.len());
    for (name, v) in entries.0 {
        if !seen.insert(name.clone()) {
            return Err(bad(format!("tensor {name:?} is named twice in the header")));
        }
        if name == "__metadata__" {
            continue;
        }
        let dtype = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad(format!("tensor {name:?} has no dtype")))?
            .to_string();
        let size = dtype_bytes(&dtype).ok_or_else(|| {
            bad(format!(
                "tensor {name:?} has dtype {dtype:?}, not a safetensors type"
            ))
        })?;
        let shape = v
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| bad(format!("tensor {name:?} has no valid shape")))?;
        let offsets = v
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .and_then(|o| match o.as_slice() {
                [b, e] => Some((b.as_u64()?, e.as_u64()?)),
                _ => None,
            })
            .ok_or_else(|| bad(format!("tensor {name:?} has no valid data_offsets")))?;
        let bytes = shape.iter().try_fold(size, |a, &d| a.checked_mul(d as u64));
        if offsets.0 > offsets.1 || Some(offsets.1 - offsets.0) != bytes {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets {:?} do not hold the {} bytes of {dtype} {shape:?}",
                [offsets.0, offsets.1],
                bytes.map_or("overflowing".into(), |b| b.to_string())
            )));
        }
        out.push(HeaderTensor {
            name,
            dtype,
            shape,
            offsets,
        });
    }
    // The tensors tile the data region: sorted by start, each begins where the last ended.
    let mut order: Vec<&HeaderTensor> = out.iter().collect();
    order.sort_by_key(|t| t.offsets);
    let mut end = 0u64;
    for t in order {
        if t.offsets.0 != end {
            let what = if t.offsets.0 > end {
                "a gap before"
            } else {
                "an overlap at"
            };
            return Err(bad(format!(
                "tensor {:?}: data_offsets {:?} leave {what} byte {end} of the data region",
                t.name,
                [t.offsets.0, t.offsets.1]
            )));
        }
        end = t.offsets.1;
    }
    if end != data_len {
        return Err(bad(format!(
            "the tensors end at byte {end} of the data region, but it holds {data_len} bytes \
             (truncated or padded?)"
        )));
    }
    Ok(out)
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
    let text = read_capped(&index, limits::INDEX_JSON, "safetensors index")?;
    let idx: Index = serde_json::from_slice(&text).map_err(|source| HfError::Json {
        path: index.clone(),
        source,
    })?;
    let files: BTreeSet<&String> = idx.weight_map.values().collect();
    // A shard is a file of the model's directory: an index naming `../x`, `/etc/x` or `a/b`
    // would have the server read files outside it.
    let outside = |f: &str| {
        let mut parts = Path::new(f).components();
        !matches!(
            (parts.next(), parts.next()),
            (Some(std::path::Component::Normal(_)), None)
        )
    };
    if let Some(f) = files.iter().find(|f| outside(f)) {
        return Err(HfError::Safetensors {
            path: index,
            message: format!(
                "shard {f:?} is not the name of a file in the model's directory (no folders, \
                 `..` or absolute paths)"
            ),
        });
    }
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
    std::fs::File::open(path)
        .and_then(sha256_hex)
        .map_err(io_err(path))
}

/// SHA-256 of everything `reader` yields, hex; read in 1 MiB blocks, so a multi-gigabyte
/// checkpoint or model file is never held in memory. The one checksum of the project
/// (checkpoint manifests, model fingerprints, the demo's downloads).
pub fn sha256_hex(mut reader: impl std::io::Read) -> std::io::Result<String> {
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            return Ok(hex::encode(hash.finalize()));
        }
        hash.update(&buf[..n]);
    }
}

/// The tokenizer of the `tokenizer.json` at `path` (at most [`limits::TOKENIZER_JSON`] bytes),
/// parsed by [`crate::tokenizer_json::parse`].
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, HfError> {
    let bytes = read_capped(path, limits::TOKENIZER_JSON, "tokenizer.json")?;
    crate::tokenizer_json::parse(&bytes)
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
    let facts = arch.facts();
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
        obj.retain(|_, v| !v.is_null());
        // The config's own values win; these fill what transformers would otherwise default.
        let act = facts.activation;
        obj.entry(act.key)
            .or_insert_with(|| serde_json::json!(act.default));
        obj.insert("attention_dropout".into(), serde_json::json!(0.0));
        obj.insert("use_cache".into(), serde_json::json!(true));
        if facts.window.switch == WindowSwitch::UseSlidingWindow {
            obj.entry("use_sliding_window")
                .or_insert_with(|| serde_json::json!(false));
            obj.entry("max_window_layers")
                .or_insert_with(|| serde_json::json!(config.num_hidden_layers));
        }
        if facts.has_mlp_bias_key {
            obj.insert("mlp_bias".into(), serde_json::json!(false));
        }
        obj.retain(|_, v| !v.is_null());
        // An explicit `"sliding_window": null` means "no window"; absent would mean the
        // architecture's default (4096 for Mistral), so the null is kept.
        if config.window.sliding_window == Some(None) {
            obj.insert("sliding_window".into(), serde_json::Value::Null);
        }
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
        assert!(matches!(
            bad.validate(),
            Err(ModelConfigError::UnsupportedArch(..))
        ));
        bad = l.clone();
        bad.num_key_value_heads = Some(3);
        assert!(bad.validate().is_err());
    }

    /// A tiny Llama directory (random weights, a placeholder tokenizer file) under `root`.
    fn tiny_dir(root: &Path, name: &str) -> PathBuf {
        let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 64}))
        .unwrap();
        let params = crate::init::random_params(&cfg, 0.1, 1).unwrap();
        let tok = root.join("tokenizer.json");
        std::fs::write(&tok, "{}").unwrap();
        let dir = root.join(name);
        write_model_dir(&dir, &cfg, &params, &tok).unwrap();
        dir
    }

    /// Rewrites the header of `dir`'s model.safetensors with `edit` (on its JSON text).
    fn edit_header(dir: &Path, edit: impl FnOnce(String) -> String) {
        let p = dir.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let head = edit(String::from_utf8(bytes[8..8 + n].to_vec()).unwrap());
        let mut out = (head.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&p, out).unwrap();
    }

    /// The header entry of tensor `name` as JSON text.
    fn entry(head: &str, name: &str) -> String {
        let v: serde_json::Value = serde_json::from_str(head).unwrap();
        v[name].to_string()
    }

    /// Safetensors headers are checked as the format requires, and a float weight stored as an
    /// integer is refused, each by name, at open (before any weight is read).
    #[test]
    fn malformed_safetensors_are_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        let good = tiny_dir(root.path(), "good");
        ModelDir::open(&good).unwrap();
        let err = |name: &str, edit: &dyn Fn(String) -> String| {
            let dir = tiny_dir(root.path(), name);
            edit_header(&dir, edit);
            ModelDir::open(&dir).unwrap_err().to_string()
        };
        // A second record named like another tensor, pointing at layer 0's norm.
        let e = err("dup", &|h| {
            let e = entry(&h, "model.layers.0.input_layernorm.weight");
            format!(
                "{},\"model.norm.weight\":{e}}}",
                h.trim_end().strip_suffix('}').unwrap()
            )
        });
        assert!(e.contains("\"model.norm.weight\" is named twice"), "{e}");
        // A float weight stored as I32 (same size: the offsets still tile).
        let e = err("int", &|h| {
            let at = "\"model.norm.weight\":{\"dtype\":";
            assert!(h.contains(&format!("{at}\"F32\"")), "{h}");
            h.replace(&format!("{at}\"F32\""), &format!("{at}\"I32\""))
        });
        assert!(e.contains("\"model.norm.weight\" is stored as I32"), "{e}");
        // data_offsets that do not hold the shape's bytes.
        let e = err("offsets", &|h| {
            let old = entry(&h, "model.norm.weight");
            let v: serde_json::Value = serde_json::from_str(&old).unwrap();
            let [b, e] =
                [&v["data_offsets"][0], &v["data_offsets"][1]].map(|x| x.as_u64().unwrap());
            h.replacen(&format!("[{b},{e}]"), &format!("[{b},{}]", e - 4), 1)
        });
        assert!(
            e.contains("\"model.norm.weight\": data_offsets") && e.contains("do not hold"),
            "{e}"
        );
        // A dtype the format does not have.
        let e = err("dtype", &|h| h.replacen("\"F32\"", "\"F31\"", 1));
        assert!(e.contains("\"F31\", not a safetensors type"), "{e}");
        // A file cut short: the tensors no longer tile the data region.
        let dir = tiny_dir(root.path(), "short");
        let p = dir.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let e = ModelDir::open(&dir).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        // The same names in two shards (each shard a copy of the single file).
        let dir = tiny_dir(root.path(), "shards");
        let single = dir.join("model.safetensors");
        for shard in ["a.safetensors", "b.safetensors"] {
            std::fs::copy(&single, dir.join(shard)).unwrap();
        }
        std::fs::remove_file(&single).unwrap();
        let index = serde_json::json!({"weight_map": {
            "model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "b.safetensors"}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let e = ModelDir::open(&dir).unwrap_err().to_string();
        assert!(
            e.contains("b.safetensors") && e.contains("is stored twice (also in"),
            "{e}"
        );
        // Shards outside the model's directory are refused before any is opened (the first of
        // each pair exists, so only the name refuses it).
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::fs::copy(dir.join("a.safetensors"), dir.join("sub/a.safetensors")).unwrap();
        let elsewhere = dir.join("a.safetensors").canonicalize().unwrap();
        for name in [
            "../shards/a.safetensors".to_string(),
            elsewhere.display().to_string(),
            "sub/a.safetensors".to_string(),
            "./a.safetensors".to_string(),
            "..".to_string(),
            String::new(),
        ] {
            let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": name}});
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
            let e = ModelDir::open(&dir).unwrap_err().to_string();
            assert!(
                e.contains("is not the name of a file in the model's directory")
                    && e.contains("model.safetensors.index.json"),
                "{name}: {e}"
            );
        }
        // A file given as a model: neither GGUF nor a directory.
        let e = ModelDir::open(&p).unwrap_err().to_string();
        assert!(e.contains("neither a GGUF file"), "{e}");
    }

    /// A model directory's small files longer than any real one, or never ending (a device in
    /// a file's place), are refused by name instead of read into memory: a sparse file before
    /// a byte is read, `/dev/zero` after the limit.
    #[test]
    fn oversized_and_endless_files_are_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        let dir = tiny_dir(root.path(), "m");
        let cfg = dir.join("config.json");
        let good = std::fs::read(&cfg).unwrap();
        let zero = Path::new("/dev/zero");
        // config.json: 17 MiB (sparse), then /dev/zero in its place.
        std::fs::File::create(&cfg)
            .unwrap()
            .set_len(limits::CONFIG_JSON + 1)
            .unwrap();
        let e = ModelDir::open(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json: more than 16777216 bytes"), "{e}");
        if zero.exists() {
            std::fs::remove_file(&cfg).unwrap();
            std::os::unix::fs::symlink(zero, &cfg).unwrap();
            let e = ModelDir::open(&dir).unwrap_err().to_string();
            assert!(e.contains("far more than a config.json holds"), "{e}");
        }
        std::fs::remove_file(&cfg).unwrap();
        std::fs::write(&cfg, &good).unwrap();
        let m = ModelDir::open(&dir).unwrap();
        // tokenizer.json: 513 MiB (sparse), refused before reading.
        std::fs::File::create(&m.tokenizer)
            .unwrap()
            .set_len(limits::TOKENIZER_JSON + 1)
            .unwrap();
        let e = m.load_tokenizer().unwrap_err().to_string();
        assert!(e.contains("far more than a tokenizer.json holds"), "{e}");
        // The index of a sharded model: 65 MiB (sparse). (A device there is not a regular file:
        // no weights.)
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        std::fs::File::create(dir.join("model.safetensors.index.json"))
            .unwrap()
            .set_len(limits::INDEX_JSON + 1)
            .unwrap();
        let e = ModelDir::open(&dir).unwrap_err().to_string();
        assert!(e.contains("far more than a safetensors index holds"), "{e}");
        // Within the limit, the bytes as they are.
        let small = root.path().join("small");
        std::fs::write(&small, b"0123456789").unwrap();
        assert_eq!(read_capped(&small, 10, "file").unwrap(), b"0123456789");
        assert!(read_capped(&small, 9, "file").is_err());
    }

    /// Absurd sizes are refused by key before anything is sized from them.
    #[test]
    fn sizes_are_bounded_before_use() {
        let base = serde_json::json!({"model_type": "llama", "vocab_size": 16, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2});
        let bad = |key: &str, v: serde_json::Value| {
            let mut j = base.clone();
            j[key] = v;
            let c: ModelConfig = serde_json::from_value(j).unwrap();
            c.validate().unwrap_err().to_string()
        };
        // 2^31 layers: refused before the per-layer list (2 GB) is made.
        assert!(bad("num_hidden_layers", (1u64 << 31).into()).contains("`num_hidden_layers`"));
        assert!(bad("max_position_embeddings", (1u64 << 27).into())
            .contains("`max_position_embeddings`"));
        assert!(bad("rms_norm_eps", (-1.0).into()).contains("`rms_norm_eps`"));
        assert!(bad("rms_norm_eps", 0.0.into()).contains("`rms_norm_eps`"));
        assert!(bad("vocab_size", (1u64 << 40).into()).contains("`vocab_size`"));
        // A zero head size is named, not reported as a RoPE setting.
        assert!(bad("head_dim", 0.into()).contains("head_dim must be positive"));
        // Stop and start ids the embedding has no row for (vocab_size 16).
        assert!(bad("eos_token_id", 16.into()).contains("`eos_token_id` names id 16"));
        assert!(bad("eos_token_id", serde_json::json!([2, 50000])).contains("id 50000"));
        assert!(bad("bos_token_id", 99.into()).contains("`bos_token_id`"));
        let mut ok = base.clone();
        (ok["eos_token_id"], ok["bos_token_id"]) = (15.into(), 0.into());
        serde_json::from_value::<ModelConfig>(ok)
            .unwrap()
            .validate()
            .unwrap();
    }

    /// EOS ids that are not token ids are left out, never cast into other ids (2^32 + 5 was 5).
    #[test]
    fn eos_ids_that_are_not_token_ids_are_left_out() {
        let eos = |v: serde_json::Value| {
            let c: ModelConfig = serde_json::from_value(serde_json::json!({
                "model_type": "llama", "vocab_size": 16, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                "eos_token_id": v}))
            .unwrap();
            c.eos_ids()
        };
        assert_eq!(eos(serde_json::json!((1u64 << 32) + 5)), Vec::<u32>::new());
        assert_eq!(
            eos(serde_json::json!([7, (1u64 << 32) + 5, -1, 2.5, "x", 9])),
            vec![7, 9]
        );
        assert_eq!(eos(serde_json::json!(u32::MAX)), vec![u32::MAX]);
        assert_eq!(eos(serde_json::json!(null)), Vec::<u32>::new());
    }
}
