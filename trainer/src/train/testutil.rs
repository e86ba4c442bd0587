//! Test helpers for the training paths: a tiny trainable decoder, teacher answers, and the
//! comparison of two gradient stores over every parameter.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xdistill_shared::hf::ModelConfig;
use xdistill_shared::model::{param_specs, Decoder, Ops};
use xdistill_shared::protocol::SequenceScores;

/// Vocabulary of [`tiny`] students.
pub const V: usize = 40;

/// A two-layer decoder (`qwen3`, or `llama` with a tied head) whose parameters are `Var`s of
/// `dtype` in the returned map.
pub fn tiny(tied: bool, dtype: DType, seed: u64) -> (Decoder, VarMap) {
    let model_type = if tied { "llama" } else { "qwen3" };
    let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": model_type, "vocab_size": V, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": tied,
        "attention_bias": false
    }))
    .unwrap();
    cfg.validate().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        for s in param_specs(&cfg, 0.2) {
            let n: usize = s.shape.iter().product();
            let is_norm = s.shape.len() == 1;
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    let x = rng.random_range(-0.5..0.5);
                    if is_norm {
                        1.0 + 0.5 * x
                    } else {
                        0.8 * x
                    }
                })
                .collect();
            let t = Tensor::from_vec(v, s.shape, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            data.insert(s.name, Var::from_tensor(&t).unwrap());
        }
    }
    let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
    let model = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
    (model, vm)
}

/// A teacher's answer for `rows` positions: `k` distinct ids below `vocab` per row with
/// log-probs of a random distribution (mass in K below 1), and target log-probs.
pub fn answer(rng: &mut ChaCha8Rng, rows: usize, k: usize, vocab: usize) -> SequenceScores {
    let mut s = SequenceScores {
        rows,
        k,
        ..Default::default()
    };
    for _ in 0..rows {
        let mut ids: Vec<u32> = Vec::with_capacity(k);
        while ids.len() < k {
            let c = rng.random_range(0..vocab as u32);
            if !ids.contains(&c) {
                ids.push(c);
            }
        }
        let w: Vec<f64> = (0..k).map(|_| rng.random_range(0.1..1.0)).collect();
        let mass = rng.random_range(0.6..0.95);
        let sum: f64 = w.iter().sum();
        let mut lp: Vec<f32> = w.iter().map(|x| (x / sum * mass).ln() as f32).collect();
        lp.sort_by(|a, b| b.total_cmp(a));
        s.topk_ids.extend(ids);
        s.topk_values.extend(lp);
        s.target_logprobs.push(-rng.random_range(0.1..4.0f32));
        s.logsumexp.push(0.0);
    }
    s
}

/// Random ids below [`V`].
pub fn ids(rng: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..V as u32)).collect()
}

/// Largest `|a − b|` over the largest `|b|`.
fn worst_relative(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

pub use crate::loss::testutil::flat;

/// Asserts that `got` holds every parameter's gradient of `want` within `tol` (relative to the
/// gradient's largest entry), and that no parameter has a gradient in only one of them.
pub fn assert_same_grads(vm: &VarMap, got: &GradStore, want: &GradStore, tol: f64, case: &str) {
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for n in names {
        let v = data[n].as_tensor();
        match (got.get(v), want.get(v)) {
            (Some(g), Some(w)) => {
                let (g, w) = (flat(g), flat(w));
                let e = worst_relative(&g, &w);
                assert!(e <= tol, "{case}: {n} differs by {e:e} (relative)");
            }
            (None, None) => {}
            (g, w) => panic!(
                "{case}: {n}: gradient in the chunked path {} and in the reference {}",
                g.is_some(),
                w.is_some()
            ),
        }
    }
}

/// Asserts `|a − b| ≤ tol·max(|b|, 1e-12)`.
pub fn assert_rel(a: f64, b: f64, tol: f64, what: &str) {
    assert!(
        (a - b).abs() <= tol * b.abs().max(1e-12),
        "{what}: {a} vs {b} (tol {tol})"
    );
}
