//! Tests of the full-vocabulary losses against an f64 loop reference (the teacher's logits
//! computed directly from hidden states and head), finite differences, candle's autograd through
//! the top-k path with K = the whole vocabulary, and the full-logit variant.

use candle_core::{DType, Device, Tensor, Var};
use sha2::{Digest, Sha256};

use super::*;
use crate::loss::kl::{topk_divergence, TopkTargets};
use crate::loss::testutil::*;
use crate::loss::{KdFigures, TailMode};

/// Random hidden states, head and student logits, all in f64 (row-major).
struct Case {
    n: usize,
    h: usize,
    rows: usize,
    vocab: usize,
    hid: Vec<f64>,
    w: Vec<f64>,
    b: Option<Vec<f64>>,
    scale: f64,
    cap: Option<f64>,
    zs: Vec<f64>,
    mask: Vec<f64>,
}

#[allow(clippy::too_many_arguments)]
fn case(
    seed: u64,
    n: usize,
    h: usize,
    rows: usize,
    vocab: usize,
    bias: bool,
    scale: f64,
    cap: Option<f64>,
    masked: &[usize],
) -> Case {
    let mut r = rng(seed);
    let hid = uniform(&mut r, n * h, 1.0);
    let mut w = uniform(&mut r, rows * h, 1.0);
    // Padded rows get large weights: forgetting to mask them would move the result a lot.
    for x in &mut w[vocab * h..] {
        *x *= 6.0;
    }
    let b = bias.then(|| uniform(&mut r, rows, 1.0));
    let zs = uniform(&mut r, n * vocab, 3.0);
    let mut mask = vec![1.0; n];
    for &p in masked {
        mask[p] = 0.0;
    }
    Case {
        n,
        h,
        rows,
        vocab,
        hid,
        w,
        b,
        scale,
        cap,
        zs,
        mask,
    }
}

/// The two head configurations the tests run: everything on (padding, bias, scale, a soft-cap
/// that binds, masked rows) and everything off.
fn cases() -> Vec<Case> {
    vec![
        case(11, 7, 6, 13, 11, true, 1.7, Some(2.5), &[2, 5]),
        case(12, 5, 4, 9, 9, false, 1.0, None, &[]),
    ]
}

/// Reference teacher log-probs at position `p`: logits over all `rows` computed by loops, padded
/// rows set to −∞, log-softmax over all rows, the first `vocab` returned.
fn ref_teacher_lp(c: &Case, p: usize, tau: f64) -> Vec<f64> {
    let z: Vec<f64> = (0..c.rows)
        .map(|j| {
            if j >= c.vocab {
                return f64::NEG_INFINITY;
            }
            let mut acc = c.b.as_ref().map_or(0.0, |b| b[j]);
            for k in 0..c.h {
                acc += c.hid[p * c.h + k] * c.w[j * c.h + k];
            }
            let mut z = c.scale * acc;
            if let Some(cap) = c.cap {
                z = cap * (z / cap).tanh();
            }
            z / tau
        })
        .collect();
    let lp = log_softmax(&z);
    lp[..c.vocab].to_vec()
}

/// Reference loss: per valid position, both distributions as plain vectors, the divergence by a
/// loop (JSD through the mixture in probability space; β = 0 / 1 are the KLs, TRL convention).
fn ref_loss(c: &Case, zs: &[f64], div: Divergence, tau: f64, norm: Option<f64>) -> f64 {
    let v = c.vocab;
    let kl = |a: &[f64], b: &[f64]| -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| {
                if *x == 0.0 {
                    0.0
                } else {
                    x * (x.ln() - y.ln())
                }
            })
            .sum()
    };
    let mut total = 0.0;
    for p in 0..c.n {
        if c.mask[p] == 0.0 {
            continue;
        }
        let pt: Vec<f64> = ref_teacher_lp(c, p, tau).iter().map(|x| x.exp()).collect();
        let zrow: Vec<f64> = zs[p * v..(p + 1) * v].iter().map(|z| z / tau).collect();
        let ps: Vec<f64> = log_softmax(&zrow).iter().map(|x| x.exp()).collect();
        total += match div {
            Divergence::Forward => kl(&pt, &ps),
            Divergence::Reverse => kl(&ps, &pt),
            Divergence::Jsd { beta: 0.0 } => kl(&pt, &ps),
            Divergence::Jsd { beta: 1.0 } => kl(&ps, &pt),
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

const DIVS: [Divergence; 8] = [
    Divergence::Forward,
    Divergence::Reverse,
    Divergence::Jsd { beta: 0.0 },
    Divergence::Jsd { beta: 0.1 },
    Divergence::Jsd { beta: 0.5 },
    Divergence::Jsd { beta: 0.9 },
    Divergence::Jsd { beta: 1.0 },
    Divergence::TotalVariation,
];

/// The head in `dtype`.
fn head(c: &Case, dtype: DType) -> TeacherHead {
    TeacherHead::new(
        tensor(&c.w, &[c.rows, c.h], dtype),
        c.b.as_ref().map(|b| tensor(b, &[c.rows], dtype)),
        c.scale,
        c.cap,
        c.vocab,
    )
    .unwrap()
}

/// `data` with every masked position's row replaced by NaN ("padding may hold anything").
fn poison(c: &Case, data: &[f64], width: usize) -> Vec<f64> {
    let mut d = data.to_vec();
    for p in 0..c.n {
        if c.mask[p] == 0.0 {
            d[p * width..(p + 1) * width].fill(f64::NAN);
        }
    }
    d
}

fn mask_t(c: &Case) -> Tensor {
    tensor(&c.mask, &[c.n], DType::F32)
}

/// Relative check `|a − b| ≤ tol·|b|`.
fn assert_rel(got: f64, want: f64, tol: f64, what: &str) {
    assert!(
        (got - want).abs() <= tol * want.abs(),
        "{what}: got {got}, want {want} (rel {:.2e}, tol {tol:.0e})",
        ((got - want) / want).abs()
    );
}

#[test]
fn teacher_log_probs_match_the_direct_f64_computation() {
    for c in cases() {
        for tau in [1.0, 0.7, 2.0] {
            let want: Vec<f64> = (0..c.n).flat_map(|p| ref_teacher_lp(&c, p, tau)).collect();
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                let hid = tensor(&c.hid, &[c.n, c.h], dtype);
                let lp =
                    teacher_log_softmax_chunk(&head(&c, dtype), &hid, temperature(tau)).unwrap();
                assert_eq!(lp.dims(), [c.n, c.vocab]);
                assert_eq!(
                    lp.dtype(),
                    if dtype == DType::F64 {
                        DType::F64
                    } else {
                        DType::F32
                    }
                );
                assert_close(&flat(&lp), &want, tol, &format!("{dtype:?} tau={tau}"));
            }
        }
    }
}

/// One token's log-prob per position equals the f64 loop reference's entry for every chunk
/// size (1, 2 and one chunk for all), τ and dtype; ids past the teacher's vocabulary, wrong
/// shapes and a zero chunk are typed errors; no positions is an empty answer.
#[test]
fn token_log_probs_match_the_reference_entry() {
    for c in cases() {
        let targets: Vec<u32> = (0..c.n).map(|p| ((p * 7 + 3) % c.vocab) as u32).collect();
        let tg = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        for tau in [1.0, 0.7] {
            let want: Vec<f64> = (0..c.n)
                .map(|p| ref_teacher_lp(&c, p, tau)[targets[p] as usize])
                .collect();
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                let hid = tensor(&c.hid, &[c.n, c.h], dtype);
                for chunk in [1, 2, c.n] {
                    let got = teacher_token_logprobs(
                        &head(&c, dtype),
                        &hid,
                        &tg,
                        temperature(tau),
                        chunk,
                    )
                    .unwrap();
                    assert_eq!(got.dims(), [c.n]);
                    let what = format!("{dtype:?} tau={tau} chunk={chunk}");
                    assert_close(&flat(&got), &want, tol, &what);
                }
            }
        }
        let (hd, hid) = (
            head(&c, DType::F32),
            tensor(&c.hid, &[c.n, c.h], DType::F32),
        );
        let mut bad = targets.clone();
        bad[c.n - 1] = c.vocab as u32; // a padding row of the head is not a token
        let bad = Tensor::new(bad.as_slice(), &Device::Cpu).unwrap();
        let err = teacher_token_logprobs(&hd, &hid, &bad, Temperature::ONE, 2).unwrap_err();
        assert!(err.to_string().contains("outside the teacher's"), "{err}");
        let short = tg.narrow(0, 0, c.n - 1).unwrap();
        assert!(teacher_token_logprobs(&hd, &hid, &short, Temperature::ONE, 2).is_err());
        assert!(teacher_token_logprobs(&hd, &hid, &tg, Temperature::ONE, 0).is_err());
        let none = teacher_token_logprobs(
            &hd,
            &hid.narrow(0, 0, 0).unwrap(),
            &tg.narrow(0, 0, 0).unwrap(),
            Temperature::ONE,
            2,
        )
        .unwrap();
        assert_eq!(none.dims(), [0]);
    }
}

#[test]
fn matches_f64_reference_every_divergence_chunk_and_dtype() {
    for c in cases() {
        for tau in [1.0, 0.7, 2.0] {
            for div in DIVS {
                for norm in [None, Some(10.0)] {
                    let want = ref_loss(&c, &c.zs, div, tau, norm);
                    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
                        let zs = tensor(&poison(&c, &c.zs, c.vocab), &[c.n, c.vocab], dtype);
                        let hid = tensor(&poison(&c, &c.hid, c.h), &[c.n, c.h], dtype);
                        for chunk in [1, 3, c.n, c.n + 5] {
                            let (loss, m) = full_vocab_divergence(
                                &zs,
                                &head(&c, dtype),
                                &hid,
                                &mask_t(&c),
                                div,
                                temperature(tau),
                                chunk,
                                norm.map(normalizer),
                            )
                            .unwrap();
                            let m = m.read().unwrap();
                            let what = format!(
                                "{div:?} tau={tau} norm={norm:?} {dtype:?} chunk={chunk} \
                                 vocab={}",
                                c.vocab
                            );
                            assert_rel(scalar(&loss), want, tol, &what);
                            assert_eq!(m.count, c.mask.iter().sum::<f64>(), "{what}");
                            assert_rel(m.loss, want, tol, &what);
                            assert_eq!(m.teacher_topk_mass, None);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gradients_match_finite_differences_and_masked_rows_get_none() {
    for c in cases() {
        let tau = if c.cap.is_some() { 0.7 } else { 1.3 };
        let zs = poison(&c, &c.zs, c.vocab);
        let hid = tensor(&poison(&c, &c.hid, c.h), &[c.n, c.h], DType::F64);
        for div in DIVS {
            let x = var(&zs, &[c.n, c.vocab]);
            let (loss, _) = full_vocab_divergence(
                x.as_tensor(),
                &head(&c, DType::F64),
                &hid,
                &mask_t(&c),
                div,
                temperature(tau),
                3,
                None,
            )
            .unwrap();
            let g = loss.backward().unwrap();
            let got = flat(g.get(x.as_tensor()).unwrap());
            let want = numeric_grad(&c.zs, 1e-5, |z| ref_loss(&c, z, div, tau, None));
            for p in 0..c.n {
                let row = p * c.vocab..(p + 1) * c.vocab;
                if c.mask[p] == 0.0 {
                    assert!(
                        got[row].iter().all(|&x| x == 0.0),
                        "{div:?}: masked row {p}"
                    );
                } else {
                    assert_close(
                        &got[row.clone()],
                        &want[row],
                        1e-7,
                        &format!("{div:?} row {p}"),
                    );
                }
            }
        }
    }
}

/// An independent path: the existing top-k loss (candle autograd) with K = every id and the
/// teacher's full log-probs is the same divergence; value and gradient must agree.
#[test]
fn equals_the_autograd_top_k_path_with_k_equal_to_the_vocabulary() {
    let c = case(21, 6, 5, 10, 8, true, 0.9, Some(3.0), &[4]);
    let (n, v) = (c.n, c.vocab);
    for tau in [1.0, 1.6] {
        let ids: Vec<u32> = (0..n).flat_map(|_| 0..v as u32).collect();
        let lpt: Vec<f64> = (0..n).flat_map(|p| ref_teacher_lp(&c, p, tau)).collect();
        let targets = TopkTargets::new(
            Tensor::from_vec(ids, (1, n, v), &Device::Cpu).unwrap(),
            tensor(&lpt, &[1, n, v], DType::F64),
            tensor(&c.mask, &[1, n], DType::F32),
            true,
        )
        .unwrap();
        for div in DIVS {
            let x = var(&c.zs, &[1, n, v]);
            let (want, _) = topk_divergence(
                x.as_tensor(),
                &targets,
                div,
                TailMode::Ignore,
                temperature(tau),
                None,
            )
            .unwrap();
            let want_g = flat(want.backward().unwrap().get(x.as_tensor()).unwrap());
            let y = var(&c.zs, &[1, n, v]);
            let hid = tensor(&c.hid, &[1, n, c.h], DType::F64);
            let mask = tensor(&c.mask, &[1, n], DType::F32);
            let (got, _) = full_vocab_divergence(
                y.as_tensor(),
                &head(&c, DType::F64),
                &hid,
                &mask,
                div,
                temperature(tau),
                4,
                None,
            )
            .unwrap();
            let got_g = flat(got.backward().unwrap().get(y.as_tensor()).unwrap());
            assert_rel(
                scalar(&got),
                scalar(&want),
                1e-10,
                &format!("{div:?} tau={tau}"),
            );
            assert_close(&got_g, &want_g, 1e-10, &format!("{div:?} tau={tau} grad"));
        }
    }
}

/// Loss from hidden states + head == loss from the full teacher logits computed here by candle
/// (matmul over all rows, then the padded columns dropped), f32, bigger shapes, [B, T, ·] inputs.
#[test]
fn hidden_states_and_head_equal_full_teacher_logits() {
    let (b, t, h, rows, vocab) = (2, 9, 32, 300, 290);
    let d = Device::Cpu;
    let mut r = rng(31);
    let w = tensor(&uniform(&mut r, rows * h, 0.3), &[rows, h], DType::F32);
    let bias = tensor(&uniform(&mut r, rows, 1.0), &[rows], DType::F32);
    let hid = tensor(&uniform(&mut r, b * t * h, 2.0), &[b, t, h], DType::F32);
    let zs = uniform(&mut r, b * t * vocab, 4.0);
    let mut mask = vec![1.0f32; b * t];
    mask[3] = 0.0;
    mask[b * t - 1] = 0.0;
    let mask = Tensor::from_vec(mask, (b, t), &d).unwrap();
    let (scale, cap) = (1.3, 6.0);
    let head = TeacherHead::new(w.clone(), Some(bias.clone()), scale, Some(cap), vocab).unwrap();
    let z_t = hid
        .reshape((b * t, h))
        .unwrap()
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&bias)
        .unwrap()
        .affine(scale, 0.0)
        .unwrap();
    let z_t = ((z_t / cap).unwrap().tanh().unwrap() * cap).unwrap();
    let z_t = z_t
        .narrow(1, 0, vocab)
        .unwrap()
        .reshape((b, t, vocab))
        .unwrap();
    for div in DIVS {
        for tau in [1.0, 0.8] {
            let x = Var::from_tensor(&tensor(&zs, &[b, t, vocab], DType::F32)).unwrap();
            let (got, _) = full_vocab_divergence(
                x.as_tensor(),
                &head,
                &hid,
                &mask,
                div,
                temperature(tau),
                4,
                None,
            )
            .unwrap();
            let got_g = flat(got.backward().unwrap().get(x.as_tensor()).unwrap());
            let y = Var::from_tensor(&tensor(&zs, &[b, t, vocab], DType::F32)).unwrap();
            let (want, _) = full_vocab_divergence_from_logits(
                y.as_tensor(),
                &z_t,
                &mask,
                div,
                temperature(tau),
                64,
                None,
            )
            .unwrap();
            let want_g = flat(want.backward().unwrap().get(y.as_tensor()).unwrap());
            let what = format!("{div:?} tau={tau}");
            assert_rel(scalar(&got), scalar(&want), 1e-5, &what);
            assert_close(&got_g, &want_g, 1e-5, &format!("{what} grad"));
        }
    }
}

#[test]
fn identical_distributions_give_zero_loss_and_gradient() {
    let c = case(41, 6, 4, 12, 12, true, 1.0, None, &[1]);
    let zs = tensor(&c.zs, &[c.n, c.vocab], DType::F64);
    for div in DIVS {
        let x = var(&c.zs, &[c.n, c.vocab]);
        let (loss, _) = full_vocab_divergence_from_logits(
            x.as_tensor(),
            &zs,
            &mask_t(&c),
            div,
            temperature(1.5),
            2,
            None,
        )
        .unwrap();
        assert!(scalar(&loss).abs() < 1e-14, "{div:?}: {}", scalar(&loss));
        let g = flat(loss.backward().unwrap().get(x.as_tensor()).unwrap());
        assert!(g.iter().all(|x| x.abs() < 1e-14), "{div:?}");
    }
}

#[test]
fn micro_batches_with_a_global_normalizer_add_up_to_the_batch() {
    let c = case(51, 8, 5, 9, 7, true, 1.0, Some(2.0), &[1, 6]);
    let hd = head(&c, DType::F64);
    let hid = tensor(&c.hid, &[c.n, c.h], DType::F64);
    let zs = tensor(&c.zs, &[c.n, c.vocab], DType::F64);
    let mask = mask_t(&c);
    let div = Divergence::Jsd { beta: 0.3 };
    let (full, m) =
        full_vocab_divergence(&zs, &hd, &hid, &mask, div, temperature(1.2), 3, None).unwrap();
    let m = m.read().unwrap();
    let parts: f64 = [(0, 3), (3, 5)]
        .iter()
        .map(|&(s, l)| {
            let (loss, _) = full_vocab_divergence(
                &zs.narrow(0, s, l).unwrap(),
                &hd,
                &hid.narrow(0, s, l).unwrap(),
                &mask.narrow(0, s, l).unwrap(),
                div,
                temperature(1.2),
                3,
                Some(normalizer(m.count)),
            )
            .unwrap();
            scalar(&loss)
        })
        .sum();
    assert_rel(parts, scalar(&full), 1e-12, "sum of micro-batches");
}

#[test]
fn nothing_valid_is_zero_with_a_zero_gradient() {
    let c = case(61, 3, 4, 6, 6, false, 1.0, None, &[0, 1, 2]);
    let x = var(&poison(&c, &c.zs, c.vocab), &[c.n, c.vocab]);
    let hid = tensor(&c.hid, &[c.n, c.h], DType::F64);
    let (loss, m) = full_vocab_divergence(
        x.as_tensor(),
        &head(&c, DType::F64),
        &hid,
        &mask_t(&c),
        Divergence::Forward,
        Temperature::ONE,
        2,
        None,
    )
    .unwrap();
    let m = m.read().unwrap();
    assert_eq!((scalar(&loss), m.count), (0.0, 0.0));
    let g = flat(loss.backward().unwrap().get(x.as_tensor()).unwrap());
    assert!(g.iter().all(|&x| x == 0.0));
}

/// bf16 student logits are computed in f32; a bf16 head is its exact f32 upcast.
#[test]
fn bf16_logits_and_head() {
    let c = case(71, 6, 8, 40, 37, true, 1.0, Some(5.0), &[2]);
    let hid = tensor(&c.hid, &[c.n, c.h], DType::F32);
    let h16 = head(&c, DType::BF16);
    let h32 = TeacherHead::new(
        h16.weight().to_dtype(DType::F32).unwrap(),
        h16.bias().map(|b| b.to_dtype(DType::F32).unwrap()),
        c.scale,
        c.cap,
        c.vocab,
    )
    .unwrap();
    assert_eq!(h16.fingerprint().unwrap(), h32.fingerprint().unwrap());
    let z16 = tensor(&c.zs, &[c.n, c.vocab], DType::BF16);
    let z32 = z16.to_dtype(DType::F32).unwrap();
    let div = Divergence::Jsd { beta: 0.5 };
    let x = Var::from_tensor(&z16).unwrap();
    let (got, _) = full_vocab_divergence(
        x.as_tensor(),
        &h16,
        &hid,
        &mask_t(&c),
        div,
        Temperature::ONE,
        4,
        None,
    )
    .unwrap();
    assert_eq!(got.dtype(), DType::F32);
    let g = got.backward().unwrap();
    assert_eq!(g.get(x.as_tensor()).unwrap().dtype(), DType::BF16);
    let (want, _) = full_vocab_divergence(
        &z32,
        &h32,
        &hid,
        &mask_t(&c),
        div,
        Temperature::ONE,
        4,
        None,
    )
    .unwrap();
    assert_eq!(scalar(&got), scalar(&want));
}

/// The fingerprint follows its documented byte layout (recomputed here with sha2 directly) and
/// changes with every part of the head.
#[test]
fn fingerprint_layout_and_sensitivity() {
    let c = case(81, 2, 3, 5, 4, true, 1.5, Some(30.0), &[]);
    let hd = head(&c, DType::F32);
    let mut s = Sha256::new();
    s.update(b"xdistill.teacher_head.v1\0");
    for x in [c.rows, c.h, c.vocab] {
        s.update((x as u64).to_le_bytes());
    }
    for x in &c.w {
        s.update((*x as f32).to_le_bytes());
    }
    s.update([1u8]);
    for x in c.b.as_ref().unwrap() {
        s.update((*x as f32).to_le_bytes());
    }
    s.update(1.5f64.to_le_bytes());
    s.update([1u8]);
    s.update(30.0f64.to_le_bytes());
    let want = hex::encode(s.finalize());
    let fp = hd.fingerprint().unwrap();
    assert_eq!(fp, want);
    assert_eq!(fp.len(), 64);
    assert_eq!(
        head(&c, DType::F64).fingerprint().unwrap(),
        fp,
        "f64 rounds to f32"
    );

    let w = tensor(&c.w, &[c.rows, c.h], DType::F32);
    let b = tensor(c.b.as_ref().unwrap(), &[c.rows], DType::F32);
    let mut w2 = c.w.clone();
    w2[c.rows * c.h - 1] += 1e-3; // a padded row counts too
    let w2 = tensor(&w2, &[c.rows, c.h], DType::F32);
    let variants = [
        TeacherHead::new(w2, Some(b.clone()), 1.5, Some(30.0), 4),
        TeacherHead::new(w.clone(), None, 1.5, Some(30.0), 4),
        TeacherHead::new(w.clone(), Some(b.clone()), 1.25, Some(30.0), 4),
        TeacherHead::new(w.clone(), Some(b.clone()), 1.5, None, 4),
        TeacherHead::new(w.clone(), Some(b.clone()), 1.5, Some(20.0), 4),
        TeacherHead::new(w, Some(b), 1.5, Some(30.0), 5),
    ];
    for (i, v) in variants.into_iter().enumerate() {
        assert_ne!(v.unwrap().fingerprint().unwrap(), fp, "variant {i}");
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    use crate::loss::LossError;
    let d = Device::Cpu;
    let c = case(91, 4, 3, 7, 6, true, 1.0, None, &[]);
    let w = tensor(&c.w, &[c.rows, c.h], DType::F32);
    let b = tensor(c.b.as_ref().unwrap(), &[c.rows], DType::F32);
    let is_input =
        |r: std::result::Result<TeacherHead, LossError>| matches!(r, Err(LossError::Input { .. }));
    // The head.
    assert!(
        is_input(TeacherHead::new(w.clone(), None, 1.0, None, 8)),
        "head smaller than vocab"
    );
    assert!(is_input(TeacherHead::new(w.clone(), None, 1.0, None, 0)));
    assert!(is_input(TeacherHead::new(
        w.clone(),
        None,
        f64::NAN,
        None,
        6
    )));
    assert!(is_input(TeacherHead::new(
        w.clone(),
        None,
        f64::INFINITY,
        None,
        6
    )));
    assert!(is_input(TeacherHead::new(w.clone(), None, 0.0, None, 6)));
    assert!(is_input(TeacherHead::new(
        w.clone(),
        None,
        1.0,
        Some(f64::NAN),
        6
    )));
    assert!(is_input(TeacherHead::new(
        w.clone(),
        None,
        1.0,
        Some(-1.0),
        6
    )));
    assert!(is_input(TeacherHead::new(
        w.clone(),
        Some(b.narrow(0, 0, 6).unwrap()),
        1.0,
        None,
        6
    )));
    assert!(is_input(TeacherHead::new(
        w.flatten_all().unwrap(),
        None,
        1.0,
        None,
        6
    )));
    let wu = Tensor::zeros((7, 3), DType::U32, &d).unwrap();
    assert!(is_input(TeacherHead::new(wu, None, 1.0, None, 6)));

    // The loss.
    let hd = TeacherHead::new(w, Some(b), 1.0, None, 6).unwrap();
    let zs = Tensor::zeros((4, 6), DType::F32, &d).unwrap();
    let hid = Tensor::zeros((4, 3), DType::F32, &d).unwrap();
    let mask = Tensor::ones(4, DType::F32, &d).unwrap();
    let fwd = Divergence::Forward;
    let run = |zs: &Tensor, hid: &Tensor, mask: &Tensor, div, tau, chunk, norm: Option<f64>| {
        full_vocab_divergence(
            zs,
            &hd,
            hid,
            mask,
            div,
            temperature(tau),
            chunk,
            norm.map(normalizer),
        )
    };
    let input = |r: Result<(Tensor, KdFigures)>| matches!(r, Err(LossError::Input { .. }));
    let config = |r: Result<(Tensor, KdFigures)>| matches!(r, Err(LossError::Config { .. }));
    assert!(run(&zs, &hid, &mask, fwd, 1.0, 2, None).is_ok());
    let hid4 = Tensor::zeros((4, 4), DType::F32, &d).unwrap();
    assert!(
        input(run(&zs, &hid4, &mask, fwd, 1.0, 2, None)),
        "mismatched H"
    );
    let zs7 = Tensor::zeros((4, 7), DType::F32, &d).unwrap();
    assert!(
        input(run(&zs7, &hid, &mask, fwd, 1.0, 2, None)),
        "V = rows, not vocab"
    );
    let zs5 = Tensor::zeros((4, 5), DType::F32, &d).unwrap();
    assert!(
        input(run(&zs5, &hid, &mask, fwd, 1.0, 2, None)),
        "mismatched V"
    );
    let hid3 = Tensor::zeros((3, 3), DType::F32, &d).unwrap();
    assert!(
        input(run(&zs, &hid3, &mask, fwd, 1.0, 2, None)),
        "mismatched N"
    );
    let m3 = Tensor::ones(3, DType::F32, &d).unwrap();
    assert!(input(run(&zs, &hid, &m3, fwd, 1.0, 2, None)), "mask length");
    let mhalf = Tensor::new(&[1.0f32, 0.5, 1.0, 0.0], &d).unwrap();
    assert!(
        input(run(&zs, &hid, &mhalf, fwd, 1.0, 2, None)),
        "mask value"
    );
    let z1 = Tensor::zeros(6, DType::F32, &d).unwrap();
    assert!(
        input(run(&z1, &hid, &mask, fwd, 1.0, 2, None)),
        "rank 1 logits"
    );
    // A bad normalizer cannot reach the loss: `Normalizer` refuses it.
    assert!(Normalizer::new(0.0).is_err(), "normalizer");
    // A bad temperature cannot reach the loss: `Temperature` refuses it.
    assert!(Temperature::new(0.0).is_err(), "temperature");
    assert!(Temperature::new(f64::NAN).is_err(), "temperature");
    assert!(
        config(run(&zs, &hid, &mask, fwd, 1.0, 0, None)),
        "chunk_rows"
    );
    for beta in [-0.1, 1.1, f64::NAN] {
        assert!(config(run(
            &zs,
            &hid,
            &mask,
            Divergence::Jsd { beta },
            1.0,
            2,
            None
        )));
    }
    assert!(matches!(
        teacher_log_softmax_chunk(&hd, &hid4, Temperature::ONE),
        Err(LossError::Input { .. })
    ));
    let zt7 = Tensor::zeros((4, 7), DType::F32, &d).unwrap();
    assert!(input(full_vocab_divergence_from_logits(
        &zs,
        &zt7,
        &mask,
        fwd,
        Temperature::ONE,
        2,
        None
    )));
}

/// Cost figures for docs/losses.md (`cargo test -p xdistill-trainer --lib full_vocab -- --ignored
/// --nocapture`): a Qwen3-0.6B-shaped head (H = 1024, 151,936 rows, 151,669 tokens), chunk 64.
#[test]
#[ignore]
fn measure_qwen3_0_6b_head_cost_per_position() {
    use std::time::Instant;
    let d = Device::Cpu;
    let (h, rows, vocab, chunk) = (1024usize, 151_936usize, 151_669usize, 64usize);
    let w = (Tensor::randn(0f32, 1.0, (rows, h), &d).unwrap() * 0.02).unwrap();
    let hd = TeacherHead::new(w.clone(), None, 1.0, None, vocab).unwrap();
    let hid = Tensor::randn(0f32, 1.0, (chunk, h), &d).unwrap();
    let time = |f: &dyn Fn()| -> f64 {
        f(); // warm-up
        let reps = 3;
        let t0 = Instant::now();
        for _ in 0..reps {
            f();
        }
        t0.elapsed().as_secs_f64() * 1e3 / (reps * chunk) as f64
    };
    let ms_head = time(&|| {
        hd.logits_chunk(&hid).unwrap();
    });
    let ms_lsm = time(&|| {
        teacher_log_softmax_chunk(&hd, &hid, Temperature::ONE).unwrap();
    });
    let h16 = TeacherHead::new(w.to_dtype(DType::BF16).unwrap(), None, 1.0, None, vocab).unwrap();
    let hid16 = hid.to_dtype(DType::BF16).unwrap();
    let ms_bf16 = time(&|| {
        teacher_log_softmax_chunk(&h16, &hid16, Temperature::ONE).unwrap();
    });
    // The whole loss, forward and backward, for 4 chunks of positions.
    let n = 4 * chunk;
    let hid_n = Tensor::randn(0f32, 1.0, (n, h), &d).unwrap();
    let zs = Var::from_tensor(&Tensor::randn(0f32, 2.0, (n, vocab), &d).unwrap()).unwrap();
    let mask = Tensor::ones(n, DType::F32, &d).unwrap();
    let ms_loss = time(&|| {
        let (l, _) = full_vocab_divergence(
            zs.as_tensor(),
            &hd,
            &hid_n,
            &mask,
            Divergence::Jsd { beta: 0.5 },
            Temperature::ONE,
            chunk,
            None,
        )
        .unwrap();
        l.backward().unwrap();
    }) / 4.0;
    let fp0 = Instant::now();
    let fp = hd.fingerprint().unwrap();
    let fp_s = fp0.elapsed().as_secs_f64();
    println!("Qwen3-0.6B-shaped head H={h} rows={rows} vocab={vocab}, chunk {chunk}, this CPU:");
    println!("  head matmul (f32)                 {ms_head:.3} ms/position");
    println!("  head + log-softmax (f32 head)     {ms_lsm:.3} ms/position");
    println!("  head + log-softmax (bf16 head)    {ms_bf16:.3} ms/position (upcast per call)");
    println!("  JSD(0.5) loss fwd+bwd, {n} positions {ms_loss:.3} ms/position");
    println!("  fingerprint {fp_s:.2} s ({fp})");
    let (hid_b, top64, full_b) = (2 * h, 64 * (4 + 4), 2 * rows);
    println!(
        "bytes/position: hidden bf16 {hid_b}, top-64 {top64}, full logits bf16 {full_b} \
         ({:.1}x hidden, {:.1}x top-64)",
        full_b as f64 / hid_b as f64,
        full_b as f64 / top64 as f64
    );
    let ratio = (2 * 151_936) as f64 / (2 * 2048) as f64;
    println!("H=2048, V=151,936: full logits / hidden states = {ratio:.2}x");
    assert!((ratio - 74.2).abs() < 0.05);
}
