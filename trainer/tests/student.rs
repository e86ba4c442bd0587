//! The trainable student: gradients are right (central finite differences in f64) and reach every
//! parameter; saving gives a directory the serving decoder loads with identical logits.

use candle_core::{DType, Device, Tensor, Var, D};
use xdistill_shared::hf::{ModelConfig, ModelDir};
use xdistill_shared::model::{Decoder, Ops};
use xdistill_testkit::reference::f64s as flat;
use xdistill_trainer::init_model::random_params;
use xdistill_trainer::optim::GradAccumulator;
use xdistill_trainer::student::{compute_vars, Student};

fn config(model_type: &str, tie: bool) -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": model_type, "vocab_size": 40, "hidden_size": 16, "intermediate_size": 20,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 32, "rope_theta": 10000.0, "tie_word_embeddings": tie
    }))
    .unwrap()
}

/// Every architecture a student may have, with its features on (windows shorter than [`IDS`]).
fn student_configs() -> Vec<(&'static str, ModelConfig)> {
    let with = |model_type: &str, tie: bool, extra: serde_json::Value| {
        let mut v = serde_json::to_value(config(model_type, tie)).unwrap();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value::<ModelConfig>(v).unwrap()
    };
    vec![
        ("qwen3", config("qwen3", false)),
        ("qwen2", config("qwen2", false)),
        ("llama", config("llama", true)),
        (
            "mistral",
            with("mistral", false, serde_json::json!({"sliding_window": 3})),
        ),
        (
            "ministral",
            with(
                "ministral",
                false,
                serde_json::json!({"sliding_window": 3,
                    "layer_types": ["full_attention", "sliding_attention"]}),
            ),
        ),
        (
            "gemma3",
            with(
                "gemma3_text",
                true,
                serde_json::json!({"sliding_window": 3, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 4}),
            ),
        ),
        (
            "phi3",
            with(
                "phi3",
                false,
                serde_json::json!({"partial_rotary_factor": 0.5, "sliding_window": 4,
                    "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                    "original_max_position_embeddings": 16}}),
            ),
        ),
    ]
}

fn student(cfg: &ModelConfig, dtype: DType, seed: u64) -> Student {
    student_mixed(cfg, dtype, dtype, seed)
}

/// A bf16-compute student built afresh from `s`'s current masters (the reference for copies
/// updated in place).
fn rebuilt_bf16(cfg: &ModelConfig, s: &Student) -> Student {
    Student::from_tensors(
        cfg.clone(),
        s.tensors().unwrap(),
        "unused".into(),
        &Device::Cpu,
        DType::F32,
        DType::BF16,
    )
    .unwrap()
}

/// Masters in `master`, forward in `compute`.
fn student_mixed(cfg: &ModelConfig, master: DType, compute: DType, seed: u64) -> Student {
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
        master,
        compute,
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
    for (arch, cfg) in student_configs() {
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
    for (arch, cfg) in student_configs() {
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
    let tok = xdistill_testkit::tokenizer_json("llama2");
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

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// The GPU training setup (bf16 forward/backward, f32 masters), run on the CPU: loss and
/// gradients agree with an all-f32 student to bf16 accuracy, the gradients land on the bf16
/// compute copies and the accumulator hands them to the masters (as they came, in a step of one
/// micro-batch: the optimiser widens them as it reads), AdamW updates those
/// below bf16 resolution, and `refresh` makes the next forward use them.
#[test]
fn bf16_compute_trains_the_f32_masters() {
    use xdistill_trainer::optim::{AdamW, AdamWConfig};
    for (arch, tie) in [("qwen3", false), ("llama", true)] {
        let cfg = config(arch, tie);
        let s32 = student(&cfg, DType::F32, 5);
        let mut s16 = student_mixed(&cfg, DType::F32, DType::BF16, 5);
        assert_eq!(s16.master_dtype(), DType::F32);
        assert_eq!(s16.model().dtype(), DType::BF16);
        let (l32, l16) = (loss(s32.model()), loss(s16.model()));
        let (v32, v16) = (scalar(&l32), scalar(&l16));
        assert!(
            (v32 - v16).abs() < 2e-2 * v32.abs(),
            "{arch}: f32 loss {v32} vs bf16 {v16}"
        );
        let g32 = l32.backward().unwrap();
        let masters: Vec<Var> = s16.named_vars().into_iter().map(|(_, v)| v).collect();
        let keys = s16.grad_keys(&masters);
        let mut acc = GradAccumulator::with_keys(masters.clone(), keys.clone());
        let raw16 = l16.backward().unwrap();
        for ((name, _), key) in s16.named_vars().iter().zip(&keys) {
            let g = raw16
                .get(key)
                .unwrap_or_else(|| panic!("{arch}: no gradient reached the copy of {name}"));
            assert_eq!(g.dtype(), DType::BF16, "{arch}: {name}");
        }
        acc.add(&raw16).unwrap();
        let g16 = acc.take().unwrap();
        let (mut all32, mut all16) = (Vec::new(), Vec::new());
        for ((name, a), (_, b)) in s32.named_vars().into_iter().zip(s16.named_vars()) {
            let ga = g32.get(a.as_tensor()).unwrap();
            let gb = g16
                .get(b.as_tensor())
                .unwrap_or_else(|| panic!("{arch}: no gradient summed for master {name}"));
            assert_eq!(gb.dtype(), DType::BF16, "{arch}: {name} (held as it came)");
            let (ga, gb) = (flat(ga), flat(gb));
            let c = cosine(&ga, &gb);
            assert!(c > 0.95, "{arch}: {name} gradient cosine {c}");
            all32.extend(ga);
            all16.extend(gb);
        }
        let c = cosine(&all32, &all16);
        assert!(c > 0.99, "{arch}: global gradient cosine {c}");

        // One AdamW step on the masters (first Adam step: every entry moves by ~lr).
        let before: Vec<Vec<f64>> = s16
            .named_vars()
            .iter()
            .map(|(_, v)| flat(v.as_tensor()))
            .collect();
        let config = AdamWConfig {
            lr: 1e-4,
            weight_decay: 0.0,
            ..Default::default()
        };
        let mut opt = AdamW::from_varmap(&s16.varmap, config).unwrap();
        opt.step(&g16).unwrap();
        let mut moved_below_bf16 = 0;
        for ((name, v), old) in s16.named_vars().iter().zip(&before) {
            assert_eq!(v.dtype(), DType::F32);
            let new = flat(v.as_tensor());
            let step = new
                .iter()
                .zip(old)
                .map(|(a, b)| (a - b).abs())
                .fold(0f64, f64::max);
            assert!(step > 0.0 && step < 2e-4, "{arch}: {name} moved by {step}");
            // Updates a bf16 master would have rounded away.
            moved_below_bf16 += new
                .iter()
                .zip(old)
                .filter(|(a, b)| a != b && half::bf16::from_f64(**a) == half::bf16::from_f64(**b))
                .count();
        }
        assert!(moved_below_bf16 > 0, "{arch}: no sub-bf16 update kept");
        // The stale compute copy still gives the old loss; after refresh the forward is exactly
        // that of a bf16 student built afresh from the updated masters, and differs from before.
        let ids = Tensor::new(&IDS, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let stale = s16.model().forward(&ids).unwrap();
        assert!((scalar(&loss(s16.model())) - v16).abs() < 1e-9);
        s16.refresh().unwrap();
        let fresh = rebuilt_bf16(&cfg, &s16);
        let got = s16.model().forward(&ids).unwrap();
        let want = fresh.model().forward(&ids).unwrap();
        assert_eq!(
            flat(&got),
            flat(&want),
            "{arch}: refresh differs from a fresh build"
        );
        let moved = scalar(&(&got - &stale).unwrap().abs().unwrap().max_all().unwrap());
        assert!(moved > 0.0, "{arch}: refresh did not pick up the update");
    }
}

/// For every student architecture in bf16 compute: one compute copy per master (a tied head's
/// weight included once), and after the masters move, writing the copies in place (what the
/// multi-tensor AdamW does in its launch, `Student::refresh` here) makes the forward of a
/// student built afresh from the new masters, bit for bit, with no rebuild; each copy receives
/// its gradient in bf16, exactly the f32 master gradient a differentiable cast would give.
#[test]
fn compute_copies_written_in_place_are_what_the_decoder_reads() {
    let ids = Tensor::new(&IDS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    for (arch, cfg) in student_configs() {
        let mut s16 = student_mixed(&cfg, DType::F32, DType::BF16, 7);
        let names: Vec<String> = s16.named_vars().into_iter().map(|(n, _)| n).collect();
        let mut copies: Vec<String> = s16.compute_copies().keys().cloned().collect();
        copies.sort();
        assert_eq!(copies, names, "{arch}: one compute copy per master");
        let before = s16.model().forward(&ids).unwrap();
        for (i, (_, v)) in s16.named_vars().iter().enumerate() {
            let moved = v
                .as_tensor()
                .affine(1.0 + 0.01 * (i % 5) as f64, 0.003)
                .unwrap();
            v.set(&moved).unwrap();
        }
        s16.refresh().unwrap();
        let fresh = rebuilt_bf16(&cfg, &s16);
        let got = s16.model().forward(&ids).unwrap();
        assert_eq!(
            flat(&got),
            flat(&fresh.model().forward(&ids).unwrap()),
            "{arch}: in-place copies differ from a fresh build"
        );
        assert_ne!(flat(&got), flat(&before), "{arch}: the copies did not move");
        // The reference: the same bf16 forward over tracked casts of the masters.
        let vb = compute_vars(&s16.varmap, DType::BF16, &Device::Cpu);
        let cast = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
        let want = loss(&cast).backward().unwrap();
        let g = loss(s16.model()).backward().unwrap();
        let masters: Vec<Var> = s16.named_vars().into_iter().map(|(_, v)| v).collect();
        for ((name, m), key) in s16.named_vars().iter().zip(s16.grad_keys(&masters)) {
            let got = g.get(&key).unwrap_or_else(|| panic!("{arch}: {name}"));
            assert_eq!(got.dtype(), DType::BF16, "{arch}: {name}");
            let want = want.get(m.as_tensor()).unwrap();
            assert_eq!(
                flat(got),
                flat(want),
                "{arch}: {name}: the copy's gradient differs from the cast's"
            );
        }
    }
    // f32 compute reads the masters themselves: no copies.
    let s32 = student(&config("qwen3", false), DType::F32, 7);
    assert!(s32.compute_copies().is_empty());
}

/// A Qwen3-MoE student is refused with a message that says so (MoE models teach only).
#[test]
fn moe_students_are_refused() {
    let mut v = serde_json::to_value(config("qwen3_moe", false)).unwrap();
    v["num_experts"] = serde_json::json!(4);
    v["num_experts_per_tok"] = serde_json::json!(2);
    v["moe_intermediate_size"] = serde_json::json!(8);
    let cfg: ModelConfig = serde_json::from_value(v).unwrap();
    let params = random_params(&cfg, 0.1, 1).unwrap();
    let err = Student::from_tensors(
        cfg,
        params,
        "unused".into(),
        &Device::Cpu,
        DType::F32,
        DType::F32,
    )
    .err()
    .expect("refused");
    assert!(
        err.to_string()
            .contains("Qwen3-MoE students are not supported"),
        "{err}"
    );
}

/// Every architecture's `init-model` directory passes the config-vs-weights checks and loads as
/// a student (Phi-3's fused projections included); Qwen3-MoE's is refused by name.
#[test]
fn student_directories_of_every_architecture_load() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in [
        "qwen3",
        "qwen2",
        "llama",
        "mistral",
        "gemma3",
        "phi3",
        "qwen3-moe",
    ] {
        let out = tmp.path().join(arch);
        xdistill_trainer::init_model::run(xdistill_trainer::init_model::Args {
            arch: arch.into(),
            tokenizer: xdistill_testkit::tokenizer_json("llama2"),
            hidden_size: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate_size: 48,
            head_dim: None,
            pad_vocab_to: 64,
            max_position_embeddings: 64,
            tie_embeddings: false,
            init_std: 0.02,
            seed: 1,
            out: out.clone(),
            features: xdistill_trainer::init_model::Features {
                sliding_window: Some(16),
                ..Default::default()
            },
        })
        .unwrap();
        let loaded = Student::load(&out, &Device::Cpu, DType::F32);
        match arch {
            "qwen3-moe" => {
                let err = loaded.err().expect("MoE student refused").to_string();
                assert!(
                    err.contains("Qwen3-MoE students are not supported"),
                    "{err}"
                );
            }
            _ => {
                let s = loaded.unwrap_or_else(|e| panic!("{arch}: {e:#}"));
                assert_eq!(
                    s.named_vars().len(),
                    s.model().param_names().len(),
                    "{arch}"
                );
            }
        }
    }
}

/// The generation decoder records no gradient graph (a rollout keeps no activations alive),
/// reads the f32 masters in place, or in bf16 compute the compute copies (an optimizer update
/// made after it was built is seen), and gives the training decoder's outputs.
#[test]
fn inference_model_is_untracked_and_reads_the_masters() {
    let cfg = config("qwen3", false);
    let s = student(&cfg, DType::F32, 9);
    let ids = Tensor::new(&IDS, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let gen = s.inference_model().unwrap();
    let trained = s.model().forward(&ids).unwrap();
    let before = gen.forward(&ids).unwrap();
    assert!(trained.track_op(), "the training decoder is tracked");
    assert!(!before.track_op(), "the generation decoder must not be");
    let worst = scalar(
        &(&before - &trained)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap(),
    );
    assert!(worst < 1e-4, "fused and differentiable ops agree: {worst}");
    // An in-place update of one master, as AdamW makes it.
    let (_, embed) = s
        .named_vars()
        .into_iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap();
    embed.set(&(embed.as_tensor() * 1.5).unwrap()).unwrap();
    let after = gen.forward(&ids).unwrap();
    let want = s.inference_model().unwrap().forward(&ids).unwrap();
    assert_eq!(flat(&after), flat(&want), "the update is seen in place");
    assert_ne!(flat(&after), flat(&before));

    // In bf16 compute it reads the compute copies in place: untracked, and an update written
    // into them (here by refresh) is seen without a new decoder.
    let mut s16 = student_mixed(&cfg, DType::F32, DType::BF16, 9);
    let gen = s16.inference_model().unwrap();
    let before = gen.forward(&ids).unwrap();
    assert!(
        !before.track_op(),
        "the bf16 generation decoder must not be tracked"
    );
    for (_, v) in s16.named_vars() {
        v.set(&(v.as_tensor() * 1.25).unwrap()).unwrap();
    }
    s16.refresh().unwrap();
    let after = gen.forward(&ids).unwrap();
    let fresh = rebuilt_bf16(&cfg, &s16);
    let want = fresh.inference_model().unwrap().forward(&ids).unwrap();
    assert_eq!(
        flat(&after),
        flat(&want),
        "bf16: the copies' update is seen in place"
    );
    assert_ne!(flat(&after), flat(&before));
}

/// A checkpoint of another model (a tensor of another shape) is refused by name when a run
/// resumes from it, before any weight is overwritten.
#[test]
fn restoring_a_checkpoint_of_another_model_names_the_tensor() {
    use xdistill_trainer::checkpoint::{Checkpoint, TrainerState};
    use xdistill_trainer::train::runner::{optim_config, Runner};
    let cfg = config("llama", false);
    let wider: ModelConfig = serde_json::from_value({
        let mut v = serde_json::to_value(&cfg).unwrap();
        v["intermediate_size"] = 24.into();
        v
    })
    .unwrap();
    let other = student(&wider, DType::F32, 2).tensors().unwrap();
    let mut runner = Runner::new(
        student(&cfg, DType::F32, 1),
        optim_config(&Default::default()),
        1,
    )
    .unwrap();
    let ck = Checkpoint {
        path: "step_1".into(),
        model_config: wider,
        model: other,
        optimizer: Default::default(),
        state: TrainerState::new(
            1,
            Default::default(),
            &rand::SeedableRng::seed_from_u64(0),
            String::new(),
        ),
    };
    let e = runner.restore(&ck).unwrap_err().to_string();
    assert!(
        e.contains("mlp.") && e.contains("of another model than policy.model_name"),
        "{e}"
    );
}
