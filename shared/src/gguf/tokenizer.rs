//! The tokenizer a GGUF file describes (`tokenizer.ggml.*`), rebuilt as a `tokenizer.json` the
//! way transformers' GGUF loader builds it (`integrations/gguf/gguf_tokenizer_mapping.py`), so the
//! ids are the ones transformers gives for the same file.
//!
//! Implemented: `gpt2` (byte-level BPE: tokens, merges, token types, the pre-tokenizer split
//! chosen by `tokenizer.ggml.pre`). Refused by name: `llama` (SentencePiece), `t5`, and others.

use super::meta::Meta;
use super::GgufError;
use serde_json::{json, Value};
use std::collections::HashSet;

/// `tokenizer.ggml.token_type` values (llama.cpp's `TokenType`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex of `tokenizer.ggml.pre`, as transformers' `GGUF_PRE_TOKENIZER_SPLITS`; any
/// other value keeps GPT-2's own byte-level regex (transformers' behaviour, which for some
/// types, e.g. `smollm`'s digit splitting in llama.cpp, is not llama.cpp's).
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// GPT-2's byte → printable character table (`bytes_to_unicode`).
fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        out[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\u{FFFD}');
            n += 1;
            c
        };
    }
    out
}

/// What the tokenizer metadata gives besides the `tokenizer.json`.
pub struct GgufTokenizer {
    /// The `tokenizer.json` text.
    pub json: String,
    /// `tokenizer.chat_template`, if the file has one.
    pub chat_template: Option<String>,
    /// Length of `tokenizer.ggml.tokens`.
    pub tokens: usize,
}

/// Builds the tokenizer that the metadata `map` of GGUF file `path` describes (`path` is for
/// messages only).
pub fn from_metadata(
    path: &std::path::Path,
    map: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
) -> Result<GgufTokenizer, GgufError> {
    build(&Meta { path, map })
}

/// Reads the tokenizer of a GGUF file.
pub(crate) fn build(meta: &Meta) -> Result<GgufTokenizer, GgufError> {
    let refuse = |message: String| GgufError::Tokenizer {
        path: meta.path.to_path_buf(),
        message,
    };
    let kind = meta
        .opt_str("tokenizer.ggml.model")?
        .ok_or_else(|| refuse("no tokenizer.ggml.model: the file carries no tokenizer".into()))?;
    if kind != "gpt2" {
        return Err(refuse(format!(
            "tokenizer.ggml.model {kind:?} is not implemented (only \"gpt2\", byte-level BPE, is)"
        )));
    }
    let tokens = meta
        .opt_strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| refuse("no tokenizer.ggml.tokens".into()))?;
    let merges = meta.opt_strings("tokenizer.ggml.merges")?.ok_or_else(|| {
        refuse(
            "no tokenizer.ggml.merges (a gpt2 tokenizer without merges is not implemented)".into(),
        )
    })?;
    let types = meta
        .opt_ints("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(refuse(format!(
            "tokenizer.ggml.token_type has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let alphabet = byte_alphabet();
    let spelled: HashSet<char> = alphabet.iter().copied().collect();
    let in_alphabet = |t: &str| t.chars().all(|c| spelled.contains(&c));
    // The vocabulary as transformers' `byte_level_tokenizer` spells it: a token outside the
    // byte alphabet is respelled from its UTF-8 bytes; a repeated spelling keeps the last id.
    let mut vocab = serde_json::Map::new();
    for (id, t) in tokens.iter().enumerate() {
        let key = if in_alphabet(t) {
            (*t).to_string()
        } else {
            t.bytes().map(|b| alphabet[b as usize]).collect()
        };
        vocab.insert(key, json!(id));
    }
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let Some((a, b)) = m.split_once(' ') else {
            return Err(refuse(format!(
                "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
            )));
        };
        pairs.push(json!([a, b]));
    }
    // Added tokens: control tokens spelled in the byte alphabet (special), user-defined tokens
    // present in the vocabulary (not special), and the named bos/eos/unk/pad tokens (special).
    let mut added: std::collections::BTreeMap<usize, (String, bool)> = Default::default();
    for (id, (t, ty)) in tokens.iter().zip(types.iter()).enumerate() {
        if *ty == CONTROL && in_alphabet(t) {
            added.insert(id, ((*t).to_string(), true));
        }
    }
    for (id, (t, ty)) in tokens.iter().zip(types.iter()).enumerate() {
        if *ty == USER_DEFINED && vocab.contains_key(*t) {
            added.entry(id).or_insert(((*t).to_string(), false));
        }
    }
    let named = |key: &str| -> Result<Option<(usize, &str)>, GgufError> {
        match meta.opt_usize(key)? {
            None => Ok(None),
            Some(id) => match tokens.get(id) {
                Some(t) => Ok(Some((id, *t))),
                None => Err(refuse(format!(
                    "{key} = {id} is outside the {} tokens",
                    tokens.len()
                ))),
            },
        }
    };
    let bos = named("tokenizer.ggml.bos_token_id")?;
    let eos = named("tokenizer.ggml.eos_token_id")?;
    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
    ] {
        if let Some((_, t)) = named(key)? {
            // transformers adds the named token by its text: the id the vocabulary gives it.
            if let Some(id) = vocab.get(t).and_then(|v| v.as_u64()) {
                let id = id as usize;
                added.entry(id).or_insert((t.to_string(), true)).1 = true;
            }
        }
    }
    let added_tokens: Vec<Value> = added
        .iter()
        .map(|(id, (content, special))| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": use_regex})
    };
    let pre = meta.opt_str("tokenizer.ggml.pre")?.unwrap_or("");
    let pre_tokenizer = match split_regex(pre) {
        Some(re) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]}),
        None => byte_level(true),
    };
    // BOS/EOS added on encode as transformers' `update_post_processor` does, when the file asks.
    let add_bos = meta
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false)
        && bos.is_some();
    let add_eos = meta
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false)
        && eos.is_some();
    let post_processor = if add_bos || add_eos {
        let tok = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
        let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut specials = serde_json::Map::new();
        for (type_id, s, out) in [(0, "A", &mut single), (1, "B", &mut pair)] {
            if let (true, Some((_, b))) = (add_bos, bos) {
                out.push(tok(b, type_id));
            }
            out.push(seq(s, type_id));
            if let (true, Some((_, e))) = (add_eos, eos) {
                out.push(tok(e, type_id));
            }
        }
        let pair: Vec<Value> = single.iter().cloned().chain(pair).collect();
        for (on, t) in [(add_bos, bos), (add_eos, eos)] {
            if let (true, Some((id, t))) = (on, t) {
                specials.insert(t.into(), json!({"id": t, "ids": [id], "tokens": [t]}));
            }
        }
        json!({"type": "TemplateProcessing", "single": single, "pair": pair,
               "special_tokens": specials})
    } else {
        Value::Null
    };
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                  "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": pairs},
    });
    Ok(GgufTokenizer {
        json: json.to_string(),
        chat_template: meta.opt_str("tokenizer.chat_template")?.map(str::to_string),
        tokens: tokens.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'A' as usize], 'A');
        let distinct: HashSet<char> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
