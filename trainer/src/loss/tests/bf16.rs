//! Every loss takes bf16 student logits (the GPU student's compute dtype): the value equals the
//! f32 loss of the same (bf16-rounded) logits, since losses compute in f32, and the gradient
//! comes back in bf16 to the logits.

use candle_core::{DType, Device, Tensor, Var};

use crate::loss::testutil::*;
use crate::loss::xtoken::tests::{fixture, projection_with_first, B as XB, TS, VL};
use crate::loss::*;

/// Rounds through bf16 (what the bf16 logits hold).
fn bf16_round(z: &[f64]) -> Vec<f64> {
    z.iter()
        .map(|&x| half::bf16::from_f64(x).to_f64())
        .collect()
}

/// The loss on f32 logits holding the bf16-rounded values vs on bf16 logits; gradient dtype.
fn check(what: &str, zs: &[f64], shape: &[usize], f: impl Fn(&Tensor) -> Tensor) {
    let rounded = bf16_round(zs);
    let want = scalar(&f(&tensor(&rounded, shape, DType::F32)));
    let v = Var::from_tensor(&tensor(zs, shape, DType::BF16)).unwrap();
    let loss = f(v.as_tensor());
    assert_eq!(loss.dtype(), DType::F32, "{what}: loss dtype");
    let got = scalar(&loss);
    assert!(
        want.is_finite() && (got - want).abs() <= 1e-5 * want.abs().max(1e-2),
        "{what}: bf16 {got} vs f32 {want}"
    );
    let g = loss.backward().unwrap();
    let g = g.get(v.as_tensor()).expect("gradient");
    assert_eq!(g.dtype(), DType::BF16, "{what}: gradient dtype");
    let g = flat(g);
    assert!(
        g.iter().all(|x| x.is_finite()) && g.iter().any(|&x| x != 0.0),
        "{what}: gradient"
    );
}

fn config(kd: KdConfig) -> LossConfig {
    LossConfig {
        kd,
        tail: Some(TailMode::Bucket),
        temperature: temperature(1.5),
        kd_weight: 1.0,
        ce: CeConfig::None {},
    }
}

#[test]
fn every_loss_runs_on_bf16_logits() {
    let (b, t, v, k) = (2usize, 4usize, 11usize, 3usize);
    let mut r = rng(21);
    let zs = uniform(&mut r, b * t * v, 3.0);
    // Same-tokenizer inputs: the teacher's top-k of its own random logits.
    let zt = uniform(&mut r, b * t * v, 3.0);
    let (mut ids, mut lps) = (vec![], vec![]);
    for p in 0..b * t {
        let lp = log_softmax(&zt[p * v..(p + 1) * v]);
        for i in topk(&lp, k) {
            ids.push(i as u32);
            lps.push(lp[i] as f32);
        }
    }
    let mut mask = vec![1f32; b * t];
    mask[t - 1] = 0.0;
    let tk = TopkTargets::from_host(b, t, k, &ids, &lps, &mask, v, &Device::Cpu).unwrap();
    let shape = [b, t, v];
    for kd in [
        KdConfig::ForwardKl {},
        KdConfig::ReverseKl {},
        KdConfig::Jsd { beta: 0.3 },
    ] {
        let cfg = config(kd.clone());
        check(&format!("{kd:?}"), &zs, &shape, |l| {
            kd_loss(&cfg, l, KdInputs::Topk(&tk), None).unwrap().0
        });
    }
    // Cross-entropy on the same logits.
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 5 % v) as u32).collect();
    let tg = Tensor::from_vec(targets.clone(), (b, t), &Device::Cpu).unwrap();
    let m = Tensor::from_vec(mask.clone(), (b, t), &Device::Cpu).unwrap();
    check("cross_entropy", &zs, &shape, |l| {
        cross_entropy(l, &tg, &m, None).unwrap().0
    });
    // On-policy sampled-token loss.
    let st = SampledTargets {
        tokens: tg.clone(),
        teacher_logprobs: Tensor::from_vec(
            (0..b * t)
                .map(|i| -0.5 - 0.1 * i as f32)
                .collect::<Vec<_>>(),
            (b, t),
            &Device::Cpu,
        )
        .unwrap(),
        old_logprobs: None,
        mask: m.clone(),
    };
    let cfg = config(KdConfig::SampledKl {});
    check("SampledKl", &zs, &shape, |l| {
        kd_loss(&cfg, l, KdInputs::Sampled(&st), None).unwrap().0
    });
    // Cross-tokenizer losses on the hand-made aligned batch.
    let (x, zx) = fixture(4, 1.5);
    let p = projection_with_first();
    for kd in [
        KdConfig::Pkl {
            anchor: Anchor::First,
        },
        KdConfig::FirstKl {},
        KdConfig::Gold {
            matched_weight: 1.0,
            unmatched_weight: 0.5,
        },
        KdConfig::Alm { tau: 100.0 },
    ] {
        let cfg = config(kd.clone());
        check(&format!("{kd:?}"), &zx, &[XB, TS, VL], |l| {
            kd_loss(
                &cfg,
                l,
                KdInputs::XToken {
                    batch: &x,
                    projection: &p,
                },
                None,
            )
            .unwrap()
            .0
        });
    }
}
