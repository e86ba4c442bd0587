//! The model's hyper-parameters from GGUF metadata (`general.architecture` and the
//! `{arch}.*` keys llama.cpp writes), as the [`ModelConfig`] a `config.json` would give, read
//! the way transformers' GGUF loader maps them.

use super::meta::Meta;
use super::GgufError;
use crate::hf::{Arch, ModelConfig};

/// The decoder of GGUF architecture `name` (the one whose facts name it), or a refusal naming it.
pub(crate) fn arch_of(meta: &Meta, name: &str) -> Result<Arch, GgufError> {
    Arch::from_gguf(name).ok_or_else(|| GgufError::UnsupportedArch {
        path: meta.path.to_path_buf(),
        arch: name.to_string(),
    })
}

/// The GGUF architectures implemented (as the architectures' facts name them), for messages.
pub(crate) fn gguf_names() -> String {
    crate::model::arch::list_names(|f| f.gguf.map(|g| g.name.to_string()))
}

/// Facts the config needs from outside the `{arch}.*` keys.
pub(crate) struct TensorFacts {
    /// `output.weight` is absent: the LM head is the embedding (transformers' rule).
    pub(crate) tied: bool,
    /// `blk.0.attn_q.bias` is present (Llama with attention biases).
    pub(crate) attn_bias: bool,
    /// Rows of `token_embd.weight`.
    pub(crate) embed_rows: usize,
}

/// Builds and validates the config. `tokens` is the length of `tokenizer.ggml.tokens`, the
/// vocabulary size when `{arch}.vocab_size` is absent (as transformers reads it).
pub(crate) fn model_config(
    meta: &Meta,
    gguf_arch: &str,
    tokens: Option<usize>,
    t: &TensorFacts,
) -> Result<ModelConfig, GgufError> {
    let arch = arch_of(meta, gguf_arch)?;
    let facts = arch.facts().gguf;
    let k = |s: &str| format!("{gguf_arch}.{s}");
    // RoPE scaling is stored under other keys (and for Llama 3 as a `rope_freqs` tensor); none is
    // mapped yet, so a file that sets one is refused rather than served with plain RoPE.
    let scaling_key = k("rope.scaling.type");
    if let Some(kind) = meta.opt_str(&scaling_key)? {
        if kind != "none" {
            return Err(GgufError::Key {
                path: meta.path.to_path_buf(),
                key: scaling_key,
                message: format!("RoPE scaling {kind:?} is not implemented for GGUF files"),
            });
        }
    }
    let heads = meta.usize(&k("attention.head_count"))?;
    let hidden = meta.usize(&k("embedding_length"))?;
    let head_dim = match meta.opt_usize(&k("attention.key_length"))? {
        Some(d) => Some(d),
        None if facts.is_some_and(|g| g.head_dim_from_rope) => {
            meta.opt_usize(&k("rope.dimension_count"))?
        }
        None => None,
    };
    let vocab = match meta.opt_usize(&k("vocab_size"))? {
        Some(v) => v,
        None => tokens.unwrap_or(t.embed_rows),
    };
    let bos = meta.opt_usize("tokenizer.ggml.bos_token_id")?;
    let eos = meta.opt_usize("tokenizer.ggml.eos_token_id")?;
    let pad = meta.opt_usize("tokenizer.ggml.padding_token_id")?;
    let json = serde_json::json!({
        "model_type": arch.model_type(),
        "architectures": [arch.hf_class()],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.usize(&k("feed_forward_length"))?,
        "num_hidden_layers": meta.usize(&k("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.opt_usize(&k("attention.head_count_kv"))?.unwrap_or(heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.usize(&k("context_length"))?,
        "rms_norm_eps": meta
            .opt_f64(&k("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| GgufError::Key {
                path: meta.path.to_path_buf(),
                key: k("attention.layer_norm_rms_epsilon"),
                message: "missing (required)".into(),
            })?,
        // llama.cpp's and transformers' default base when the key is absent.
        "rope_theta": meta.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0),
        "tie_word_embeddings": t.tied,
        "attention_bias": facts.is_some_and(|g| g.attention_bias_from_tensors) && t.attn_bias,
        "hidden_act": "silu",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    });
    let cfg: ModelConfig = serde_json::from_value(json).map_err(|e| GgufError::Format {
        path: meta.path.to_path_buf(),
        message: format!("metadata does not make a model config: {e}"),
    })?;
    // RoPE tables are sized by the context length alone: refused under the GGUF key's name.
    crate::model_check::check_rope(&cfg).map_err(|e| GgufError::Key {
        path: meta.path.to_path_buf(),
        key: k("context_length"),
        message: e.to_string(),
    })?;
    cfg.validate().map_err(|e| GgufError::Format {
        path: meta.path.to_path_buf(),
        message: format!("metadata makes an invalid model config: {e}"),
    })?;
    Ok(cfg)
}
