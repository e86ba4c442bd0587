//! Parity with transformers, checked without torch: `fixtures/hf/fixtures.json` holds
//! transformers' top-k log-probs for models `make_fixtures.py` made with `trainer init-model`
//! (one per architecture and RoPE scaling kind, sequences longer than their sliding windows and
//! original context lengths). Here each model is made again from the same arguments and seed,
//! and our decoder must give the same numbers.

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

#[test]
fn every_architecture_scores_as_transformers() {
    let fx: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/hf/fixtures.json")).unwrap();
    let k = fx["top_k"].as_u64().unwrap() as usize;
    let common = strings(&fx["common_args"]);
    let tmp = tempfile::tempdir().unwrap();
    let cases = fx["cases"].as_object().unwrap();
    assert!(cases.len() >= 7, "one case per architecture at least");
    for (name, case) in cases {
        let dir = tmp.path().join(name);
        let tok = xdistill_shared::paths::tokenizer_json(case["tokenizer"].as_str().unwrap());
        let mut argv = vec!["init-model".to_string()];
        argv.extend(common.iter().cloned());
        argv.extend(strings(&case["args"]));
        argv.extend(["--tokenizer".into(), tok.display().to_string()]);
        argv.extend(["--out".into(), dir.display().to_string()]);
        init_model::run(Cli::try_parse_from(&argv).unwrap().args).unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        for ops in [Ops::Fused, Ops::Differentiable] {
            let lp = log_probs(&dir, &ids, ops);
            let mut worst = 0f64;
            for (t, row) in lp.iter().enumerate() {
                let want_ids = case["top_ids"][t].as_array().unwrap();
                let want_lp = case["top_logprobs"][t].as_array().unwrap();
                let mut sorted = row.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
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
            eprintln!("{name} ({ops:?}): max |Δ log-prob| vs transformers = {worst:.2e}");
            assert!(worst < TOL, "{name} ({ops:?}): {worst:e} ≥ {TOL:e}");
        }
    }
}
