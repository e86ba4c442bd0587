//! AdamW against a hand-written f64 update, master weights, exact resume.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::loss::testutil::{assert_close, flat, rng, uniform};

/// The textbook AdamW step on f64 vectors (PyTorch's formulation), for the reference.
#[allow(clippy::too_many_arguments)]
fn ref_step(
    w: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    g: &[f64],
    t: i32,
    lr: f64,
    c: &AdamWConfig,
    decay: bool,
) {
    for i in 0..w.len() {
        if decay {
            w[i] *= 1.0 - lr * c.weight_decay;
        }
        m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * g[i];
        v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * g[i] * g[i];
        let mh = m[i] / (1.0 - c.beta1.powi(t));
        let vh = v[i] / (1.0 - c.beta2.powi(t));
        w[i] -= lr * mh / (vh.sqrt() + c.eps);
    }
}

fn grads_for(pairs: &[(&Var, &[f64])]) -> GradStore {
    let mut g = GradStore::default();
    for (var, data) in pairs {
        let t = Tensor::from_vec(data.to_vec(), var.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(var.dtype())
            .unwrap();
        g.insert(var.as_tensor(), t);
    }
    g
}

fn new_var(data: &[f64], shape: &[usize], dtype: DType) -> Var {
    let t = Tensor::from_vec(data.to_vec(), shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    Var::from_tensor(&t).unwrap()
}

#[test]
fn matches_hand_computed_updates_over_three_steps() {
    let c = AdamWConfig {
        lr: 0.0,
        beta1: 0.8,
        beta2: 0.95,
        eps: 1e-6,
        weight_decay: 0.1,
        decay_1d: false,
    };
    let mut r = rng(31);
    let w_mat0 = uniform(&mut r, 6, 1.0);
    let w_vec0 = uniform(&mut r, 4, 1.0);
    let mat = new_var(&w_mat0, &[2, 3], DType::F32);
    let vec = new_var(&w_vec0, &[4], DType::F32);
    let mut opt = AdamW::with_names(
        vec![("mat".into(), mat.clone()), ("vec".into(), vec.clone())],
        c.clone(),
    )
    .unwrap();
    let (mut wm, mut mm, mut vm) = (w_mat0.clone(), vec![0.0; 6], vec![0.0; 6]);
    let (mut wv, mut mv, mut vv) = (w_vec0.clone(), vec![0.0; 4], vec![0.0; 4]);
    for (t, lr) in [(1, 0.1), (2, 0.05), (3, 0.02)] {
        let gm = uniform(&mut r, 6, 2.0);
        let gv = uniform(&mut r, 4, 2.0);
        opt.set_learning_rate(lr);
        opt.step(&grads_for(&[(&mat, &gm), (&vec, &gv)])).unwrap();
        // The matrix decays, the 1-D parameter does not (decay_1d = false).
        ref_step(&mut wm, &mut mm, &mut vm, &gm, t, lr, &c, true);
        ref_step(&mut wv, &mut mv, &mut vv, &gv, t, lr, &c, false);
        assert_close(&flat(mat.as_tensor()), &wm, 2e-6, "matrix");
        assert_close(&flat(vec.as_tensor()), &wv, 2e-6, "vector");
    }
    assert_eq!(opt.step_count(), 3);
}

#[test]
fn bf16_parameters_accumulate_updates_in_the_f32_master() {
    // A bf16 weight of 1.0 moved by ~1e-4 per step: bf16 alone (spacing 2^-7 below 1) would
    // never move; the f32 master accumulates the steps and the variable follows it.
    let c = AdamWConfig {
        lr: 1e-4,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let w = new_var(&[1.0, -2.0], &[2], DType::BF16);
    let mut opt = AdamW::with_names(vec![("w".into(), w.clone())], c.clone()).unwrap();
    let (mut rw, mut rm, mut rv) = (vec![1.0, -2.0], vec![0.0; 2], vec![0.0; 2]);
    for t in 1..=200 {
        let g = [0.5, -0.25];
        opt.step(&grads_for(&[(&w, &g)])).unwrap();
        ref_step(&mut rw, &mut rm, &mut rv, &g, t, c.lr, &c, false);
    }
    let st = opt.state_dict().unwrap();
    let master = flat(&st.tensors["w.master"]);
    // 200 f32 roundings of a value near 1 (half-ulp 3e-8 each) bound the drift by ~6e-6.
    assert_close(&master, &rw, 1e-5, "master");
    let want_bf16: Vec<f64> = master
        .iter()
        .map(|&x| half::bf16::from_f32(x as f32).to_f64())
        .collect();
    assert_eq!(flat(w.as_tensor()), want_bf16);
    assert!(flat(w.as_tensor())[0] < 1.0);
}

fn run(opt: &mut AdamW, vars: &[Var], steps: std::ops::Range<u64>) {
    for s in steps {
        let mut r = rng(100 + s);
        let pairs: Vec<(Var, Vec<f64>)> = vars
            .iter()
            .map(|v| (v.clone(), uniform(&mut r, v.elem_count(), 1.0)))
            .collect();
        let refs: Vec<(&Var, &[f64])> = pairs.iter().map(|(v, g)| (v, g.as_slice())).collect();
        opt.set_learning_rate(1e-2 / (1.0 + s as f64));
        opt.step(&grads_for(&refs)).unwrap();
    }
}

fn bits(v: &Var) -> Vec<u32> {
    v.as_tensor()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn resume_from_state_dict_is_bit_identical() {
    let mut r = rng(41);
    let init_a = uniform(&mut r, 12, 1.0);
    let init_b = uniform(&mut r, 5, 1.0);
    let make = || {
        vec![
            new_var(&init_a, &[3, 4], DType::BF16),
            new_var(&init_b, &[5], DType::F32),
        ]
    };
    let named = |vs: &[Var]| {
        vec![
            ("a".to_string(), vs[0].clone()),
            ("b".to_string(), vs[1].clone()),
        ]
    };
    let c = AdamWConfig::default();

    // Straight run: 5 steps.
    let straight = make();
    let mut opt = AdamW::with_names(named(&straight), c.clone()).unwrap();
    run(&mut opt, &straight, 0..5);

    // Interrupted run: 2 steps, "checkpoint" (weights + state), fresh process, 3 more steps.
    let first = make();
    let mut opt = AdamW::with_names(named(&first), c.clone()).unwrap();
    run(&mut opt, &first, 0..2);
    let state = opt.state_dict().unwrap();
    let saved: Vec<Tensor> = first
        .iter()
        .map(|v| v.as_tensor().copy().unwrap())
        .collect();
    let resumed: Vec<Var> = saved.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let mut opt = AdamW::with_names(named(&resumed), c).unwrap();
    opt.load_state_dict(&state).unwrap();
    assert_eq!(opt.step_count(), 2);
    run(&mut opt, &resumed, 2..5);

    for (a, b) in straight.iter().zip(&resumed) {
        assert_eq!(bits(a), bits(b));
    }
}

#[test]
fn load_state_dict_rejects_a_mismatched_state() {
    let w = new_var(&[1.0, 2.0], &[2], DType::F32);
    let mut opt = AdamW::with_names(vec![("w".into(), w.clone())], AdamWConfig::default()).unwrap();
    let good = opt.state_dict().unwrap();
    let mut missing = good.clone();
    missing.tensors.remove("w.exp_avg");
    assert!(opt.load_state_dict(&missing).is_err());
    let mut shaped = good.clone();
    shaped.tensors.insert(
        "w.exp_avg".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(opt.load_state_dict(&shaped).is_err());
    let mut extra = good.clone();
    extra.tensors.insert(
        "x.exp_avg".into(),
        Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(opt.load_state_dict(&extra).is_err());
    opt.load_state_dict(&good).unwrap();
}

#[test]
fn variables_without_a_gradient_are_left_alone() {
    let a = new_var(&[1.0, 2.0], &[2], DType::F32);
    let b = new_var(&[3.0], &[1], DType::F32);
    let mut opt = AdamW::with_names(
        vec![("a".into(), a.clone()), ("b".into(), b.clone())],
        AdamWConfig::default(),
    )
    .unwrap();
    opt.step(&grads_for(&[(&a, &[1.0, 1.0])])).unwrap();
    assert_eq!(flat(b.as_tensor()), vec![3.0]);
    assert!(flat(a.as_tensor())[0] < 1.0);
}

#[test]
fn from_varmap_names_the_parameters() {
    let vm = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let _ = vb
        .get_with_hints(3, "z.bias", candle_nn::Init::Const(0.0))
        .unwrap();
    let _ = vb
        .get_with_hints((2, 2), "a.weight", candle_nn::Init::Const(1.0))
        .unwrap();
    let opt = AdamW::from_varmap(&vm, AdamWConfig::default()).unwrap();
    let mut keys: Vec<String> = opt.state_dict().unwrap().tensors.into_keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "a.weight.exp_avg",
            "a.weight.exp_avg_sq",
            "z.bias.exp_avg",
            "z.bias.exp_avg_sq"
        ]
    );
}

/// A clipped step (`step_clipped`) scales the gradients exactly as `clip_to` does before a
/// plain step: the same weights bit for bit, with and without a factor.
#[test]
fn clipped_step_equals_clip_then_step() {
    let mut r = rng(77);
    let shapes: [&[usize]; 2] = [&[3, 5], &[7]];
    let data: Vec<Vec<f64>> = shapes
        .iter()
        .map(|s| uniform(&mut r, s.iter().product(), 1.0))
        .collect();
    let grads_data: Vec<Vec<f64>> = shapes
        .iter()
        .map(|s| uniform(&mut r, s.iter().product(), 2.0))
        .collect();
    for clip in [None, Some(0.37)] {
        let run = |clipped: bool| -> Vec<Vec<f64>> {
            let vars: Vec<Var> = shapes
                .iter()
                .zip(&data)
                .map(|(s, d)| new_var(d, s, DType::F32))
                .collect();
            let named = vars
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("p{i}"), v.clone()))
                .collect();
            let mut opt = AdamW::with_names(named, AdamWConfig::default()).unwrap();
            for _ in 0..2 {
                let pairs: Vec<(&Var, &[f64])> = vars
                    .iter()
                    .zip(&grads_data)
                    .map(|(v, g)| (v, g.as_slice()))
                    .collect();
                let mut g = grads_for(&pairs);
                if clipped {
                    opt.step_clipped(&mut g, clip).unwrap();
                } else {
                    if let Some(s) = clip {
                        // clip_to's factor for a norm that gives `s`.
                        let max = 1.0;
                        let norm = max / s - 1e-6;
                        crate::optim::clip_to(&mut g, &vars, norm, max).unwrap();
                    }
                    opt.step(&g).unwrap();
                }
            }
            vars.iter().map(|v| flat(v.as_tensor())).collect()
        };
        assert_eq!(run(true), run(false), "clip {clip:?}");
    }
}
