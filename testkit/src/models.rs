//! Tiny random models: model directories a `teacher` serves or a run trains (made with
//! `xdistill_shared::init`), and in-memory decoders for the trainer's own tests.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use xdistill_shared::hf::ModelConfig;
use xdistill_shared::init::{
    build_config, init_model_dir, random_params, random_params_of, InitSpec,
};
use xdistill_shared::model::{Decoder, Ops};

use crate::tokenizer_json;

/// A tiny random teacher model (hidden 32, 2 layers) with a real tokenizer, made once under
/// `tmp` (or `$XDISTILL_TEST_TMPDIR`, for a test executable run away from its build tree, as in
/// the GPU check) as `teacher-models/NAME`. `pad_to` pads the LM head beyond the tokenizer's
/// vocabulary (rows the server must mask).
pub fn tiny_teacher_model(
    tmp: &Path,
    name: &str,
    arch: &str,
    tokenizer: &str,
    pad_to: usize,
) -> PathBuf {
    let tmp = std::env::var_os("XDISTILL_TEST_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.to_path_buf());
    made_once(&tmp.join("teacher-models").join(name), |out| {
        init_model_dir(&InitSpec {
            arch: arch.into(),
            tokenizer: tokenizer_json(tokenizer),
            hidden_size: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate_size: 64,
            head_dim: None,
            pad_vocab_to: pad_to,
            max_position_embeddings: 256,
            tie_embeddings: false,
            // Large enough that logits are spread (few near-ties among the top k).
            init_std: 0.1,
            seed: 7,
            out: out.to_path_buf(),
            features: Default::default(),
        })
        .expect("init-model");
    })
}

/// The model directory `out`, made by `make` unless it is already there. `make` writes into a
/// fresh sibling folder that is then renamed to `out` in one step, so tests that race to make
/// the same model — threads of one test binary, or test processes running side by side (the
/// suite runs every test in its own process, several at once) — never read a half-written
/// one: the first rename wins and the others' copies are removed.
pub fn made_once(out: &Path, make: impl FnOnce(&Path)) -> PathBuf {
    static MADE: AtomicUsize = AtomicUsize::new(0);
    if out.join("config.json").is_file() {
        return out.to_path_buf();
    }
    let parent = out.parent().expect("a model directory has a parent");
    std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
    let name = out.file_name().expect("a model directory has a name");
    let partial = parent.join(format!(
        ".{}.partial-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        MADE.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&partial);
    make(&partial);
    if let Err(e) = std::fs::rename(&partial, out) {
        let _ = std::fs::remove_dir_all(&partial);
        assert!(
            out.join("config.json").is_file(),
            "{} -> {}: {e}",
            partial.display(),
            out.display()
        );
    }
    out.to_path_buf()
}

/// The shape of the trainer tests' tiny decoders: 2 layers, hidden 32, the vocabulary padded to
/// a multiple of 64, for `tokenizer` (a `tokenizer.json`); `out` is left empty.
pub fn tiny_spec(arch: &str, tokenizer: &Path, tie: bool) -> InitSpec {
    InitSpec {
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

/// A [`tiny_spec`] decoder in memory, with `max_position_embeddings` = `max_pos`. Parameters
/// are made once per (arch, tokenizer, tie) and test binary.
pub fn tiny_decoder(arch: &str, tokenizer: &Path, max_pos: usize, tie: bool) -> Decoder {
    type Made = (ModelConfig, HashMap<String, Tensor>);
    static MADE: Mutex<Vec<(String, PathBuf, bool, Made)>> = Mutex::new(Vec::new());
    let (mut cfg, params) = {
        let mut made = MADE.lock().unwrap();
        let hit = |m: &(String, PathBuf, bool, Made)| m.0 == arch && m.1 == tokenizer && m.2 == tie;
        if !made.iter().any(hit) {
            let spec = tiny_spec(arch, tokenizer, tie);
            let cfg = build_config(&spec).unwrap();
            let params = random_params(&cfg, spec.init_std, spec.seed).unwrap();
            made.push((arch.into(), tokenizer.to_path_buf(), tie, (cfg, params)));
        }
        made.iter().find(|m| hit(m)).unwrap().3.clone()
    };
    cfg.max_position_embeddings = max_pos;
    let vb = VarBuilder::from_tensors(params, DType::F32, &Device::Cpu);
    Decoder::new(&cfg, vb, Ops::Fused).unwrap()
}

/// A random model `dir/NAME` for a distillation run (student or teacher): `hidden` wide,
/// `layers` deep, weights of standard deviation `std`, the vocabulary of `tokenizer`.
#[allow(clippy::too_many_arguments)]
pub fn model(
    dir: &Path,
    name: &str,
    arch: &str,
    tokenizer: &str,
    hidden: usize,
    layers: usize,
    std: f64,
    seed: u64,
) -> PathBuf {
    let out = dir.join(name);
    init_model_dir(&InitSpec {
        arch: arch.into(),
        tokenizer: tokenizer_json(tokenizer),
        hidden_size: hidden,
        layers,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 2 * hidden,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: false,
        init_std: std,
        seed,
        out: out.clone(),
        features: Default::default(),
    })
    .expect("init-model");
    out
}

/// A teacher whose predictions mostly depend on the current token: large random embedding and
/// LM head (peaked, token-specific distributions), small attention and MLP weights. A student can
/// learn that from a few hundred records and generalise to held-out text.
pub fn token_driven_teacher(dir: &Path, arch: &str, tokenizer: &str, seed: u64) -> PathBuf {
    let (args, cfg) = teacher_args(dir, arch, tokenizer, seed);
    let out = args.out.clone();
    let mut params = random_params_of(&cfg, 0.02, seed, |n| !is_head(n)).unwrap();
    params.extend(random_params_of(&cfg, 0.5, seed + 100, is_head).unwrap());
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params, &args.tokenizer).unwrap();
    out
}

/// The embedding and the LM head: the tensors both test teachers draw apart from the rest
/// (with a vocabulary of 32k-262k ids, nearly all of a tiny model's values).
fn is_head(name: &str) -> bool {
    matches!(name, "model.embed_tokens.weight" | "lm_head.weight")
}

/// A teacher whose next-token distribution barely depends on the context: every embedding is
/// one shared random vector plus small noise, so the hidden state is nearly constant, and a large
/// LM head makes the distribution peaked. On-policy learning then has a target the student can
/// reach from its own (initially random) samples.
pub fn context_free_teacher(dir: &Path, arch: &str, tokenizer: &str, seed: u64) -> PathBuf {
    let (args, cfg) = teacher_args(dir, arch, tokenizer, seed);
    let out = args.out.clone();
    let mut params = random_params_of(&cfg, 0.02, seed, |n| !is_head(n)).unwrap();
    let noise =
        random_params_of(&cfg, 0.05, seed + 300, |n| n == "model.embed_tokens.weight").unwrap();
    let c = Tensor::from_vec(
        (0..cfg.hidden_size)
            .map(|i| ((i as f32) * 1.7 + seed as f32).sin())
            .collect::<Vec<f32>>(),
        cfg.hidden_size,
        &Device::Cpu,
    )
    .unwrap();
    let embed = noise["model.embed_tokens.weight"]
        .broadcast_add(&c)
        .unwrap();
    params.insert("model.embed_tokens.weight".into(), embed);
    let big = random_params_of(&cfg, 0.5, seed + 100, |n| n == "lm_head.weight").unwrap();
    params.extend(big);
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params, &args.tokenizer).unwrap();
    out
}

/// The shape both test teachers share: hidden 64, one layer, written to `dir/teacher`.
fn teacher_args(dir: &Path, arch: &str, tokenizer: &str, seed: u64) -> (InitSpec, ModelConfig) {
    let args = InitSpec {
        arch: arch.into(),
        tokenizer: tokenizer_json(tokenizer),
        hidden_size: 64,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 128,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: false,
        init_std: 0.02,
        seed,
        out: dir.join("teacher"),
        features: Default::default(),
    };
    let cfg = build_config(&args).unwrap();
    (args, cfg)
}

/// Every tensor of `dir/model.safetensors` flattened to f32, sorted by name: two models'
/// weights compared whole (a resumed run against an uninterrupted one).
pub fn model_weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let t =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut v: Vec<_> = t
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}
