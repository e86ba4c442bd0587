//! Every size a model file states (layer counts, vocabulary, widths, heads, head_dim, context
//! length), checked against sane limits and against the file's own tensors **before** anything
//! is allocated from it. The decoder sizes its buffers from the config (a `Vec` per layer, RoPE
//! tables of `max_position_embeddings` rows, the parameter list), so an absurd value — 2^31
//! layers, a 2^27-token context — would otherwise allocate gigabytes before any refusal.
//!
//! One home for both paths: [`check_limits`] runs first in [`ModelConfig::validate`] (so in
//! [`crate::hf::ModelDir::open`] and [`crate::gguf::GgufModel::open`]); [`check_sizes`] compares
//! a `config.json` with its safetensors headers in `ModelDir::open`; [`check_all_shapes`] compares
//! every parameter's shape (the trainer's loads); the GGUF path compares every shape in its own
//! tensor map after bounding `block_count` by the tensors it holds.

use crate::hf::{HfError, ModelConfig};
use crate::model::config::ModelConfigError;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Most layers (`num_hidden_layers`, GGUF `block_count`); the largest published models have
/// under 200.
pub const MAX_LAYERS: usize = 1 << 12;
/// Largest vocabulary (`vocab_size`); published ones are under 2^18.
pub const MAX_VOCAB: usize = 1 << 24;
/// Largest width: `hidden_size`, `intermediate_size`, `moe_intermediate_size`.
pub const MAX_WIDTH: usize = 1 << 20;
/// Most attention heads (query or key/value) and experts.
pub const MAX_HEADS: usize = 1 << 12;
/// Largest `head_dim`.
pub const MAX_HEAD_DIM: usize = 1 << 12;
/// Cap on `max_position_embeddings × head_dim / 2`: the size of each of the two RoPE tables the
/// decoder precomputes (2^26 f32 = 256 MiB; a 1M-token context at head_dim 128 still fits).
pub const MAX_ROPE_TABLE: u128 = 1 << 26;

fn too_large(key: &str, value: usize, max: usize) -> ModelConfigError {
    ModelConfigError::Invalid(format!(
        "config key `{key}` = {value} is too large (at most {max})"
    ))
}

/// Refuses a size over its limit (the constants above), a non-positive or non-finite
/// `rms_norm_eps`, and RoPE tables over [`MAX_ROPE_TABLE`]. Allocates nothing: it runs before
/// anything else looks at the config.
pub fn check_limits(cfg: &ModelConfig) -> Result<(), ModelConfigError> {
    let m = &cfg.moe;
    for (key, value, max) in [
        ("num_hidden_layers", cfg.num_hidden_layers, MAX_LAYERS),
        ("vocab_size", cfg.vocab_size, MAX_VOCAB),
        ("hidden_size", cfg.hidden_size, MAX_WIDTH),
        ("intermediate_size", cfg.intermediate_size, MAX_WIDTH),
        ("num_attention_heads", cfg.num_attention_heads, MAX_HEADS),
        (
            "num_key_value_heads",
            cfg.num_key_value_heads.unwrap_or(0),
            MAX_HEADS,
        ),
        ("head_dim", cfg.head_dim.unwrap_or(0), MAX_HEAD_DIM),
        (
            "moe_intermediate_size",
            m.moe_intermediate_size.unwrap_or(0),
            MAX_WIDTH,
        ),
        ("num_experts", m.num_experts.unwrap_or(0), MAX_HEADS),
        (
            "num_local_experts",
            m.num_local_experts.unwrap_or(0),
            MAX_HEADS,
        ),
    ] {
        if value > max {
            return Err(too_large(key, value, max));
        }
    }
    if !(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0) {
        return Err(ModelConfigError::Invalid(format!(
            "config key `rms_norm_eps` = {} must be positive and finite",
            cfg.rms_norm_eps
        )));
    }
    // A stop or start id the model has no embedding row for: appended to every SFT record it
    // would fail the first step (on a GPU as a device-side assert, which names nothing).
    let bos: Vec<u32> = cfg.bos_id().into_iter().collect();
    for (key, ids) in [("eos_token_id", cfg.eos_ids()), ("bos_token_id", bos)] {
        if let Some(id) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(ModelConfigError::Invalid(format!(
                "config key `{key}` names id {id}, outside the vocabulary (`vocab_size` = {})",
                cfg.vocab_size
            )));
        }
    }
    check_rope(cfg)
}

/// Refuses a `max_position_embeddings` whose RoPE tables would not fit ([`MAX_ROPE_TABLE`]).
pub fn check_rope(cfg: &ModelConfig) -> Result<(), ModelConfigError> {
    let half = (cfg.head_dim().min(MAX_HEAD_DIM) as u128 / 2).max(1);
    let table = cfg.max_position_embeddings as u128 * half;
    if table > MAX_ROPE_TABLE {
        return Err(ModelConfigError::Invalid(format!(
            "config key `max_position_embeddings` = {} is too large: its RoPE tables would hold \
             {table} entries each (at most {MAX_ROPE_TABLE})",
            cfg.max_position_embeddings
        )));
    }
    Ok(())
}

/// Tensor name → (shape, file it is stored in), from safetensors headers only.
pub type Shapes = HashMap<String, (Vec<usize>, PathBuf)>;

/// The layer indices `N` of the tensors named `{prefix}N.…`.
pub fn layers_held<'a>(names: impl Iterator<Item = &'a str>, prefix: &str) -> BTreeSet<usize> {
    names
        .filter_map(|k| k.strip_prefix(prefix)?.split('.').next()?.parse().ok())
        .collect()
}

/// Checks `cfg` (read from `cfg_path`) against the tensors' shapes: the layers held are exactly
/// `0..num_hidden_layers`, the embedding is `[vocab_size, hidden_size]`, q/k rows match the head
/// counts × `head_dim` and gate rows `intermediate_size` (where those tensors are stored
/// separately). A mismatch is refused naming the key, the tensor and the file.
pub fn check_sizes(cfg: &ModelConfig, cfg_path: &Path, shapes: &Shapes) -> Result<(), HfError> {
    let file = cfg_path.display().to_string();
    let fail = |message: String| HfError::ConfigVsWeights {
        path: cfg_path.to_path_buf(),
        message,
    };
    let name = |n: &str| match &cfg.weight_prefix {
        Some(p) => crate::model::stored_name(p, n),
        None => n.to_string(),
    };
    let shape = |n: &str| -> Result<&(Vec<usize>, PathBuf), HfError> {
        let n = name(n);
        shapes
            .get(&n)
            .ok_or_else(|| fail(format!("the weights have no tensor {n:?}")))
    };
    // 1. Layers: the distinct N of `model.layers.N.` must be exactly 0..num_hidden_layers.
    let layer_prefix = name("model.layers.");
    let layers = layers_held(shapes.keys().map(String::as_str), &layer_prefix);
    if cfg.num_hidden_layers != layers.len() {
        return Err(fail(format!(
            "config key `num_hidden_layers` = {} does not match the weights, which hold {} \
             layers ({layer_prefix}N.*)",
            cfg.num_hidden_layers,
            layers.len()
        )));
    }
    if let Some(gap) = (0..layers.len()).find(|l| !layers.contains(l)) {
        return Err(fail(format!(
            "the weights have no tensors {layer_prefix}{gap}.* (`num_hidden_layers` = {})",
            cfg.num_hidden_layers
        )));
    }
    // 2. Embedding: [vocab_size, hidden_size].
    let (emb, emb_file) = shape("model.embed_tokens.weight")?;
    let key_vs_dim = |key: &str, value: usize, what: &str, got: usize, f: &Path| {
        fail(format!(
            "config key `{key}` = {value} does not match the weights: {what} is {got} in {}",
            f.display()
        ))
    };
    if emb.len() != 2 {
        return Err(fail(format!(
            "{}: the embedding has shape {emb:?}, expected 2 dimensions",
            emb_file.display()
        )));
    }
    if emb[0] != cfg.vocab_size {
        let what = "the embedding's row count";
        return Err(key_vs_dim(
            "vocab_size",
            cfg.vocab_size,
            what,
            emb[0],
            emb_file,
        ));
    }
    if emb[1] != cfg.hidden_size {
        let what = "the embedding's column count";
        return Err(key_vs_dim(
            "hidden_size",
            cfg.hidden_size,
            what,
            emb[1],
            emb_file,
        ));
    }
    // 3. Attention and MLP widths on layer 0 (Phi-3's fused qkv_proj / gate_up_proj and the
    // experts are compared by shape in `check_all_shapes` and by the decoder's build).
    let rows = |n: &str| -> Result<(usize, &Path), HfError> {
        let (s, f) = shape(n)?;
        Ok((s.first().copied().unwrap_or(0), f.as_path()))
    };
    let has = |n: &str| shapes.contains_key(&name(n));
    let separate_qkv = has("model.layers.0.self_attn.q_proj.weight")
        || !has("model.layers.0.self_attn.qkv_proj.weight");
    if separate_qkv {
        let d = cfg.head_dim();
        let (q_rows, qf) = rows("model.layers.0.self_attn.q_proj.weight")?;
        if cfg.num_attention_heads.checked_mul(d) != Some(q_rows) {
            let key = if cfg.head_dim.is_some() {
                "num_attention_heads` × `head_dim"
            } else {
                "num_attention_heads"
            };
            return Err(fail(format!(
                "config key `{key}` ({} heads × head_dim {d}) does not match the weights: \
                 q_proj has {q_rows} rows in {}",
                cfg.num_attention_heads,
                qf.display()
            )));
        }
        let (k_rows, kf) = rows("model.layers.0.self_attn.k_proj.weight")?;
        if cfg.kv_heads().checked_mul(d) != Some(k_rows) {
            return Err(fail(format!(
                "config key `num_key_value_heads` = {} (× head_dim {d}) does not match the \
                 weights: k_proj has {k_rows} rows in {}",
                cfg.kv_heads(),
                kf.display()
            )));
        }
    }
    if has("model.layers.0.mlp.gate_proj.weight") {
        let (i_rows, gf) = rows("model.layers.0.mlp.gate_proj.weight")?;
        if cfg.intermediate_size != i_rows {
            let what = "gate_proj's row count";
            return Err(key_vs_dim(
                "intermediate_size",
                cfg.intermediate_size,
                what,
                i_rows,
                gf,
            ));
        }
    }
    // 4. RoPE tables are sized by max_position_embeddings alone (no tensor to compare with).
    check_rope(cfg).map_err(|e| fail(format!("{file}: {e}")))?;
    Ok(())
}

/// [`check_sizes`], then every parameter the config implies compared with its stored shape (the
/// list is bounded now that the layers are).
pub fn check_all_shapes(
    cfg: &ModelConfig,
    cfg_path: &Path,
    shapes: &Shapes,
) -> Result<(), HfError> {
    check_sizes(cfg, cfg_path, shapes)?;
    for spec in crate::model::param_specs(cfg, 0.0) {
        let (got, f) = shapes
            .get(&spec.name)
            .ok_or_else(|| HfError::ConfigVsWeights {
                path: cfg_path.to_path_buf(),
                message: format!("the weights have no tensor {:?}", spec.name),
            })?;
        if *got != spec.shape {
            return Err(HfError::ConfigVsWeights {
                path: cfg_path.to_path_buf(),
                message: format!(
                    "the config implies shape {:?} for {:?}, but it is {got:?} in {}",
                    spec.shape,
                    spec.name,
                    f.display()
                ),
            });
        }
    }
    Ok(())
}
