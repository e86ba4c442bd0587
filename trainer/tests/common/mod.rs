//! Test fixtures: a byte-level tokenizer with a 257-token vocabulary (fast tiny models) and
//! tiny random decoders made with `init_model`, shared across the tests of one binary.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use tokenizers::Tokenizer;
use xdistill_shared::hf::ModelConfig;
use xdistill_shared::model::{Decoder, Ops};
use xdistill_trainer::init_model::{build_config, random_params, Args};

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

pub fn load(path: &Path) -> &'static Tokenizer {
    static TOKS: Mutex<Vec<(PathBuf, &'static Tokenizer)>> = Mutex::new(Vec::new());
    let mut toks = TOKS.lock().unwrap();
    if let Some((_, t)) = toks.iter().find(|(p, _)| p == path) {
        return t;
    }
    let t: &'static Tokenizer = Box::leak(Box::new(Tokenizer::from_file(path).unwrap()));
    toks.push((path.to_path_buf(), t));
    t
}

pub fn model_args(arch: &str, tokenizer: &Path, tie: bool) -> Args {
    Args {
        arch: arch.into(),
        tokenizer: tokenizer.to_path_buf(),
        hidden_size: 32,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 64,
        head_dim: None,
        pad_vocab_to: 64,
        max_position_embeddings: 256,
        tie_embeddings: tie,
        // 0.5 spreads the logits (std ≈ 3), so greedy never hinges on a near-tie that float
        // rounding could flip.
        init_std: 0.5,
        seed: 3,
        out: PathBuf::new(),
        features: Default::default(),
    }
}

/// A 2-layer random decoder for `tokenizer` (vocabulary padded past the tokenizer's), with
/// `max_position_embeddings` = `max_pos`. Parameters are made once per (arch, tokenizer, tie).
pub fn tiny(arch: &str, tokenizer: &Path, max_pos: usize, tie: bool) -> Decoder {
    type Made = (ModelConfig, HashMap<String, Tensor>);
    static MADE: Mutex<Vec<(String, PathBuf, bool, Made)>> = Mutex::new(Vec::new());
    let (mut cfg, params) = {
        let mut made = MADE.lock().unwrap();
        let hit = |m: &(String, PathBuf, bool, Made)| m.0 == arch && m.1 == tokenizer && m.2 == tie;
        if !made.iter().any(hit) {
            let args = model_args(arch, tokenizer, tie);
            let cfg = build_config(&args).unwrap();
            let params = random_params(&cfg, args.init_std, args.seed).unwrap();
            made.push((arch.into(), tokenizer.to_path_buf(), tie, (cfg, params)));
        }
        made.iter().find(|m| hit(m)).unwrap().3.clone()
    };
    cfg.max_position_embeddings = max_pos;
    let vb = VarBuilder::from_tensors(params, DType::F32, &Device::Cpu);
    Decoder::new(&cfg, vb, Ops::Fused).unwrap()
}
