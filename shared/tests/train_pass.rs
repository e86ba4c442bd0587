//! The training pass: a checkpointed forward and backward (layers recomputed, attention in query
//! blocks) gives the hidden states and every parameter's gradient of the plain autograd pass, for
//! every dense architecture, in f64 (to 1e-10 relative) and f32 (to 2e-5 relative); the selective
//! pass (attention core recomputed only) gives the checkpointed pass's bits.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use xdistill_shared::hf::ModelConfig;
use xdistill_shared::model::{
    override_attention_block, param_specs, ActivationBytes, Activations, Decoder, Init, Ops,
    KEEP_MAX_POSITIONS,
};

fn config(model_type: &str, extra: serde_json::Value) -> ModelConfig {
    let mut v = serde_json::json!({
        "model_type": model_type, "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "attention_bias": false
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    let cfg: ModelConfig = serde_json::from_value(v).unwrap();
    cfg.validate().unwrap();
    cfg
}

/// Every dense architecture a student may be, each feature on: GQA and q/k norms (Qwen3),
/// biases (Qwen2), tied heads (Llama), sliding windows shorter than the sequence (Mistral, a
/// windowed Qwen3), Gemma 3's local/global layers, post norms and embedding scale, and Phi-3's
/// fused projections with partial rotary.
fn archs() -> Vec<(&'static str, ModelConfig)> {
    use serde_json::json;
    vec![
        ("qwen3", config("qwen3", json!({}))),
        ("qwen2", config("qwen2", json!({"attention_bias": true}))),
        (
            "llama",
            config("llama", json!({"tie_word_embeddings": true})),
        ),
        ("mistral", config("mistral", json!({"sliding_window": 3}))),
        (
            "qwen3 window",
            config(
                "qwen3",
                json!({"sliding_window": 4, "use_sliding_window": true, "max_window_layers": 1}),
            ),
        ),
        (
            "gemma3",
            config(
                "gemma3_text",
                json!({"num_hidden_layers": 3, "sliding_window": 3, "sliding_window_pattern": 3,
                    "query_pre_attn_scalar": 8, "rope_local_base_freq": 100.0,
                    "tie_word_embeddings": true}),
            ),
        ),
        (
            "phi3",
            config(
                "phi3",
                json!({"head_dim": null, "hidden_size": 32, "partial_rotary_factor": 0.5,
                    "sliding_window": 5}),
            ),
        ),
    ]
}

/// `n` values in [-0.5, 0.5) from an LCG.
fn noise(seed: u64, n: usize) -> Vec<f64> {
    xdistill_shared::init::lcg_noise(seed, n, 1.0)
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Trainable parameters for `cfg` in `dtype` (non-trivial norms so their paths matter).
fn varmap(cfg: &ModelConfig, dtype: DType) -> VarMap {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        for (i, s) in param_specs(cfg, 0.2).into_iter().enumerate() {
            let n: usize = s.shape.iter().product();
            let v: Vec<f64> = match s.init {
                Init::Normal(_) => noise(100 + i as u64, n).iter().map(|x| x * 0.6).collect(),
                _ => noise(100 + i as u64, n)
                    .iter()
                    .map(|x| 1.0 + x * 0.5)
                    .collect(),
            };
            let t = Tensor::from_vec(v, s.shape, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            data.insert(s.name, Var::from_tensor(&t).unwrap());
        }
    }
    vm
}

/// Hidden states and all gradients of `Σ hidden ∘ r` for one way of keeping activations.
fn pass(model: &Decoder, vm: &VarMap, ids: &Tensor, act: Activations) -> (Vec<f64>, Vec<Vec<f64>>) {
    let flat = xdistill_testkit::reference::f64s;
    let p = model.train_forward(ids, act).unwrap();
    let hidden = flat(p.hidden());
    let r = Tensor::from_vec(noise(7, hidden.len()), p.hidden().shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(p.hidden().dtype())
        .unwrap();
    let grads = p.backward(&r).unwrap();
    // The head is the loss's (applied to the hidden states by the caller).
    let mut names: Vec<_> = vm.data().lock().unwrap().keys().cloned().collect();
    names.retain(|n| n != "lm_head.weight");
    names.sort();
    let data = vm.data().lock().unwrap();
    let g = names
        .iter()
        .map(|n| {
            let v = &data[n];
            flat(
                grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{n}: no gradient")),
            )
        })
        .collect();
    (hidden, g)
}

fn worst_relative(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn checkpointed_and_selective_passes_equal_the_plain_pass() {
    let rows: [[u32; 11]; 2] = [
        [3, 17, 2, 8, 8, 1, 39, 0, 23, 5, 11],
        [9, 4, 4, 30, 1, 2, 6, 7, 12, 0, 3],
    ];
    let ids = Tensor::new(&rows, &Device::Cpu).unwrap();
    for (name, cfg) in archs() {
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
            for block in [0usize, 1, 4] {
                override_attention_block(block);
                let vm = varmap(&cfg, dtype);
                let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
                let model = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
                let (h0, g0) = pass(&model, &vm, &ids, Activations::Keep);
                let (h1, g1) = pass(&model, &vm, &ids, Activations::Checkpoint);
                let (h2, g2) = pass(&model, &vm, &ids, Activations::Selective);
                let case = format!("{name} {dtype:?} block {block}");
                // Selective runs checkpointing's ops without the recompute: the same bits.
                assert_eq!(h2, h1, "{case}: selective hidden states");
                assert_eq!(g2, g1, "{case}: selective gradients");
                assert!(worst_relative(&h1, &h0) <= tol, "{case}: hidden states");
                assert_eq!(g0.len(), g1.len());
                for (i, (a, b)) in g1.iter().zip(&g0).enumerate() {
                    let w = worst_relative(a, b);
                    assert!(w <= tol, "{case}: gradient {i} differs by {w:e} (relative)");
                    assert!(
                        b.iter().any(|x| *x != 0.0),
                        "{case}: gradient {i} is all zero"
                    );
                }
            }
        }
    }
    override_attention_block(0);
}

/// The checkpointed pass reads a bf16 copy of f32 master weights through a cast and its
/// gradients reach the f32 masters, within bf16 rounding of the plain pass's, with the composed
/// ops and with the fused ones.
#[test]
fn checkpointed_pass_through_a_cast_reaches_the_masters() {
    let cfg = config("qwen3", serde_json::json!({}));
    let vm = varmap(&cfg, DType::F32);
    let names: Vec<String> = vm.data().lock().unwrap().keys().cloned().collect();
    let vb = VarBuilder::from_tensors(
        names
            .iter()
            .map(|n| {
                let v = vm.data().lock().unwrap()[n].clone();
                (n.clone(), v.as_tensor().to_dtype(DType::BF16).unwrap())
            })
            .collect(),
        DType::BF16,
        &Device::Cpu,
    );
    let model = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
    let ids = Tensor::new(&[[3u32, 17, 2, 8, 8, 1, 39, 0]], &Device::Cpu).unwrap();
    override_attention_block(3);
    let (h0, g0) = pass(&model, &vm, &ids, Activations::Keep);
    let (h1, g1) = pass(&model, &vm, &ids, Activations::Checkpoint);
    // With the fused ops the layers would run by hand, but gradients by hand go to the tensors
    // the layers hold: weights read through a cast keep the autograd pass, so that theirs still
    // reach the masters.
    use xdistill_shared::model::device_ops::force_in_this_thread;
    force_in_this_thread(Some(true));
    let by_hand = model.trains_by_hand();
    let (h2, g2) = pass(&model, &vm, &ids, Activations::Checkpoint);
    force_in_this_thread(None);
    override_attention_block(0);
    assert!(!by_hand, "weights through a cast trained by hand");
    for (h, g) in [(&h1, &g1), (&h2, &g2)] {
        assert!(worst_relative(h, &h0) < 2e-2);
        for (a, b) in g.iter().zip(&g0) {
            assert!(worst_relative(a, b) < 5e-2, "{}", worst_relative(a, b));
        }
    }
}

/// Auto keeps everything where it fits the budget (short sequences), else keeps all but the
/// attention core, else checkpoints; the estimates grow as they should (keep with T², the others
/// with T).
#[test]
fn auto_keeps_what_fits_the_budget() {
    let tiny = config("qwen3", serde_json::json!({}));
    let vm = varmap(&tiny, DType::F32);
    let model = Decoder::new(
        &tiny,
        VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
        Ops::Differentiable,
    )
    .unwrap();
    let at = |t| ActivationBytes::of(&model, 4, t);
    let (short, long) = (at(64), at(128));
    assert!(short.checkpoint < short.selective && short.selective < short.keep);
    // Doubling T: selective and checkpoint double, keep more than doubles (its scores).
    assert!((long.selective / short.selective - 2.0).abs() < 1e-9);
    assert!((long.checkpoint / short.checkpoint - 2.0).abs() < 1e-9);
    assert!(long.keep / short.keep > 2.0);
    for (budget, want) in [
        (short.keep, Activations::Keep),
        (short.keep - 1.0, Activations::Selective),
        (short.selective, Activations::Selective),
        (short.selective - 1.0, Activations::Checkpoint),
        (0.0, Activations::Checkpoint),
    ] {
        assert_eq!(Activations::auto(&model, 4, 64, budget), want, "{budget}");
    }
    // Past KEEP_MAX_POSITIONS selective is the faster way, whatever the budget.
    let t = KEEP_MAX_POSITIONS + 1;
    assert_eq!(
        Activations::auto(&model, 4, t, f64::MAX),
        Activations::Selective
    );
}

/// The fused norm, RoPE and gated activation (`model::device_ops`, run here through their CPU
/// reference as the CUDA kernels would run them) give the composed ops' hidden states and
/// gradients in a training pass, kept, selective and checkpointed, for every dense architecture
/// in f64 — selective and checkpointed with the layers by hand (`train_layer.rs`: no autograd
/// graph), which also give each other's bits; and
/// their logits at inference (RoPE written heads-first in the same pass) in f32. Gemma 3's
/// GELU gradient is held to 1e-6: candle's backward of the tanh GELU uses six-digit constants
/// (the fused op's own gradient is checked against central differences in its unit test).
#[test]
fn fused_device_ops_give_the_composed_pass() {
    use xdistill_shared::model::device_ops::force_in_this_thread;
    let ids = Tensor::new(
        &[
            [3u32, 17, 2, 8, 8, 1, 39, 0, 23],
            [9, 4, 4, 30, 1, 2, 6, 7, 12],
        ],
        &Device::Cpu,
    )
    .unwrap();
    for (name, cfg) in archs() {
        let tol = if name == "gemma3" { 1e-6 } else { 1e-10 };
        let vm = varmap(&cfg, DType::F64);
        let vb = VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
        let model = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
        // Serving's fused ops take f32 (candle's rms_norm has no f64).
        let vm32 = varmap(&cfg, DType::F32);
        let vb32 = VarBuilder::from_varmap(&vm32, DType::F32, &Device::Cpu);
        let serving = Decoder::new(&cfg, vb32, Ops::Fused).unwrap();
        assert!(
            !model.trains_by_hand(),
            "{name}: by hand without the fused ops"
        );
        let mut by_hand = Vec::new();
        for act in [
            Activations::Keep,
            Activations::Selective,
            Activations::Checkpoint,
        ] {
            let (h0, g0) = pass(&model, &vm, &ids, act);
            force_in_this_thread(Some(true));
            assert!(model.trains_by_hand(), "{name}: not by hand");
            let (h1, g1) = pass(&model, &vm, &ids, act);
            force_in_this_thread(None);
            if act != Activations::Keep {
                by_hand.push((h1.clone(), g1.clone()));
            }
            let case = format!("{name} {}", act.name());
            // Other ops, other roundings: not the same bits (so the fused ops did run).
            assert_ne!(g1, g0, "{case}: the fused ops did not run");
            assert!(worst_relative(&h1, &h0) <= 1e-12, "{case}: hidden states");
            for (i, (a, b)) in g1.iter().zip(&g0).enumerate() {
                let w = worst_relative(a, b);
                assert!(w <= tol, "{case}: gradient {i} differs by {w:e} (relative)");
            }
        }
        // By hand, selective and checkpointed run the same ops in the same order.
        assert!(
            by_hand[0] == by_hand[1],
            "{name}: selective and checkpoint by hand differ"
        );
        let logits = |on: bool| -> Vec<f64> {
            force_in_this_thread(Some(on));
            let l = serving.forward(&ids).unwrap();
            force_in_this_thread(None);
            l.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (fused, composed) = (logits(true), logits(false));
        assert_ne!(fused, composed, "{name}: the fused ops did not run");
        let w = worst_relative(&fused, &composed);
        assert!(w <= 2e-6, "{name}: logits differ by {w:e}");
    }
}
