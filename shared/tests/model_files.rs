//! Model directories are untrusted input: a tiny model's safetensors file with byte patches in
//! its header (the length prefix, the JSON's digits, any byte) or cut short, opened and loaded
//! as the teacher and the trainer do (`ModelDir::open`, then the decoder from the mapped
//! weights): an error or a model, never a panic. The GGUF reader's counterpart (with the
//! allocations bounded too) is in `gguf.rs`.

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};
use xdistill_shared::hf::{write_model_dir, ModelConfig, ModelDir};
use xdistill_shared::model::{Decoder, Ops};

fn tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("model-file-tests")
}

/// A tiny Llama directory's `model.safetensors` bytes (written once per process).
fn good_weights() -> &'static [u8] {
    static GOOD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    GOOD.get_or_init(|| {
        let root = tmp().join(format!("good-{}", std::process::id()));
        let dir = write_dir(&root);
        std::fs::read(dir.join("model.safetensors")).unwrap()
    })
}

/// Writes the tiny model (random weights, a placeholder tokenizer) into `root/m`.
fn write_dir(root: &Path) -> PathBuf {
    let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    }))
    .unwrap();
    let params = xdistill_shared::init::random_params(&cfg, 0.02, 1).unwrap();
    std::fs::create_dir_all(root).unwrap();
    let tok = root.join("tokenizer.json");
    std::fs::write(&tok, "{}").unwrap();
    let dir = root.join("m");
    write_model_dir(&dir, &cfg, &params, &tok).unwrap();
    dir
}

/// The header's length (the first 8 bytes, little-endian).
fn header_len(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// Opens a directory whose weights are `bytes` and, where that succeeds, builds the decoder
/// from the mapped file. Returns whether it panicked and whether it gave a model.
fn open_and_load(bytes: &[u8]) -> (bool, bool) {
    let root = tmp().join(format!(
        "case-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let dir = if root.join("m").is_dir() {
        root.join("m")
    } else {
        write_dir(&root)
    };
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let r = std::panic::catch_unwind(|| {
        let md = ModelDir::open(&dir).ok()?;
        // SAFETY: written above, not modified while mapped.
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu) }
                .ok()?;
        Decoder::new(&md.config, vb, Ops::Fused).ok().map(|_| ())
    });
    (r.is_err(), matches!(r, Ok(Some(()))))
}

/// One change to the file.
#[derive(Debug, Clone)]
enum Patch {
    /// A byte of the header set.
    Byte(usize, u8),
    /// A digit of the header's JSON (offsets, shapes) set to another digit.
    Digit(usize, u8),
    /// The length prefix set.
    Length(u64),
    /// The file cut to this many bytes.
    Cut(usize),
}

/// Applies `p` to `bytes` (the good file's header bytes, where a cut left them).
fn apply(bytes: &mut Vec<u8>, p: &Patch) {
    let header = 8..(8 + header_len(good_weights())).min(bytes.len()).max(8);
    match *p {
        Patch::Byte(at, v) => {
            if !header.is_empty() {
                bytes[header.start + at % header.len()] = v;
            }
        }
        Patch::Digit(nth, d) => {
            let digits: Vec<usize> = header
                .clone()
                .filter(|&i| bytes[i].is_ascii_digit())
                .collect();
            if !digits.is_empty() {
                bytes[digits[nth % digits.len()]] = b'0' + d % 10;
            }
        }
        Patch::Length(v) => {
            if bytes.len() >= 8 {
                bytes[..8].copy_from_slice(&v.to_le_bytes());
            }
        }
        Patch::Cut(n) => bytes.truncate(n % (bytes.len() + 1)),
    }
}

#[test]
fn the_unpatched_file_loads() {
    let (panicked, loaded) = open_and_load(good_weights());
    assert!(!panicked && loaded);
}

/// The length prefix at its extremes and around the true length, and every cut of the header:
/// each an error (or, where the file still holds a valid model, a model), never a panic.
#[test]
fn length_prefixes_and_cut_headers_are_errors() {
    let good = good_weights();
    let h = header_len(good) as u64;
    for v in [
        0,
        1,
        2,
        h - 1,
        h + 1,
        1 << 31,
        1 << 40,
        u64::MAX >> 1,
        u64::MAX,
    ] {
        let mut b = good.to_vec();
        apply(&mut b, &Patch::Length(v));
        let (panicked, loaded) = open_and_load(&b);
        assert!(!panicked, "length prefix {v} panicked");
        assert!(!loaded, "length prefix {v} (true {h}) gave a model");
    }
    for n in (0..8 + h as usize).step_by(37).chain([good.len() - 1]) {
        let (panicked, loaded) = open_and_load(&good[..n]);
        assert!(!panicked, "cut at {n} panicked");
        assert!(!loaded, "cut at {n} gave a model");
    }
}

fn patch() -> impl proptest::strategy::Strategy<Value = Patch> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(a, v)| Patch::Byte(a, v)),
        4 => (any::<usize>(), any::<u8>()).prop_map(|(a, d)| Patch::Digit(a, d)),
        1 => prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>()].prop_map(Patch::Length),
        1 => any::<usize>().prop_map(Patch::Cut),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 200,
        failure_persistence: None,
        ..Default::default()
    })]

    /// Patches of a real file's header: opening and loading it is an error or a model, never
    /// a panic.
    #[test]
    fn patched_headers_never_panic(patches in proptest::collection::vec(patch(), 1..4)) {
        let mut bytes = good_weights().to_vec();
        for p in &patches {
            apply(&mut bytes, p);
        }
        let (panicked, _) = open_and_load(&bytes);
        proptest::prop_assert!(!panicked, "open or load panicked on {patches:?}");
    }
}
