//! Writing GGUF files as llama.cpp's converter (`convert_hf_to_gguf.py`) would: transformers'
//! parameters renamed, Llama's q/k rows permuted, matrices stored in a chosen ggml type, and the
//! hyper-parameters and a byte-level BPE tokenizer as metadata. Tests and fixtures use it to make
//! small GGUF files without llama.cpp; the loader ([`super::GgufModel`]) must read them back to
//! the same model.

use super::names;
use crate::hf::ModelConfig;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::Path;

/// GGUF metadata for the byte-level BPE tokenizer of a `tokenizer.json` (its `model.vocab`,
/// `model.merges` and `added_tokens`): tokens by id, merges as `"a b"`, token types (control for
/// special added tokens, user-defined for other added tokens, normal else) and `pre` as
/// `tokenizer.ggml.pre`. Ids without a token are filled with `[PADn]`, as llama.cpp does.
pub fn bpe_tokenizer_metadata(
    tokenizer_json: &serde_json::Value,
    pre: &str,
) -> anyhow::Result<Vec<(String, Value)>> {
    use anyhow::Context;
    let model = &tokenizer_json["model"];
    let vocab = model["vocab"]
        .as_object()
        .context("tokenizer.json has no model.vocab object")?;
    let mut by_id: HashMap<usize, (String, i32)> = HashMap::new();
    for (t, id) in vocab {
        let id = id.as_u64().context("a vocab id is not an integer")? as usize;
        by_id.insert(id, (t.clone(), 1));
    }
    for a in tokenizer_json["added_tokens"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let id = a["id"].as_u64().context("an added token has no id")? as usize;
        let content = a["content"]
            .as_str()
            .context("an added token has no content")?;
        let ty = if a["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
        by_id.insert(id, (content.to_string(), ty));
    }
    let n = by_id.keys().max().map_or(0, |m| m + 1);
    let mut tokens = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for id in 0..n {
        let (t, ty) = by_id
            .remove(&id)
            .unwrap_or_else(|| (format!("[PAD{id}]"), 5));
        tokens.push(Value::String(t));
        types.push(Value::I32(ty));
    }
    let merges: Vec<Value> = model["merges"]
        .as_array()
        .context("tokenizer.json has no model.merges")?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(Value::String(s.clone())),
            serde_json::Value::Array(p) => {
                let part = |i: usize| p.get(i).and_then(|v| v.as_str()).unwrap_or_default();
                Ok(Value::String(format!("{} {}", part(0), part(1))))
            }
            other => anyhow::bail!("merge {other} is neither a string nor a pair"),
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ])
}

/// The `{arch}.*` hyper-parameter metadata of `cfg` (arch `llama`, `qwen2` or `qwen3`).
pub fn config_metadata(arch: &str, cfg: &ModelConfig) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    let u = |x: usize| Value::U32(x as u32);
    let mut out = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (k("block_count"), u(cfg.num_hidden_layers)),
        (k("context_length"), u(cfg.max_position_embeddings)),
        (k("embedding_length"), u(cfg.hidden_size)),
        (k("feed_forward_length"), u(cfg.intermediate_size)),
        (k("attention.head_count"), u(cfg.num_attention_heads)),
        (k("attention.head_count_kv"), u(cfg.kv_heads())),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        (k("rope.freq_base"), Value::F32(cfg.rope_theta() as f32)),
        (k("vocab_size"), u(cfg.vocab_size)),
    ];
    if arch == "llama" {
        out.push((k("rope.dimension_count"), u(cfg.head_dim())));
    } else {
        out.push((k("attention.key_length"), u(cfg.head_dim())));
        out.push((k("attention.value_length"), u(cfg.head_dim())));
    }
    out
}

/// Writes `params` (transformers' names) to `path` as GGUF: matrices as `matrix_type`, 1-D
/// tensors (norms, biases) as F32, q/k rows permuted for `llama`, with `metadata`. A name that
/// is not a transformers parameter is written unchanged.
pub fn write_gguf(
    path: &Path,
    arch: &str,
    cfg: &ModelConfig,
    params: &HashMap<String, Tensor>,
    matrix_type: GgmlDType,
    metadata: &[(String, Value)],
) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut names_sorted: Vec<&String> = params.keys().collect();
    names_sorted.sort();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in names_sorted {
        // A name with no transformers counterpart is written as it is (a GGUF-only tensor).
        let g = names::gguf_name(name).unwrap_or_else(|| name.clone());
        let mut t = params[name].clone();
        let heads = names::permuted_heads(arch, &g, cfg.num_attention_heads, cfg.kv_heads());
        if let Some(h) = heads {
            t = names::permute(&t, h)?;
        }
        let ty = if t.rank() >= 2 {
            matrix_type
        } else {
            GgmlDType::F32
        };
        tensors.push((g, QTensor::quantize(&t, ty)?));
    }
    let mut f = std::fs::File::create(path).with_context(|| format!("creating {path:?}"))?;
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &meta, &ts)?;
    Ok(())
}
