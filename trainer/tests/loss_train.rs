//! End to end on a tiny differentiable decoder: the losses' gradients reach every parameter, and
//! a few AdamW steps with accumulation, clipping and a schedule lower the distillation loss.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xdistill_shared::hf::ModelConfig;
use xdistill_shared::model::{Decoder, Ops};
use xdistill_trainer::init_model::random_params;
use xdistill_trainer::loss::{
    combine, cross_entropy, kd_loss, CeConfig, KdConfig, KdInputs, LossConfig, Normalizer,
    TailMode, Temperature, TopkTargets,
};
use xdistill_trainer::optim::{
    clip_grad_norm, AdamW, AdamWConfig, GradAccumulator, ScheduleConfig,
};

const B: usize = 2;
const T: usize = 8;
const V: usize = 32;
const K: usize = 6;

fn tiny_student() -> (VarMap, Decoder) {
    let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "qwen3", "vocab_size": V, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "max_position_embeddings": 64
    }))
    .unwrap();
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let model = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
    // A VarMap-built decoder starts at zero (candle's default init): load random weights.
    let params = random_params(&cfg, 0.2, 3).unwrap();
    for (name, var) in vm.data().lock().unwrap().iter() {
        var.set(&params[name]).unwrap();
    }
    (vm, model)
}

/// A fixed "teacher": seeded random distributions per position, top-k ids and log-probs.
fn teacher(rng: &mut ChaCha8Rng) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut lps) = (vec![], vec![]);
    for _ in 0..B * T {
        let z: Vec<f64> = (0..V).map(|_| rng.random_range(-3.0..3.0)).collect();
        let m = z.iter().cloned().fold(f64::MIN, f64::max);
        let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let mut order: Vec<usize> = (0..V).collect();
        order.sort_by(|&a, &b| z[b].partial_cmp(&z[a]).unwrap());
        for &i in &order[..K] {
            ids.push(i as u32);
            lps.push((z[i] - lse) as f32);
        }
    }
    (ids, lps)
}

#[test]
fn gradients_reach_every_parameter_and_training_lowers_the_loss() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (vm, model) = tiny_student();
    let ids: Vec<u32> = (0..B * T).map(|_| rng.random_range(0..V as u32)).collect();
    let (tids, tlps) = teacher(&mut rng);
    // Row t predicts token t + 1: the last position has no target.
    let mask: Vec<f32> = (0..B * T)
        .map(|p| if p % T == T - 1 { 0.0 } else { 1.0 })
        .collect();
    let ce_targets: Vec<u32> = (0..B * T)
        .map(|p| if p % T == T - 1 { 0 } else { ids[p + 1] })
        .collect();
    let dev = Device::Cpu;
    let targets = TopkTargets::from_host(B, T, K, &tids, &tlps, &mask, V, &dev).unwrap();
    let ids = Tensor::from_vec(ids, (B, T), &dev).unwrap();
    let ce_targets = Tensor::from_vec(ce_targets, (B, T), &dev).unwrap();
    let global_tokens: f64 = mask.iter().map(|&m| m as f64).sum();

    let loss_cfg = LossConfig {
        kd: KdConfig::Jsd { beta: 0.5 },
        tail: Some(TailMode::Bucket),
        temperature: Temperature::ONE,
        kd_weight: 1.0,
        ce: CeConfig::Weight { weight: 0.1 },
    };
    let opt_cfg = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::from_varmap(&vm, opt_cfg.clone()).unwrap();
    let vars = opt.vars();
    let schedule = ScheduleConfig::Cosine {
        warmup_steps: 2,
        min_lr: 1e-3,
    };
    let steps = 15;
    let mut acc = GradAccumulator::new(vars.clone());
    let mut kd_history = vec![];
    for step in 0..steps {
        let mut kd_sum = 0.0;
        // Two micro-batches of one row each, normalised by the global token count.
        for row in 0..B {
            let logits = model.forward(&ids.narrow(0, row, 1).unwrap()).unwrap();
            let part = targets.batch_rows(row, 1).unwrap();
            let (kd, m) = kd_loss(
                &loss_cfg,
                &logits,
                KdInputs::Topk(&part),
                Some(Normalizer::new(global_tokens).unwrap()),
            )
            .unwrap();
            let (ce, _) = cross_entropy(
                &logits,
                &ce_targets.narrow(0, row, 1).unwrap(),
                &part.mask,
                Some(Normalizer::new(global_tokens).unwrap()),
            )
            .unwrap();
            kd_sum += m.loss;
            let total = combine(&kd, Some(&ce), &loss_cfg).unwrap().total;
            acc.add(&total.backward().unwrap()).unwrap();
        }
        let mut grads = acc.take().unwrap();
        if step == 0 {
            for (name, var) in vm.data().lock().unwrap().iter() {
                let g = grads.get(var.as_tensor());
                let norm = g.map(|g| {
                    g.sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                });
                assert!(norm.is_some_and(|n| n > 0.0), "{name} got no gradient");
            }
        }
        let norm = clip_grad_norm(&mut grads, &vars, 1.0).unwrap();
        assert!(norm.is_finite());
        opt.set_learning_rate(schedule.lr(opt_cfg.lr, steps, step));
        opt.step(&grads).unwrap();
        kd_history.push(kd_sum);
    }
    let (first, last) = (kd_history[0], kd_history[steps - 1]);
    assert!(last < 0.8 * first, "JSD did not fall: {kd_history:?}");
}

#[test]
fn kd_loss_refuses_inputs_of_the_wrong_kind() {
    let dev = Device::Cpu;
    let targets = TopkTargets::from_host(1, 1, 1, &[0], &[-0.1], &[1.0], V, &dev).unwrap();
    let cfg = LossConfig {
        kd: KdConfig::Alm { tau: 100.0 },
        tail: Some(TailMode::Bucket),
        temperature: Temperature::ONE,
        kd_weight: 1.0,
        ce: CeConfig::None {},
    };
    let logits = Tensor::zeros((1, 1, V), DType::F32, &dev).unwrap();
    assert!(kd_loss(&cfg, &logits, KdInputs::Topk(&targets), None).is_err());
}
