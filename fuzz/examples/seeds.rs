//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/` (the folder
//! `cargo fuzz run` reads and grows): real encodings of answers and requests, tiny random
//! models of each architecture as directories and as GGUF files, small tokenizer.json files.
//!
//!     cargo run --release --example seeds      # from fuzz/

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use std::path::{Path, PathBuf};
use xdistill_fuzz::{byte_tokenizer_json, pack_model_dir};
use xdistill_shared::codec::{self, Format, HeadMeta};
use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
use xdistill_shared::init::{build_config, random_params, InitFeatures, InitSpec};
use xdistill_shared::protocol::{
    HiddenRequest, HiddenResponse, HiddenStates, SequenceScores, TopkRequest, TopkResponse,
    ValuesKind, WireDtype,
};

fn corpus(target: &str) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn seed(target: &str, name: &str, bytes: &[u8]) -> Result<()> {
    let path = corpus(target)?.join(name);
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    println!("{:>9} bytes  {}", bytes.len(), path.display());
    Ok(())
}

fn with_selector(sel: u8, body: Vec<u8>) -> Vec<u8> {
    let mut out = vec![sel];
    out.extend(body);
    out
}

fn answers() -> Result<()> {
    let seq = |rows: usize, k: usize, m: usize| SequenceScores {
        rows,
        k,
        topk_ids: (0..rows * k).map(|i| i as u32 % 7).collect(),
        topk_values: (0..rows * k).map(|i| -(i as f32) * 0.5).collect(),
        target_logprobs: (0..rows).map(|i| -(i as f32)).collect(),
        logsumexp: (0..rows).map(|i| i as f32 + 0.25).collect(),
        m,
        ids_logprobs: (0..rows * m).map(|i| -(i as f32) - 1.0).collect(),
        ..Default::default()
    };
    let plain = TopkResponse {
        k: 3,
        values: ValuesKind::Logprobs,
        temperature: 0.7,
        model: "fp".into(),
        with_ids: false,
        results: vec![seq(2, 3, 0), seq(0, 3, 0)],
    };
    let ids = TopkResponse {
        k: 0,
        values: ValuesKind::Logits,
        temperature: 1.0,
        model: "fp".into(),
        with_ids: true,
        results: vec![seq(2, 0, 2), seq(1, 0, 2)],
    };
    for (name, r) in [("plain", &plain), ("ids", &ids)] {
        seed(
            "answers",
            &format!("json-{name}"),
            &with_selector(0, codec::encode_response(Format::Json, r)?),
        )?;
        seed(
            "answers",
            &format!("msgpack-{name}"),
            &with_selector(1, codec::encode_response(Format::Msgpack, r)?),
        )?;
    }
    let hidden = HiddenResponse {
        model: "fp".into(),
        head_fingerprint: "head".into(),
        dtype: WireDtype::Bf16,
        hidden_size: 4,
        results: vec![HiddenStates {
            rows: 2,
            data: vec![0x3f; 16],
        }],
    };
    seed(
        "answers",
        "hidden",
        &with_selector(2, codec::encode_hidden_response(&hidden)?),
    )?;
    for bias in [false, true] {
        let meta = HeadMeta {
            model_fingerprint: "fp".into(),
            architecture: "Qwen3ForCausalLM".into(),
            vocab_size: 3,
            head_rows: 4,
            hidden_size: 2,
            dtype: WireDtype::F32,
            tied: true,
            bias,
            logit_scale: 1.0,
            logit_softcap: Some(30.0),
        };
        let mut file = meta.header();
        file.extend((0..8 + 4 * bias as usize).flat_map(|i| (i as f32 * 0.5).to_le_bytes()));
        seed(
            "answers",
            &format!("head-bias-{bias}"),
            &with_selector(3, file),
        )?;
    }
    Ok(())
}

fn requests() -> Result<()> {
    let plain = TopkRequest {
        sequences: vec![vec![1, 2, 3, 4], vec![5, 6]],
        k: 4,
        temperature: 1.0,
        start: 1,
        starts: None,
        values: ValuesKind::Logprobs,
        ids: None,
    };
    let ids = TopkRequest {
        sequences: vec![vec![1, 2, 3], vec![7, 8, 9, 10]],
        k: 0,
        temperature: 0.5,
        start: 0,
        starts: Some(vec![1, 2]),
        values: ValuesKind::Logits,
        ids: Some(vec![vec![vec![3, 4]], vec![vec![5, 299], vec![1, 2]]]),
    };
    for (name, r) in [("plain", &plain), ("ids", &ids)] {
        seed(
            "requests",
            &format!("json-{name}"),
            &with_selector(0, codec::encode_request(Format::Json, r)?),
        )?;
        seed(
            "requests",
            &format!("msgpack-{name}"),
            &with_selector(4, codec::encode_request(Format::Msgpack, r)?),
        )?;
    }
    let hidden = HiddenRequest {
        sequences: vec![vec![1, 2, 3]],
        start: 0,
        starts: None,
    };
    seed(
        "requests",
        "hidden-json",
        &with_selector(8, codec::encode_hidden_request(Format::Json, &hidden)?),
    )?;
    Ok(())
}

/// A tiny model of `arch`: hidden `hidden`, one layer, the byte tokenizer's 260 ids.
fn spec(arch: &str, hidden: usize, tie: bool, tok: &Path, out: PathBuf) -> InitSpec {
    InitSpec {
        arch: arch.into(),
        tokenizer: tok.to_path_buf(),
        hidden_size: hidden,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        intermediate_size: 2 * hidden,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 64,
        tie_embeddings: tie,
        init_std: 0.5,
        seed: 1,
        out,
        features: InitFeatures {
            experts: (arch == "qwen3-moe").then_some(2),
            experts_per_tok: (arch == "qwen3-moe").then_some(1),
            ..Default::default()
        },
    }
}

fn models() -> Result<()> {
    let work = std::env::temp_dir().join(format!("xdistill-fuzz-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let tok = work.join("tokenizer.json");
    std::fs::write(&tok, byte_tokenizer_json())?;
    for arch in [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3",
        "phi3",
        "qwen3-moe",
    ] {
        for tie in [false, true] {
            let out = work.join(format!("{arch}-{tie}"));
            let s = spec(arch, 16, tie, &tok, out.clone());
            xdistill_shared::init::init_model_dir(&s).with_context(|| format!("init {arch}"))?;
            let bytes = pack_model_dir(
                &std::fs::read(out.join("config.json"))?,
                &std::fs::read(out.join("model.safetensors"))?,
            );
            seed("model_dir", &format!("{arch}-tied-{tie}"), &bytes)?;
        }
    }
    // GGUF: the architectures llama.cpp's files carry, hidden 32 (a Q8_0/Q4_0 block's row).
    let tok_json: serde_json::Value = serde_json::from_str(&byte_tokenizer_json())?;
    for (arch, ty) in [
        ("llama", GgmlDType::Q8_0),
        ("llama", GgmlDType::F16),
        ("qwen2", GgmlDType::Q4_0),
        ("qwen3", GgmlDType::F32),
    ] {
        let s = spec(arch, 32, arch != "llama", &tok, PathBuf::new());
        let cfg = build_config(&s)?;
        let params = random_params(&cfg, 0.5, 1)?;
        let mut meta = config_metadata(arch, &cfg);
        meta.extend(bpe_tokenizer_metadata(&tok_json, "qwen2")?);
        meta.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(259)));
        meta.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(259)));
        meta.push(("general.alignment".into(), Value::U32(32)));
        let path = work.join(format!("{arch}-{ty:?}.gguf"));
        write_gguf(&path, arch, &cfg, &params, ty, &meta)?;
        seed("gguf", &format!("{arch}-{ty:?}"), &std::fs::read(&path)?)?;
    }
    std::fs::remove_dir_all(&work)?;
    Ok(())
}

fn tokenizers() -> Result<()> {
    seed(
        "tokenizer_json",
        "byte-bpe",
        byte_tokenizer_json().as_bytes(),
    )?;
    let wordpiece = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
            "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {"[UNK]": 0, "the": 1, "quick": 2, "##s": 3, "fox": 4, "do": 5, "##g": 6}}
    });
    seed(
        "tokenizer_json",
        "wordpiece",
        wordpiece.to_string().as_bytes(),
    )?;
    let unigram = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁",
            "prepend_scheme": "always", "split": true},
        "post_processor": null, "decoder": {"type": "Metaspace", "replacement": "▁",
            "prepend_scheme": "always", "split": true},
        "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": false,
            "vocab": [["<unk>", 0.0], ["▁the", -1.0], ["▁", -2.0], ["t", -3.0], ["h", -3.0],
                      ["e", -3.0], ["q", -4.0], ["u", -4.0]]}
    });
    seed("tokenizer_json", "unigram", unigram.to_string().as_bytes())?;
    Ok(())
}

fn main() -> Result<()> {
    answers()?;
    requests()?;
    models()?;
    tokenizers()?;
    Ok(())
}
