//! The tokenizers and data tests use: the real tokenizers of the checkout (found where
//! `xdistill_shared::paths` looks; panicking with the fix when absent), the GSM8K sample, and a
//! byte-level tokenizer made on the fly (fast tiny models).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use tokenizers::Tokenizer;

pub use xdistill_shared::paths::repo_root;

/// Path of `NAME/tokenizer.json` (one of `xdistill_shared::paths::TOKENIZER_NAMES`), panicking
/// with the fix when the tokenizers are missing.
pub fn tokenizer_json(name: &str) -> PathBuf {
    let dir = xdistill_shared::paths::tokenizers_dir().unwrap_or_else(|| {
        panic!("tokenizers not found: run scripts/get-tokenizers.sh (or set XDISTILL_TOKENIZERS)")
    });
    dir.join(name).join("tokenizer.json")
}

/// The GSM8K sample of the checkout (`configs/data/gsm8k_sample.jsonl`).
pub fn data_file() -> PathBuf {
    repo_root().join("configs/data/gsm8k_sample.jsonl")
}

/// Id of `<eos>` in the byte tokenizer.
pub const BYTE_EOS: u32 = 256;

/// GPT-2's byte → printable char table (what the ByteLevel pre-tokenizer and decoder use).
fn byte_chars() -> Vec<char> {
    let mut keep: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut out = vec!['\0'; 256];
    for &b in &keep {
        out[b as usize] = char::from_u32(b).unwrap();
    }
    let mut n = 0;
    for b in 0..256u32 {
        if !keep.contains(&b) {
            out[b as usize] = char::from_u32(256 + n).unwrap();
            keep.push(b);
            n += 1;
        }
    }
    out
}

/// A byte-level BPE tokenizer without merges: one token per byte (id = byte) plus `<eos>`.
/// Decoding still goes through the ByteLevel decoder (partial UTF-8 and all).
pub fn byte_tokenizer_json() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
            .collect();
        let bl = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": false, "use_regex": false});
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": BYTE_EOS, "content": "<eos>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": bl, "post_processor": null, "decoder": bl,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "vocab": vocab, "merges": []}
        });
        let dir = std::env::temp_dir().join(format!("xdistill-bytetok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
        path
    })
    .clone()
}

/// `path` loaded once per test binary (tokenizers are slow to parse), kept for its lifetime.
pub fn load_tokenizer(path: &Path) -> &'static Tokenizer {
    static TOKS: Mutex<Vec<(PathBuf, &'static Tokenizer)>> = Mutex::new(Vec::new());
    let mut toks = TOKS.lock().unwrap();
    if let Some((_, t)) = toks.iter().find(|(p, _)| p == path) {
        return t;
    }
    let t = xdistill_shared::hf::load_tokenizer(path).unwrap_or_else(|e| panic!("{e}"));
    let t: &'static Tokenizer = Box::leak(Box::new(t));
    toks.push((path.to_path_buf(), t));
    t
}
