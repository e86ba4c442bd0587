//! What the fuzz targets share: a scratch folder per process (the loaders read paths, not
//! bytes), the byte-level tokenizer the model seeds are made with, and how a model directory
//! travels as one input.

use std::path::{Path, PathBuf};

/// This process's scratch folder (in memory where `/dev/shm` exists), made once.
pub fn scratch() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("xdistill-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        dir
    })
}

/// A byte-level BPE `tokenizer.json`: the 256 bytes in GPT-2's alphabet, three merges and an
/// end-of-text token (260 ids): small enough to parse in a fraction of a millisecond.
pub fn byte_tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("a valid char")
        };
        vocab.insert(c.to_string(), usize::from(b).into());
    }
    for (i, t) in ["Ġt", "he", "Ġthe"].iter().enumerate() {
        vocab.insert(t.to_string(), (256 + i).into());
    }
    let bl = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": true});
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 259, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": bl, "post_processor": null, "decoder": bl,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "vocab": vocab, "merges": ["Ġ t", "h e", "Ġt he"]}
    })
    .to_string()
}

/// A model directory as one fuzz input: `config.json`'s length (u32, little-endian), its
/// bytes, then `model.safetensors`'s bytes. The tokenizer is [`byte_tokenizer_json`], fixed.
pub fn pack_model_dir(config: &[u8], safetensors: &[u8]) -> Vec<u8> {
    let mut out = (config.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(config);
    out.extend_from_slice(safetensors);
    out
}

/// Writes the model directory `data` holds ([`pack_model_dir`]) into this process's scratch
/// folder, over the last one; `None` where `data` is too short to say.
pub fn unpack_model_dir(data: &[u8]) -> Option<PathBuf> {
    let n = u32::from_le_bytes(data.get(..4)?.try_into().ok()?) as usize;
    let config = data.get(4..4usize.checked_add(n)?)?;
    let weights = &data[4 + n..];
    let dir = scratch().join("model");
    std::fs::create_dir_all(&dir).ok()?;
    std::fs::write(dir.join("config.json"), config).ok()?;
    std::fs::write(dir.join("model.safetensors"), weights).ok()?;
    let tok = dir.join("tokenizer.json");
    if !tok.exists() {
        std::fs::write(&tok, byte_tokenizer_json()).ok()?;
    }
    Some(dir)
}

/// Token ids for a forward pass: a few below 260 (the seeds' vocabulary) and one at its end.
pub const IDS: [u32; 6] = [3, 17, 256, 42, 258, 259];

/// What a teacher's start does with `path` (a model directory or a GGUF file): the
/// `--check-args` checks, and where they pass, the load (each way a GGUF file's weights can be
/// held) and a forward pass over [`IDS`] below the vocabulary. Errors are fine; a panic, an
/// abort or a logits tensor of another shape is not.
pub fn teacher_start(path: &Path) {
    use xdistill_server::model::{check_model, load_with};
    use xdistill_shared::gguf::{is_gguf, WeightMode};
    if check_model(path).is_err() {
        return;
    }
    let modes: &[WeightMode] = if is_gguf(path) {
        &[WeightMode::Dequantize, WeightMode::Quantized]
    } else {
        &[WeightMode::Dequantize]
    };
    for &mode in modes {
        let Ok((decoder, facts)) = load_with(path, "cpu", "f32", mode) else {
            continue;
        };
        let ids: Vec<u32> = IDS
            .iter()
            .copied()
            .filter(|&i| (i as usize) < facts.vocab_size)
            .collect();
        if ids.is_empty() {
            continue;
        }
        let x = candle_core::Tensor::new(ids.as_slice(), &candle_core::Device::Cpu)
            .and_then(|t| t.unsqueeze(0))
            .expect("a [1, n] tensor");
        if let Ok(logits) = decoder.forward(&x) {
            assert_eq!(logits.dims(), &[1, ids.len(), facts.logits_size]);
        }
    }
}

/// For a target's `init`: the default panic hook in place of libfuzzer-sys's, which aborts at
/// every panic, before any `catch_unwind` can see it. The project catches the `tokenizers`
/// crate's panics on malformed files (`tokenizer_json::parse`); a panic nothing catches still
/// ends the run, as libfuzzer-sys aborts on any that leaves the target.
pub fn allow_caught_panics() {
    let _ = std::panic::take_hook();
}
