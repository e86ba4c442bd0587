//! Tests of the top-k divergences against an f64 loop reference and finite differences.

use candle_core::{DType, Device, Tensor, Var};

use super::*;
use crate::loss::testutil::*;
use crate::loss::KdFigures;

const B: usize = 2;
const T: usize = 3;
const V: usize = 11;
const K: usize = 4;

/// Random student logits, teacher top-k (ids, log-probs at τ) and a mask with one hole.
struct Case {
    zs: Vec<f64>,
    ids: Vec<u32>,
    lpt: Vec<f64>,
    mask: Vec<f64>,
}

fn case(seed: u64, tau: f64) -> Case {
    let mut r = rng(seed);
    let zs = uniform(&mut r, B * T * V, 3.0);
    let zt = uniform(&mut r, B * T * V, 3.0);
    let mut ids = vec![];
    let mut lpt = vec![];
    for p in 0..B * T {
        let row: Vec<f64> = zt[p * V..(p + 1) * V].iter().map(|z| z / tau).collect();
        let lp = log_softmax(&row);
        for i in topk(&lp, K) {
            ids.push(i as u32);
            lpt.push(lp[i]);
        }
    }
    let mut mask = vec![1.0; B * T];
    mask[4] = 0.0;
    Case { zs, ids, lpt, mask }
}

fn targets(c: &Case, dtype: DType) -> TopkTargets {
    let lpt: Vec<f32> = c.lpt.iter().map(|&x| x as f32).collect();
    let mask: Vec<f32> = c.mask.iter().map(|&x| x as f32).collect();
    let mut t = TopkTargets::from_host(B, T, K, &c.ids, &lpt, &mask, V, &Device::Cpu).unwrap();
    if dtype == DType::F64 {
        // Full-precision teacher values for the f64 checks.
        t.logprobs = tensor(&c.lpt, &[B, T, K], DType::F64);
    }
    t
}

/// The reference: per position, the n-way distributions written out, the divergence as a loop.
fn reference(
    c: &Case,
    zs: &[f64],
    div: Divergence,
    tail: TailMode,
    tau: f64,
    norm: Option<f64>,
) -> f64 {
    let mut total = 0.0;
    for p in 0..B * T {
        if c.mask[p] == 0.0 {
            continue;
        }
        let z: Vec<f64> = zs[p * V..(p + 1) * V].iter().map(|z| z / tau).collect();
        let ls = log_softmax(&z);
        let ids = &c.ids[p * K..(p + 1) * K];
        let mut pt: Vec<f64> = c.lpt[p * K..(p + 1) * K].iter().map(|x| x.exp()).collect();
        let mut ps: Vec<f64> = ids.iter().map(|&i| ls[i as usize].exp()).collect();
        let (st, ss): (f64, f64) = (pt.iter().sum(), ps.iter().sum());
        match tail {
            TailMode::Renormalize => {
                pt.iter_mut().for_each(|x| *x /= st);
                ps.iter_mut().for_each(|x| *x /= ss);
            }
            TailMode::Bucket => {
                pt.push(1.0 - st);
                ps.push(1.0 - ss);
            }
            TailMode::Ignore => {}
        }
        let kl = |a: &[f64], b: &[f64]| -> f64 {
            a.iter().zip(b).map(|(x, y)| x * (x.ln() - y.ln())).sum()
        };
        total += match div {
            Divergence::Forward => kl(&pt, &ps),
            Divergence::Reverse => kl(&ps, &pt),
            Divergence::Jsd { beta } => {
                let m: Vec<f64> = pt
                    .iter()
                    .zip(&ps)
                    .map(|(a, b)| beta * a + (1.0 - beta) * b)
                    .collect();
                beta * kl(&pt, &m) + (1.0 - beta) * kl(&ps, &m)
            }
            Divergence::TotalVariation => {
                0.5 * pt.iter().zip(&ps).map(|(a, b)| (a - b).abs()).sum::<f64>()
            }
        };
    }
    let n = norm.unwrap_or(c.mask.iter().sum());
    tau * tau * total / n
}

const DIVS: [Divergence; 5] = [
    Divergence::Forward,
    Divergence::Reverse,
    Divergence::Jsd { beta: 0.5 },
    Divergence::Jsd { beta: 0.1 },
    Divergence::TotalVariation,
];
const TAILS: [TailMode; 3] = [TailMode::Renormalize, TailMode::Bucket, TailMode::Ignore];

#[test]
fn matches_f64_reference_every_divergence_and_tail() {
    for (seed, tau) in [(1, 1.0), (2, 2.0), (3, 0.7)] {
        let c = case(seed, tau);
        for div in DIVS {
            for tail in TAILS {
                let want = reference(&c, &c.zs, div, tail, tau, None);
                for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
                    let logits = tensor(&c.zs, &[B, T, V], dtype);
                    let (loss, m) = topk_divergence(
                        &logits,
                        &targets(&c, dtype),
                        div,
                        tail,
                        temperature(tau),
                        None,
                    )
                    .unwrap();
                    let got = scalar(&loss);
                    assert!(
                        (got - want).abs() <= tol * want.abs().max(1e-3),
                        "{div:?} {tail:?} {dtype:?} τ={tau}: got {got}, want {want}"
                    );
                    assert_eq!(m.count, 5.0);
                    assert!((m.loss - got).abs() < 1e-12);
                }
            }
        }
    }
}

#[test]
fn metrics_report_top_k_masses() {
    let c = case(4, 1.0);
    let (_, m) = topk_divergence(
        &tensor(&c.zs, &[B, T, V], DType::F64),
        &targets(&c, DType::F64),
        Divergence::Forward,
        TailMode::Renormalize,
        Temperature::ONE,
        None,
    )
    .unwrap();
    let (mut mt, mut ms) = (0.0, 0.0);
    for p in (0..B * T).filter(|&p| c.mask[p] == 1.0) {
        let ls = log_softmax(&c.zs[p * V..(p + 1) * V]);
        mt += c.lpt[p * K..(p + 1) * K]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            / 5.0;
        ms += c.ids[p * K..(p + 1) * K]
            .iter()
            .map(|&i| ls[i as usize].exp())
            .sum::<f64>()
            / 5.0;
    }
    assert!((m.teacher_topk_mass.unwrap() - mt).abs() < 1e-12);
    assert!((m.student_topk_mass.unwrap() - ms).abs() < 1e-12);
}

#[test]
fn gradients_match_finite_differences_of_the_reference() {
    let tau = 1.5;
    let c = case(5, tau);
    for div in DIVS {
        for tail in TAILS {
            let x = var(&c.zs, &[B, T, V]);
            let (loss, _) = topk_divergence(
                x.as_tensor(),
                &targets(&c, DType::F64),
                div,
                tail,
                temperature(tau),
                None,
            )
            .unwrap();
            let g = flat(loss.backward().unwrap().get(x.as_tensor()).unwrap());
            let want = numeric_grad(&c.zs, 1e-5, |z| reference(&c, z, div, tail, tau, None));
            assert_close(&g, &want, 1e-7, &format!("grad {div:?} {tail:?}"));
        }
    }
}

#[test]
fn identical_distributions_give_zero() {
    // Teacher = student: the teacher values are the student's own log-probs at its top-k.
    let tau = 2.0;
    let mut c = case(6, tau);
    for p in 0..B * T {
        let z: Vec<f64> = c.zs[p * V..(p + 1) * V].iter().map(|z| z / tau).collect();
        let ls = log_softmax(&z);
        for (j, i) in topk(&ls, K).into_iter().enumerate() {
            c.ids[p * K + j] = i as u32;
            c.lpt[p * K + j] = ls[i];
        }
    }
    for div in DIVS {
        for tail in TAILS {
            let (loss, _) = topk_divergence(
                &tensor(&c.zs, &[B, T, V], DType::F64),
                &targets(&c, DType::F64),
                div,
                tail,
                temperature(tau),
                None,
            )
            .unwrap();
            assert!(scalar(&loss).abs() < 1e-12, "{div:?} {tail:?}");
        }
    }
}

#[test]
fn jsd_limits_follow_the_trl_convention() {
    let c = case(7, 1.0);
    let logits = tensor(&c.zs, &[B, T, V], DType::F64);
    let tg = targets(&c, DType::F64);
    let run = |div| {
        scalar(
            &topk_divergence(&logits, &tg, div, TailMode::Bucket, Temperature::ONE, None)
                .unwrap()
                .0,
        )
    };
    let fwd = run(Divergence::Forward);
    let rev = run(Divergence::Reverse);
    assert_eq!(run(Divergence::Jsd { beta: 0.0 }), fwd);
    assert_eq!(run(Divergence::Jsd { beta: 1.0 }), rev);
    // Near the ends the mixture form is β·KL(T‖S) + O(β²) and (1−β)·KL(S‖T) + O((1−β)²).
    let b = 1e-5;
    let near0 = run(Divergence::Jsd { beta: b }) / b;
    let near1 = run(Divergence::Jsd { beta: 1.0 - b }) / b;
    assert!((near0 - fwd).abs() < 1e-3 * fwd, "{near0} vs {fwd}");
    assert!((near1 - rev).abs() < 1e-3 * rev, "{near1} vs {rev}");
}

#[test]
fn masked_positions_do_not_contribute() {
    let c = case(8, 1.0);
    let mut zs2 = c.zs.clone();
    for z in &mut zs2[4 * V..5 * V] {
        *z = *z * 50.0 + 7.0; // position 4 is masked
    }
    for tail in TAILS {
        let x = var(&zs2, &[B, T, V]);
        let (l2, _) = topk_divergence(
            x.as_tensor(),
            &targets(&c, DType::F64),
            Divergence::Forward,
            tail,
            Temperature::ONE,
            None,
        )
        .unwrap();
        let l1 = reference(&c, &c.zs, Divergence::Forward, tail, 1.0, None);
        assert!((scalar(&l2) - l1).abs() < 1e-12);
        let g = flat(l2.backward().unwrap().get(x.as_tensor()).unwrap());
        assert!(g[4 * V..5 * V].iter().all(|&v| v == 0.0));
        assert!(g[..4 * V].iter().any(|&v| v != 0.0));
    }
}

#[test]
fn temperature_scales_by_tau_squared() {
    // Same inputs, τ = 3: the result is 9 × the unscaled mean divergence of the tempered logits.
    let c = case(9, 3.0);
    let (loss, _) = topk_divergence(
        &tensor(&c.zs, &[B, T, V], DType::F64),
        &targets(&c, DType::F64),
        Divergence::Forward,
        TailMode::Bucket,
        temperature(3.0),
        None,
    )
    .unwrap();
    let scaled: Vec<f64> = c.zs.iter().map(|z| z / 3.0).collect();
    let unscaled = reference(
        &c,
        &scaled,
        Divergence::Forward,
        TailMode::Bucket,
        1.0,
        None,
    );
    assert!((scalar(&loss) - 9.0 * unscaled).abs() < 1e-10);
}

#[test]
fn micro_batches_with_global_normalizer_sum_to_the_full_batch() {
    let c = case(10, 1.0);
    let full = reference(
        &c,
        &c.zs,
        Divergence::Jsd { beta: 0.5 },
        TailMode::Bucket,
        1.0,
        None,
    );
    let tg = targets(&c, DType::F64);
    let logits = tensor(&c.zs, &[B, T, V], DType::F64);
    let mut sum = 0.0;
    for b in 0..B {
        let part = tg.batch_rows(b, 1).unwrap();
        let (l, _) = topk_divergence(
            &logits.narrow(0, b, 1).unwrap(),
            &part,
            Divergence::Jsd { beta: 0.5 },
            TailMode::Bucket,
            Temperature::ONE,
            Some(normalizer(5.0)),
        )
        .unwrap();
        sum += scalar(&l);
    }
    assert!((sum - full).abs() < 1e-12, "{sum} vs {full}");
}

#[test]
fn from_host_rejects_bad_input_and_sanitises_masked_rows() {
    let c = case(11, 1.0);
    let lpt: Vec<f32> = c.lpt.iter().map(|&x| x as f32).collect();
    let mask: Vec<f32> = c.mask.iter().map(|&x| x as f32).collect();
    let d = Device::Cpu;
    let mut ids = c.ids.clone();
    ids[0] = V as u32;
    assert!(TopkTargets::from_host(B, T, K, &ids, &lpt, &mask, V, &d).is_err());
    let mut bad = lpt.clone();
    bad[1] = f32::NAN;
    assert!(TopkTargets::from_host(B, T, K, &c.ids, &bad, &mask, V, &d).is_err());
    assert!(TopkTargets::from_host(B, T, K, &c.ids, &lpt[1..], &mask, V, &d).is_err());
    // Garbage on the masked position 4 is accepted and replaced.
    let mut ids = c.ids.clone();
    ids[4 * K] = u32::MAX;
    let mut lp = lpt.clone();
    lp[4 * K] = f32::NAN;
    lp[0] = f32::NEG_INFINITY;
    let t = TopkTargets::from_host(B, T, K, &ids, &lp, &mask, V, &d).unwrap();
    let (loss, _) = topk_divergence(
        &Tensor::zeros((B, T, V), DType::F32, &d).unwrap(),
        &t,
        Divergence::Reverse,
        TailMode::Bucket,
        Temperature::ONE,
        None,
    )
    .unwrap();
    assert!(scalar(&loss).is_finite());
}

#[test]
fn shape_mismatch_is_an_error() {
    let c = case(12, 1.0);
    let logits = tensor(&c.zs[..V * T], &[1, T, V], DType::F32);
    let r = topk_divergence(
        &logits,
        &targets(&c, DType::F32),
        Divergence::Forward,
        TailMode::Bucket,
        Temperature::ONE,
        None,
    );
    assert!(matches!(r, Err(LossError::Input { .. })));
}

#[test]
fn bf16_logits_are_computed_in_f32() {
    // The reference sees the bf16-rounded logits; the loss itself runs in f32.
    let c = case(13, 1.0);
    let rounded: Vec<f64> =
        c.zs.iter()
            .map(|&z| half::bf16::from_f64(z).to_f64())
            .collect();
    for tail in TAILS {
        let want = reference(&c, &rounded, Divergence::Reverse, tail, 1.0, None);
        let logits = tensor(&c.zs, &[B, T, V], DType::BF16);
        let v = candle_core::Var::from_tensor(&logits).unwrap();
        let (loss, _) = topk_divergence(
            v.as_tensor(),
            &targets(&c, DType::F32),
            Divergence::Reverse,
            tail,
            Temperature::ONE,
            None,
        )
        .unwrap();
        assert_eq!(loss.dtype(), DType::F32);
        assert!((scalar(&loss) - want).abs() < 2e-5 * want.abs().max(1e-3));
        let g = loss.backward().unwrap();
        assert_eq!(g.get(v.as_tensor()).unwrap().dtype(), DType::BF16);
    }
}

/// The fused per-row loss (what CUDA runs with the project's kernels on; here its f64 CPU
/// reference) gives the composed loss's value, metrics and gradient: every divergence and tail,
/// three temperatures, a normalizer, f64 (to 1e-12) and f32 logits (to 1e-5), and the f64
/// reference loop.
#[test]
fn fused_loss_equals_the_composed_loss() {
    for (seed, tau) in [(1, 1.0), (2, 2.0), (3, 0.7)] {
        let c = case(seed, tau);
        for div in DIVS {
            for tail in TAILS {
                for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                    let tg = targets(&c, dtype);
                    assert!(tg.distinct);
                    let run = |fused: bool| {
                        let x = Var::from_tensor(&tensor(&c.zs, &[B, T, V], dtype)).unwrap();
                        let f = if fused {
                            fused_topk_divergence
                        } else {
                            topk_divergence_figures
                        };
                        let norm = Some(normalizer(7.0));
                        let (l, m) =
                            f(x.as_tensor(), &tg, div, tail, temperature(tau), norm).unwrap();
                        // Both leave their figures on the device (the composed one since
                        // 2026-11-30): nothing read back per call.
                        assert!(matches!(m, KdFigures::Pending { .. }), "fused {fused}");
                        let m = m.read().unwrap();
                        let g = l.backward().unwrap();
                        (scalar(&l), m, flat(g.get(x.as_tensor()).unwrap()))
                    };
                    let ((l1, m1, g1), (l0, m0, g0)) = (run(true), run(false));
                    let what = format!("{div:?} {tail:?} τ {tau} {dtype:?}");
                    assert_close(&[l1], &[l0], tol, &format!("{what}: loss"));
                    assert_close(&[m1.loss], &[m0.loss], tol, &format!("{what}: metric loss"));
                    assert_eq!(m1.count, m0.count, "{what}: count");
                    let masses = |m: &KdMetrics| {
                        vec![m.teacher_topk_mass.unwrap(), m.student_topk_mass.unwrap()]
                    };
                    assert_close(&masses(&m1), &masses(&m0), tol, &format!("{what}: masses"));
                    assert_close(&g1, &g0, tol, &format!("{what}: gradient"));
                    if dtype == DType::F64 {
                        let want = reference(&c, &c.zs, div, tail, tau, Some(7.0));
                        assert_close(&[l1], &[want], 1e-12, &format!("{what}: reference"));
                    }
                }
            }
        }
    }
}

/// The fused loss reads bf16 logits in place (no f32 copy) and stays within bf16's rounding of
/// the composed f32 loss on the same values; repeated ids leave the composed loss in charge.
#[test]
fn fused_loss_on_bf16_logits_and_repeated_ids() {
    let c = case(4, 1.0);
    let tg = targets(&c, DType::F32);
    let x16 = tensor(&c.zs, &[B, T, V], DType::BF16);
    let x32 = x16.to_dtype(DType::F32).unwrap();
    for div in DIVS {
        let run = |x: &Tensor| {
            let v = Var::from_tensor(x).unwrap();
            let f = if x.dtype() == DType::BF16 {
                fused_topk_divergence
            } else {
                topk_divergence_figures
            };
            let (l, _) = f(
                v.as_tensor(),
                &tg,
                div,
                TailMode::Bucket,
                temperature(1.0),
                None,
            )
            .unwrap();
            let g = l.backward().unwrap();
            let g = g.get(v.as_tensor()).unwrap().clone();
            assert_eq!(g.dtype(), x.dtype());
            (scalar(&l), flat(&g))
        };
        let ((l1, g1), (l0, g0)) = (run(&x16), run(&x32));
        assert_close(&[l1], &[l0], 1e-5, &format!("{div:?}: loss"));
        // Each gradient entry rounded once to bf16 (2^-9 relative), small ones absolutely.
        for (a, b) in g1.iter().zip(&g0) {
            assert!(
                (a - b).abs() <= 4e-3 * b.abs() + 1e-6,
                "{div:?}: {a} vs {b}"
            );
        }
    }
    let mut ids = c.ids.clone();
    ids[1] = ids[0];
    let lpt: Vec<f32> = c.lpt.iter().map(|&x| x as f32).collect();
    let mask: Vec<f32> = c.mask.iter().map(|&x| x as f32).collect();
    let tg = TopkTargets::from_host(B, T, K, &ids, &lpt, &mask, V, &Device::Cpu).unwrap();
    assert!(!tg.distinct, "a repeated id is noticed");
}

/// `distinct` is per position: ids shared between positions are fine, a repeat within one
/// valid position is not, and a masked position's ids are never read.
#[test]
fn distinct_ids_are_checked_per_valid_position() {
    let distinct = |ids: &[u32], mask: &[f32]| {
        let lps = vec![-1.0f32; ids.len()];
        TopkTargets::from_host(1, 3, 2, ids, &lps, mask, V, &Device::Cpu)
            .unwrap()
            .distinct
    };
    let every = [1.0, 1.0, 1.0];
    assert!(distinct(&[1, 2, 2, 1, 1, 2], &every));
    assert!(!distinct(&[1, 2, 3, 4, 5, 5], &every));
    assert!(!distinct(&[7, 7, 3, 4, 5, 6], &every));
    assert!(distinct(&[1, 2, 3, 3, 5, 6], &[1.0, 0.0, 1.0]));
    // An id past the vocabulary is an error, distinct or not.
    let lps = vec![-1.0f32; 6];
    let err = TopkTargets::from_host(1, 3, 2, &[1, 2, 3, 11, 4, 5], &lps, &every, V, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("id 11 >= vocab 11"), "{err}");
}
