//! The trainable student: gradients are right (central finite differences in f64) and reach every
//! parameter; saving gives a directory the serving decoder loads with identical logits.

use candle_core::{DType, Device, Tensor, D};
use xdistill_shared::hf::{ModelConfig, ModelDir};
use xdistill_shared::model::{Decoder, Ops};
use xdistill_trainer::init_model::random_params;
use xdistill_trainer::student::Student;

fn config(model_type: &str, tie: bool) -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": model_type, "vocab_size": 40, "hidden_size": 16, "intermediate_size": 20,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 32, "rope_theta": 10000.0, "tie_word_embeddings": tie
    }))
    .unwrap()
}

fn student(cfg: &ModelConfig, dtype: DType, seed: u64) -> Student {
    let mut params = random_params(cfg, 0.3, seed).unwrap();
    // Non-trivial norms and biases so their gradients are exercised away from 1 and 0.
    for (name, t) in params.iter_mut() {
        if name.ends_with("norm.weight") || name.ends_with(".bias") {
            *t = (t.ones_like().unwrap()
                + random_params(cfg, 0.3, seed + 1).unwrap()[name].clone())
            .unwrap();
            if name.ends_with(".bias") {
                *t = (t.clone() - 1.0).unwrap();
            }
        }
    }
    Student::from_tensors(
        cfg.clone(),
        params,
        "unused".into(),
        &Device::Cpu,
        dtype,
        dtype,
    )
    .unwrap()
}

const IDS: [u32; 7] = [3, 17, 39, 8, 8, 1, 22];
const TARGETS: [u32; 7] = [17, 39, 8, 8, 1, 22, 5];

/// Mean next-token cross-entropy of the batch, written with differentiable ops.
fn loss(model: &Decoder) -> Tensor {
    let ids = Tensor::new(&IDS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward(&ids).unwrap().squeeze(0).unwrap(); // [T, V]
    let lp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let tgt = Tensor::new(&TARGETS, &Device::Cpu)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    lp.gather(&tgt, 1)
        .unwrap()
        .mean_all()
        .unwrap()
        .neg()
        .unwrap()
}

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

#[test]
fn gradients_match_central_finite_differences_in_f64() {
    for (arch, tie) in [("qwen3", false), ("qwen2", false), ("llama", true)] {
        let cfg = config(arch, tie);
        let s = student(&cfg, DType::F64, 7);
        let grads = loss(s.model()).backward().unwrap();
        let mut checked = 0;
        for (name, var) in s.named_vars() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{arch}: no gradient for {name}"));
            let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
            let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            // Three entries per tensor, spread over it.
            for &i in &[0, base.len() / 2, base.len() - 1] {
                let h = 1e-5;
                let probe = |delta: f64| {
                    let mut v = base.clone();
                    v[i] += delta;
                    var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap())
                        .unwrap();
                    scalar(&loss(s.model()))
                };
                let fd = (probe(h) - probe(-h)) / (2.0 * h);
                var.set(&Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let tol = 1e-6 + 1e-4 * fd.abs().max(g[i].abs());
                assert!(
                    (fd - g[i]).abs() < tol,
                    "{arch} {name}[{i}]: backward {} vs finite difference {fd}",
                    g[i]
                );
                checked += 1;
            }
        }
        assert!(checked > 30, "{arch}: only {checked} entries checked");
    }
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for (arch, tie) in [("qwen3", false), ("qwen2", false), ("llama", true)] {
        let cfg = config(arch, tie);
        let s = student(&cfg, DType::F32, 3);
        let grads = loss(s.model()).backward().unwrap();
        let vars = s.named_vars();
        assert_eq!(vars.len(), s.model().param_names().len());
        for (name, var) in vars {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{arch}: {name} got no gradient"));
            let norm = scalar(&g.sqr().unwrap().sum_all().unwrap());
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{arch}: {name} gradient norm {norm}"
            );
        }
    }
}

#[test]
fn saved_student_serves_identical_logits() {
    let dir = tempfile::tempdir().unwrap();
    let tok = xdistill_shared::paths::tokenizer_json("llama2");
    let cfg = config("qwen3", false);
    let mut s = student(&cfg, DType::F32, 11);
    s.tokenizer_json = tok;
    let out = dir.path().join("saved");
    s.save(&out).unwrap();
    let md = ModelDir::open(&out).unwrap();
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu)
            .unwrap()
    };
    let served = Decoder::new(&md.config, vb, Ops::Fused).unwrap();
    let ids = Tensor::new(&IDS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let a = s.model().forward(&ids).unwrap();
    let b = served.forward(&ids).unwrap();
    let diff = scalar(&(a - b).unwrap().abs().unwrap().max_all().unwrap());
    assert!(diff < 1e-5, "{diff}");
    // And it loads back as a student with bit-identical weights.
    let back = Student::load(&out, &Device::Cpu, DType::F32).unwrap();
    for ((n1, v1), (n2, v2)) in s.named_vars().into_iter().zip(back.named_vars()) {
        assert_eq!(n1, n2);
        let a: Vec<f32> = v1.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = v2.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a, b, "{n1}");
    }
}
