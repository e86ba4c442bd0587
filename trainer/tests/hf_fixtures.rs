//! Parity with transformers, checked without torch: `fixtures/hf/fixtures.json` holds
//! transformers' top-k log-probs for models `make_fixtures.py` made with `trainer init-model`
//! (one per architecture and RoPE scaling kind, sequences longer than their sliding windows and
//! original context lengths). Here each model is made again from the same arguments and seed,
//! and our decoder must give the same numbers, under init-model's `config.json` and under the
//! one transformers wrote when it saved the model again (`hf_config`: the key names of the
//! transformers version that made the fixtures, e.g. 5.24's `num_local_experts`).

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use clap::Parser;
use xdistill_shared::hf::ModelDir;
use xdistill_shared::model::{Decoder, Ops};
use xdistill_trainer::init_model;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: init_model::Args,
}

/// f32 forward vs transformers' f32 forward, compared in log-prob space.
const TOL: f64 = 1e-4;

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Log-probs `[T, V]` of `ids` under the model in `dir`, in f64.
fn log_probs(dir: &std::path::Path, ids: &[u32], ops: Ops) -> Vec<Vec<f64>> {
    let md = ModelDir::open(dir).unwrap();
    // SAFETY: the files were just written by this test and are not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu) }
        .unwrap();
    let dec = Decoder::new(&md.config, vb, ops).unwrap();
    let x = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = dec
        .forward(&x)
        .unwrap()
        .get(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    candle_nn::ops::log_softmax(&logits, D::Minus1)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap()
}

fn fixtures() -> serde_json::Value {
    serde_json::from_str(include_str!("fixtures/hf/fixtures.json")).unwrap()
}

/// Makes the model of fixture case `case` again in `dir`, with init-model's config.json.
fn make_case(fx: &serde_json::Value, case: &serde_json::Value, dir: &std::path::Path) {
    let tok = xdistill_testkit::tokenizer_json(case["tokenizer"].as_str().unwrap());
    let mut argv = vec!["init-model".to_string()];
    argv.extend(strings(&fx["common_args"]));
    argv.extend(strings(&case["args"]));
    argv.extend(["--tokenizer".into(), tok.display().to_string()]);
    argv.extend(["--out".into(), dir.display().to_string()]);
    init_model::run(Cli::try_parse_from(&argv).unwrap().args).unwrap();
}

/// Replaces the config.json of `dir` by `cfg`.
fn write_config(dir: &std::path::Path, cfg: &serde_json::Value) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(cfg).unwrap(),
    )
    .unwrap();
}

/// The worst |Δ log-prob| between our decoder on `dir` and transformers' numbers of `case`.
fn worst_delta(case: &serde_json::Value, k: usize, dir: &std::path::Path, ops: Ops) -> f64 {
    let ids: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let lp = log_probs(dir, &ids, ops);
    let mut worst = 0f64;
    for (t, row) in lp.iter().enumerate() {
        let want_ids = case["top_ids"][t].as_array().unwrap();
        let want_lp = case["top_logprobs"][t].as_array().unwrap();
        // The k largest, descending (testkit's selection, built optimised: here, unoptimised
        // in test builds, a sort of each whole row made this the slowest trainer test).
        let sorted = xdistill_testkit::reference::largest_values(row, k);
        for j in 0..k {
            let (id, want) = (
                want_ids[j].as_u64().unwrap() as usize,
                want_lp[j].as_f64().unwrap(),
            );
            // The same value at transformers' j-th id, and as our j-th largest (ties
            // may order differently; values may not).
            worst = worst
                .max((row[id] - want).abs())
                .max((sorted[j] - want).abs());
        }
        if let Some(target) = case["target_logprobs"].get(t) {
            let want = target.as_f64().unwrap();
            worst = worst.max((row[ids[t + 1] as usize] - want).abs());
        }
    }
    worst
}

#[test]
fn every_architecture_scores_as_transformers() {
    let fx = fixtures();
    let k = fx["top_k"].as_u64().unwrap() as usize;
    let tmp = tempfile::tempdir().unwrap();
    let cases = fx["cases"].as_object().unwrap();
    assert!(cases.len() >= 7, "one case per architecture at least");
    for (name, case) in cases {
        let dir = tmp.path().join(name);
        make_case(&fx, case, &dir);
        let hf_config = case
            .get("hf_config")
            .unwrap_or_else(|| panic!("{name}: no hf_config (regenerate with make_fixtures.py)"));
        for which in ["init-model", "transformers"] {
            if which == "transformers" {
                write_config(&dir, hf_config);
            }
            for ops in [Ops::Fused, Ops::Differentiable] {
                let worst = worst_delta(case, k, &dir, ops);
                eprintln!(
                    "{name} ({which} config.json, {ops:?}): max |Δ log-prob| vs transformers = \
                     {worst:.2e}"
                );
                assert!(
                    worst < TOL,
                    "{name} ({which} config, {ops:?}): {worst:e} ≥ {TOL:e}"
                );
            }
        }
    }
}

/// (major, minor) of a version string such as "5.24.0".
fn version(v: &str) -> (u32, u32) {
    let mut it = v.split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or(0)
    });
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// The Qwen3-MoE case loads as the same MoE model (4 experts on layers 0 and 2, layer 1 dense)
/// under init-model's config.json (`num_experts`, which every transformers version reads) and
/// under the one transformers saved (`num_local_experts` from 5.24 on); both score as
/// transformers in `every_architecture_scores_as_transformers`.
#[test]
fn qwen3_moe_loads_with_either_expert_count_key() {
    let fx = fixtures();
    let case = &fx["cases"]["qwen3_moe"];
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().join("m");
    make_case(&fx, case, &dir);
    let hf_config = &case["hf_config"];
    let hf_key = if version(fx["transformers"].as_str().unwrap()) >= (5, 24) {
        assert_eq!(hf_config["num_local_experts"], 4, "{hf_config}");
        assert!(hf_config.get("num_experts").is_none(), "{hf_config}");
        "num_local_experts"
    } else {
        "num_experts"
    };
    for (key, cfg) in [("num_experts", None), (hf_key, Some(hf_config))] {
        if let Some(cfg) = cfg {
            write_config(&dir, cfg);
        }
        let md = ModelDir::open(&dir).unwrap();
        let c = &md.config;
        assert_eq!((c.moe.experts(), c.moe.experts_key()), (4, key));
        assert_eq!(
            (0..3).map(|l| c.is_moe_layer(l)).collect::<Vec<_>>(),
            [true, false, true],
            "{key}"
        );
    }
}

/// A Qwen3-MoE config.json that lost its expert count (here: transformers' own, less
/// `num_local_experts`) is refused by the trainer's loaders — the evaluator's and the student's
/// — with the message of the one check in `xdistill_shared::hf`, which the teacher gives too
/// (server/tests/lifecycle.rs): the config keys and the expert tensors named, before loading.
#[test]
fn trainer_refuses_a_moe_config_without_its_expert_count() {
    let fx = fixtures();
    let case = &fx["cases"]["qwen3_moe"];
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().join("m");
    make_case(&fx, case, &dir);
    let mut cfg = case["hf_config"].clone();
    let obj = cfg.as_object_mut().unwrap();
    obj.remove("num_local_experts");
    obj.remove("num_experts");
    write_config(&dir, &cfg);
    let shared = ModelDir::open(&dir).unwrap_err().to_string();
    for needle in [
        "config.json: the config sets no expert count (neither `num_experts` nor \
         `num_local_experts`)",
        "model.layers.0.mlp.experts.*, e.g. model.layers.0.mlp.experts.0.down_proj.weight",
        "(4 in the weights)",
    ] {
        assert!(shared.contains(needle), "{needle:?} in {shared}");
    }
    let eval = xdistill_trainer::eval::load_model(&dir, &Device::Cpu, DType::F32)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap();
    let student = xdistill_trainer::student::Student::load(&dir, &Device::Cpu, DType::F32)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap();
    for got in [eval, student] {
        assert!(got.ends_with(&shared), "{got}");
        assert!(!got.contains("cannot find tensor"), "{got}");
    }
}
