//! `first_kl_full` against an f64 loop over the whole teacher vocabulary, finite differences,
//! and the top-k `first_kl` given every teacher id (k = V_t).

use candle_core::{DType, Tensor};

use super::*;
use crate::loss::testutil::*;
use crate::loss::xtoken::tests::{
    fixture, projection_with_first, ref_chunks, B, TS, TT, VL, VS, VT,
};
use crate::loss::Projection;
use crate::loss::{first_kl_loss, TailMode, XTokenBatch};

/// The fixture's aligned batch with the teacher's whole distribution at every position
/// (`k = V_t`, ids in order), from fresh random logits at temperature `tau`.
fn full_batch(seed: u64, tau: f64) -> (XTokenBatch, Vec<f64>, Vec<Vec<f64>>) {
    let (mut x, zs) = fixture(seed, tau);
    let mut r = rng(seed + 50);
    let zt = uniform(&mut r, B * TT * VT, 3.0);
    let lps: Vec<Vec<f64>> = (0..B * TT)
        .map(|p| {
            log_softmax(
                &zt[p * VT..(p + 1) * VT]
                    .iter()
                    .map(|z| z / tau)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    x.k = VT;
    x.teacher_topk_ids = (0..B * TT).flat_map(|_| 0..VT as u32).collect();
    x.teacher_topk_logprobs = lps.iter().flatten().map(|&l| l as f32).collect();
    (x, zs, lps)
}

/// One row per chunk: the student's logits at its first position `[C, VL]` and the teacher's
/// log-probs at its first teacher position `[C, VT]` (f32 values, as the transports carry them).
fn rows(x: &XTokenBatch, zs: &[f64], lps: &[Vec<f64>]) -> (Vec<f64>, Vec<f64>, usize) {
    let chunks = ref_chunks(x);
    let (mut s, mut t) = (vec![], vec![]);
    for (b, sp, tp) in &chunks {
        let r = b * TS + sp[0];
        s.extend_from_slice(&zs[r * VL..(r + 1) * VL]);
        t.extend(lps[b * TT + tp[0]].iter().map(|&l| l as f32 as f64));
    }
    (s, t, chunks.len())
}

/// The definition, in f64 with naive loops over every teacher id.
fn reference(s: &[f64], t: &[f64], c: usize, tau: f64) -> f64 {
    let p = projection_with_first();
    let mut total = 0.0;
    for i in 0..c {
        let z: Vec<f64> = s[i * VL..i * VL + VS].iter().map(|z| z / tau).collect();
        let ls = log_softmax(&z);
        let mut pg = [0.0; VS];
        let mut tail = 0.0;
        let mut in_g = [false; VS];
        for u in 0..VT {
            let pu = t[i * VT + u].exp();
            match p.teacher_first(u) {
                Some(g) => {
                    pg[g as usize] += pu;
                    in_g[g as usize] = true;
                }
                None => tail += pu,
            }
        }
        let tail = f64::max(tail, 1e-6);
        let s_out = (1.0
            - (0..VS)
                .filter(|&g| in_g[g])
                .map(|g| ls[g].exp())
                .sum::<f64>())
        .max(1e-6);
        total += (0..VS)
            .filter(|&g| pg[g] > 0.0)
            .map(|g| pg[g] * (pg[g].ln() - ls[g]))
            .sum::<f64>()
            + tail * (tail.ln() - s_out.ln());
    }
    tau * tau * total / c as f64
}

#[test]
fn matches_the_f64_definition_and_finite_differences() {
    let p = projection_with_first();
    for (seed, tau) in [(2, 1.0), (3, 2.0), (8, 0.7)] {
        let (x, zs, lps) = full_batch(seed, tau);
        let (s, t, c) = rows(&x, &zs, &lps);
        let want = reference(&s, &t, c, tau);
        assert!(want > 0.0, "two different distributions");
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
            let (l, m) = first_kl_full(
                &tensor(&s, &[c, VL], dtype),
                &tensor(&t, &[c, VT], dtype),
                &p,
                temperature(tau),
                None,
            )
            .unwrap();
            let m = m.read().unwrap();
            assert!(
                (scalar(&l) - want).abs() < tol * want,
                "{dtype:?} τ={tau}: {} vs {want}",
                scalar(&l)
            );
            assert_eq!(m.count, c as f64);
        }
        let v = var(&s, &[c, VL]);
        let tt = tensor(&t, &[c, VT], DType::F64);
        let (l, _) = first_kl_full(
            v.as_tensor(),
            &tt,
            &p,
            temperature(tau),
            Some(normalizer(2.5)),
        )
        .unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let fd = numeric_grad(&s, 1e-5, |z| reference(z, &t, c, tau) * c as f64 / 2.5);
        assert_close(&g, &fd, 1e-7, "first_kl_full grad");
        // The padded student column gets no gradient.
        assert!((0..c).all(|i| g[i * VL + VS] == 0.0));
    }
}

/// Exactly the top-k first_kl given every teacher id: value and gradient.
#[test]
fn equals_top_k_first_kl_with_the_whole_teacher_vocabulary() {
    let p = projection_with_first();
    for (seed, tau) in [(4, 1.0), (5, 1.7)] {
        let (x, zs, lps) = full_batch(seed, tau);
        let (s, t, c) = rows(&x, &zs, &lps);
        let vz = var(&zs, &[B, TS, VL]);
        let (lk, _) = first_kl_loss(vz.as_tensor(), &x, &p, temperature(tau), None).unwrap();
        let gk = flat(lk.backward().unwrap().get(vz.as_tensor()).unwrap());
        let vs_ = var(&s, &[c, VL]);
        let (lf, _) = first_kl_full(
            vs_.as_tensor(),
            &tensor(&t, &[c, VT], DType::F64),
            &p,
            temperature(tau),
            None,
        )
        .unwrap();
        let gf = flat(lf.backward().unwrap().get(vs_.as_tensor()).unwrap());
        // The top-k loss takes the tail as 1 − Σ mapped, this one sums the unmapped ids: the
        // f32 log-probs sum to 1 only to ~1e-7.
        assert!(
            (scalar(&lk) - scalar(&lf)).abs() < 1e-6 * scalar(&lk),
            "τ={tau}: top-k {} vs full {}",
            scalar(&lk),
            scalar(&lf)
        );
        // The full loss's rows are the top-k loss's chunk-first rows.
        let mut want = vec![];
        for (b, sp, _) in ref_chunks(&x) {
            let r = b * TS + sp[0];
            want.extend_from_slice(&gk[r * VL..(r + 1) * VL]);
        }
        assert_close(&gf, &want, 1e-6, "gradients");
    }
}

#[test]
fn bad_inputs_are_errors_and_no_chunks_is_zero() {
    let p = projection_with_first();
    let z = Tensor::zeros((2, VL), DType::F32, &candle_core::Device::Cpu).unwrap();
    let t = Tensor::zeros((2, VT), DType::F32, &candle_core::Device::Cpu).unwrap();
    let short = Tensor::zeros((2, VS - 1), DType::F32, &candle_core::Device::Cpu).unwrap();
    assert!(first_kl_full(&short, &t, &p, Temperature::ONE, None).is_err());
    let wrong_t = Tensor::zeros((2, VT + 1), DType::F32, &candle_core::Device::Cpu).unwrap();
    assert!(first_kl_full(&z, &wrong_t, &p, Temperature::ONE, None).is_err());
    assert!(
        Temperature::new(0.0).is_err(),
        "a bad temperature cannot reach the loss"
    );
    let no_first = crate::loss::xtoken::tests::projection();
    let err = first_kl_full(&z, &t, &no_first, Temperature::ONE, None).unwrap_err();
    assert!(err.to_string().contains("first-token map"), "{err}");
    let z0 = Tensor::zeros((0, VL), DType::F32, &candle_core::Device::Cpu).unwrap();
    let t0 = Tensor::zeros((0, VT), DType::F32, &candle_core::Device::Cpu).unwrap();
    let (l, m) = first_kl_full(&z0, &t0, &p, Temperature::ONE, None).unwrap();
    let m = m.read().unwrap();
    assert_eq!((scalar(&l), m.count), (0.0, 0.0));
}

/// P-KL's rows: every student position of each chunk with its chunk, and the teacher's log-probs
/// at each chunk's anchor.
fn pkl_rows(
    x: &XTokenBatch,
    zs: &[f64],
    lps: &[Vec<f64>],
    anchor: crate::loss::Anchor,
) -> (Vec<f64>, Vec<u32>, Vec<f64>, usize) {
    let chunks = ref_chunks(x);
    let (mut s, mut of, mut t) = (vec![], vec![], vec![]);
    for (ci, (b, sp, tp)) in chunks.iter().enumerate() {
        for &p in sp {
            let r = b * TS + p;
            s.extend_from_slice(&zs[r * VL..(r + 1) * VL]);
            of.push(ci as u32);
        }
        let a = match anchor {
            crate::loss::Anchor::First => tp[0],
            crate::loss::Anchor::Last => tp[tp.len() - 1],
        };
        t.extend(lps[b * TT + a].iter().map(|&l| l as f32 as f64));
    }
    (s, of, t, chunks.len())
}

/// P-KL by the definition in f64: dense W, every teacher id.
fn ref_pkl_full(s: &[f64], of: &[u32], t: &[f64], c: usize, tail: TailMode, tau: f64) -> f64 {
    let p = projection_with_first();
    let mut q = vec![vec![0.0; VT]; c];
    let mut count = vec![0.0; c];
    for &k in of {
        count[k as usize] += 1.0;
    }
    for (i, &k) in of.iter().enumerate() {
        let z: Vec<f64> = s[i * VL..i * VL + VS].iter().map(|z| z / tau).collect();
        let ps: Vec<f64> = log_softmax(&z).iter().map(|l| l.exp()).collect();
        for (sid, &pv) in ps.iter().enumerate() {
            let (us, ws) = p.row(sid);
            for (&u, &w) in us.iter().zip(ws) {
                q[k as usize][u as usize] += pv * w as f64 / count[k as usize];
            }
        }
    }
    let mut total = 0.0;
    for k in 0..c {
        let qk: Vec<f64> = q[k].iter().map(|v| v + 1e-10).collect();
        let mass: f64 = qk.iter().sum();
        let lt = &t[k * VT..(k + 1) * VT];
        for u in 0..VT {
            let lq = match tail {
                TailMode::Renormalize => (qk[u] / mass).ln(),
                _ => qk[u].ln(),
            };
            total += lt[u].exp() * (lt[u] - lq);
        }
        if tail == TailMode::Bucket {
            let tt = (1.0 - lt.iter().map(|l| l.exp()).sum::<f64>()).max(1e-6);
            let st = (1.0 - mass).max(1e-6);
            total += tt * (tt.ln() - st.ln());
        }
    }
    tau * tau * total / c as f64
}

#[test]
fn pkl_full_matches_the_f64_definition_finite_differences_and_top_k_pkl() {
    use crate::loss::{pkl_loss, Anchor};
    let p = projection_with_first();
    for (seed, tau, anchor, tail) in [
        (6, 1.0, Anchor::First, TailMode::Renormalize),
        (7, 1.6, Anchor::Last, TailMode::Ignore),
        (9, 0.8, Anchor::First, TailMode::Bucket),
    ] {
        let (x, zs, lps) = full_batch(seed, tau);
        let (s, of, t, c) = pkl_rows(&x, &zs, &lps, anchor);
        let want = ref_pkl_full(&s, &of, &t, c, tail, tau);
        assert!(want > 1e-3, "a loss that is not trivially 0: {want}");
        let case = format!("{anchor:?} {tail:?} τ={tau}");
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
            let (l, m) = pkl_full(
                &tensor(&s, &[of.len(), VL], dtype),
                &of,
                &tensor(&t, &[c, VT], dtype),
                &p,
                tail,
                temperature(tau),
                None,
            )
            .unwrap();
            let m = m.read().unwrap();
            assert!(
                (scalar(&l) - want).abs() < tol * want,
                "{case} {dtype:?}: {} vs {want}",
                scalar(&l)
            );
            assert_eq!(m.count, c as f64);
        }
        let v = var(&s, &[of.len(), VL]);
        let tt = tensor(&t, &[c, VT], DType::F64);
        let (l, _) = pkl_full(
            v.as_tensor(),
            &of,
            &tt,
            &p,
            tail,
            temperature(tau),
            Some(normalizer(3.0)),
        )
        .unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let fd = numeric_grad(&s, 1e-5, |z| {
            ref_pkl_full(z, &of, &t, c, tail, tau) * c as f64 / 3.0
        });
        assert_close(&g, &fd, 1e-7, &format!("{case}: grad"));

        // The top-k P-KL given every teacher id (k = V_t): the same value and gradient.
        let vz = var(&zs, &[B, TS, VL]);
        let (lk, _) =
            pkl_loss(vz.as_tensor(), &x, &p, anchor, tail, temperature(tau), None).unwrap();
        let gk = flat(lk.backward().unwrap().get(vz.as_tensor()).unwrap());
        let vr = var(&s, &[of.len(), VL]);
        let (lf, _) = pkl_full(vr.as_tensor(), &of, &tt, &p, tail, temperature(tau), None).unwrap();
        let gf = flat(lf.backward().unwrap().get(vr.as_tensor()).unwrap());
        assert!(
            (scalar(&lk) - scalar(&lf)).abs() < 1e-6 * scalar(&lk),
            "{case}: top-k {} vs full {}",
            scalar(&lk),
            scalar(&lf)
        );
        let mut want_g = vec![];
        for (b, sp, _) in ref_chunks(&x) {
            for q in sp {
                let r = b * TS + q;
                want_g.extend_from_slice(&gk[r * VL..(r + 1) * VL]);
            }
        }
        assert_close(&gf, &want_g, 1e-6, &format!("{case}: top-k gradients"));
    }
}

#[test]
fn pkl_full_refuses_rows_without_chunks() {
    let p = projection_with_first();
    let dev = candle_core::Device::Cpu;
    let z = Tensor::zeros((3, VL), DType::F32, &dev).unwrap();
    let t = Tensor::zeros((2, VT), DType::F32, &dev).unwrap();
    // Chunk 1 has no row; a chunk id past C; the wrong number of ids.
    for of in [vec![0u32, 0, 0], vec![0, 1, 2], vec![0, 1]] {
        assert!(
            pkl_full(
                &z,
                &of,
                &t,
                &p,
                TailMode::Renormalize,
                Temperature::ONE,
                None
            )
            .is_err(),
            "{of:?}"
        );
    }
    assert!(pkl_full(
        &z,
        &[0, 1, 1],
        &t,
        &p,
        TailMode::Renormalize,
        Temperature::ONE,
        None
    )
    .is_ok());
}

/// Gold over the whole distribution by its definition, in f64 with plain loops: `s [C, vl]`
/// student logits (first `V_s` columns read), `t [C, V_t]` teacher log-probs.
fn ref_gold_full(
    s: &[f64],
    t: &[f64],
    matched: &[bool],
    p: &Projection,
    vl: usize,
    (wm, wu, tau): (f64, f64, f64),
) -> f64 {
    let (vs, vt) = (p.student_vocab(), p.teacher_vocab());
    let kp: Vec<(usize, usize)> = (0..vt)
        .filter_map(|u| p.exact_student(u).map(|g| (u, g as usize)))
        .collect();
    let mut total = 0.0;
    for (i, &m) in matched.iter().enumerate() {
        let z: Vec<f64> = s[i * vl..i * vl + vs].iter().map(|z| z / tau).collect();
        let ps: Vec<f64> = log_softmax(&z).iter().map(|l| l.exp()).collect();
        let pt: Vec<f64> = t[i * vt..(i + 1) * vt].iter().map(|l| l.exp()).collect();
        if m && !kp.is_empty() {
            let tm: f64 = kp.iter().map(|&(u, _)| pt[u]).sum();
            let sm: f64 = kp.iter().map(|&(_, g)| ps[g]).sum();
            total += wm
                * kp.iter()
                    .map(|&(u, g)| pt[u] / tm * ((pt[u] / tm).ln() - (ps[g] / sm).ln()))
                    .sum::<f64>();
        } else {
            let n = vs.max(vt);
            let sorted = |v: &[f64]| {
                let mut v = v.to_vec();
                v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                v.resize(n, 0.0);
                v
            };
            let (a, b) = (sorted(&pt), sorted(&ps));
            total += wu * a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f64>();
        }
    }
    tau * tau * total / matched.len() as f64
}

/// A projection with `vs` student and `vt` teacher ids: student `s < exact` maps one-hot to
/// teacher `(3s + 1) mod vt`; the others to two or three teacher ids.
fn gold_projection(vs: usize, vt: usize, exact: usize) -> Projection {
    let (mut indptr, mut indices, mut weights) = (vec![0], vec![], vec![]);
    for s in 0..vs {
        if s < exact {
            indices.push(((3 * s + 1) % vt) as u32);
            weights.push(1.0);
        } else {
            let n = 2 + s % 2;
            let ids: Vec<u32> = (0..n).map(|i| ((s + 2 * i) % vt) as u32).collect();
            indices.extend(&ids);
            weights.extend(std::iter::repeat_n(1.0 / n as f32, n));
        }
        indptr.push(indices.len());
    }
    Projection::from_csr(vs, vt, &indptr, &indices, &weights).unwrap()
}

/// Against the f64 definition and finite differences, with more student than teacher ids, more
/// teacher than student ids, and no exact pair at all (every chunk unmatched).
#[test]
fn gold_full_matches_the_f64_definition_and_finite_differences() {
    let c = 5;
    let matched = [true, false, true, false, false];
    for (case, (vs, vt, exact), seed, tau) in [
        ("V_s > V_t", (11, 7, 3), 21, 1.0),
        ("V_s < V_t", (6, 10, 4), 22, 1.4),
        ("no exact pair", (8, 8, 0), 23, 0.8),
    ] {
        let p = gold_projection(vs, vt, exact);
        let vl = vs + 1;
        let mut r = rng(seed);
        let s = uniform(&mut r, c * vl, 3.0);
        let zt = uniform(&mut r, c * vt, 3.0);
        let t: Vec<f64> = (0..c)
            .flat_map(|i| {
                let row: Vec<f64> = zt[i * vt..(i + 1) * vt].iter().map(|z| z / tau).collect();
                log_softmax(&row).into_iter().map(|l| l as f32 as f64)
            })
            .collect();
        let w = (0.7, 1.3, tau);
        let want = ref_gold_full(&s, &t, &matched, &p, vl, w);
        assert!(
            want > 1e-3,
            "{case}: a loss that is not trivially 0: {want}"
        );
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
            let (l, m) = gold_full(
                &tensor(&s, &[c, vl], dtype),
                &tensor(&t, &[c, vt], dtype),
                &matched,
                &p,
                0.7,
                1.3,
                temperature(tau),
                None,
            )
            .unwrap();
            let m = m.read().unwrap();
            assert!(
                (scalar(&l) - want).abs() < tol * want,
                "{case} {dtype:?}: {} vs {want}",
                scalar(&l)
            );
            assert_eq!(m.count, c as f64);
        }
        let v = var(&s, &[c, vl]);
        let tt = tensor(&t, &[c, vt], DType::F64);
        let (l, _) = gold_full(
            v.as_tensor(),
            &tt,
            &matched,
            &p,
            0.7,
            1.3,
            temperature(tau),
            Some(normalizer(2.0)),
        )
        .unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let fd = numeric_grad(&s, 1e-6, |z| {
            ref_gold_full(z, &t, &matched, &p, vl, w) * c as f64 / 2.0
        });
        assert_close(&g, &fd, 1e-6, &format!("{case}: grad"));
        assert!(
            (0..c).all(|i| g[i * vl + vs] == 0.0),
            "{case}: padded column"
        );
    }
}

/// With as many student as teacher ids, exactly the top-k gold given every teacher id (k = V):
/// value, matched split and gradient, on chunks of every shape (1:1 matched, 2:1, 1:2, and 1:1
/// whose targets do not map to each other).
#[test]
fn gold_full_equals_top_k_gold_with_the_whole_vocabulary() {
    use super::super::xtoken::{gold_matched, gold_split};
    use crate::loss::gold_loss;
    let (v, ts, tt) = (8, 5, 5);
    let p = gold_projection(v, v, 4);
    let vl = v + 1;
    let tau = 1.2;
    let mut r = rng(31);
    let zs = uniform(&mut r, ts * vl, 3.0);
    let zt = uniform(&mut r, tt * v, 3.0);
    let lps: Vec<f64> = (0..tt)
        .flat_map(|i| {
            let row: Vec<f64> = zt[i * v..(i + 1) * v].iter().map(|z| z / tau).collect();
            log_softmax(&row).into_iter().map(|l| l as f32 as f64)
        })
        .collect();
    // Student 1 maps exactly to teacher 4 (3·1 + 1), student 2 to teacher 7.
    let x = XTokenBatch {
        batch: 1,
        student_len: ts,
        teacher_len: tt,
        k: v,
        student_chunk: vec![0, 1, 1, 2, 3],
        teacher_chunk: vec![0, 1, 2, 2, 3],
        num_chunks: vec![4],
        student_targets: vec![1, 5, 6, 0, 2],
        teacher_targets: vec![4, 3, 0, 5, 4],
        teacher_topk_ids: (0..tt).flat_map(|_| 0..v as u32).collect(),
        teacher_topk_logprobs: lps.iter().map(|&l| l as f32).collect(),
        ..Default::default()
    };
    let chunks = ref_chunks(&x);
    let matched: Vec<bool> = chunks
        .iter()
        .map(|(_, sp, tp)| {
            let one_to_one = sp.len() == 1 && tp.len() == 1;
            gold_matched(
                &p,
                one_to_one,
                x.student_targets[sp[0]],
                x.teacher_targets[tp[0]],
            )
        })
        .collect();
    assert_eq!(matched, [true, false, false, false]);
    assert_eq!(gold_split(&x, &p).unwrap(), (1, 3));
    let (mut s, mut t) = (vec![], vec![]);
    for (_, sp, tp) in &chunks {
        s.extend_from_slice(&zs[sp[0] * vl..(sp[0] + 1) * vl]);
        t.extend_from_slice(&lps[tp[0] * v..(tp[0] + 1) * v]);
    }
    let c = chunks.len();
    let vz = var(&zs, &[1, ts, vl]);
    let (lk, _) = gold_loss(vz.as_tensor(), &x, &p, 0.6, 1.4, temperature(tau), None).unwrap();
    let gk = flat(lk.backward().unwrap().get(vz.as_tensor()).unwrap());
    let vr = var(&s, &[c, vl]);
    let tt_ = tensor(&t, &[c, v], DType::F64);
    let (lf, _) = gold_full(
        vr.as_tensor(),
        &tt_,
        &matched,
        &p,
        0.6,
        1.4,
        temperature(tau),
        None,
    )
    .unwrap();
    let gf = flat(lf.backward().unwrap().get(vr.as_tensor()).unwrap());
    assert!(
        (scalar(&lk) - scalar(&lf)).abs() < 1e-9 * scalar(&lk),
        "top-k {} vs full {}",
        scalar(&lk),
        scalar(&lf)
    );
    let mut want = vec![];
    for (_, sp, _) in &chunks {
        want.extend_from_slice(&gk[sp[0] * vl..(sp[0] + 1) * vl]);
    }
    assert_close(&gf, &want, 1e-9, "gradients");
}

#[test]
fn gold_full_refuses_bad_shapes_and_no_chunks_is_zero() {
    let p = gold_projection(6, 5, 2);
    let dev = candle_core::Device::Cpu;
    let zeros = |r: usize, c: usize| Tensor::zeros((r, c), DType::F32, &dev).unwrap();
    let ok = [true, false];
    let run = |z: &Tensor, t: &Tensor, m: &[bool], tau: f64| {
        gold_full(z, t, m, &p, 1.0, 1.0, temperature(tau), None)
    };
    assert!(run(&zeros(2, 7), &zeros(2, 5), &ok, 1.0).is_ok());
    assert!(
        run(&zeros(2, 5), &zeros(2, 5), &ok, 1.0).is_err(),
        "short student rows"
    );
    assert!(
        run(&zeros(2, 7), &zeros(2, 6), &ok, 1.0).is_err(),
        "teacher vocabulary"
    );
    assert!(
        run(&zeros(2, 7), &zeros(3, 5), &ok, 1.0).is_err(),
        "chunk count"
    );
    assert!(
        run(&zeros(2, 7), &zeros(2, 5), &[true], 1.0).is_err(),
        "matched flags"
    );
    assert!(Temperature::new(0.0).is_err(), "temperature");
    let (l, m) = run(&zeros(0, 7), &zeros(0, 5), &[], 1.0).unwrap();
    assert_eq!((scalar(&l), m.read().unwrap().count), (0.0, 0.0));
}

/// Gold's cost at real sizes (`-- --ignored --nocapture`): a Qwen3-vocabulary student
/// (151,669 ids) against a Llama-2-vocabulary teacher (32,000 ids), forward and backward, per
/// chunk, for every chunk unmatched (the whole-row sorts) and every chunk matched, at two chunk
/// counts; the host sort alone, and `first_kl_full` on the same rows for scale.
#[test]
#[ignore = "a measurement: prints timings"]
fn measure_gold_full_cost_per_chunk() {
    use crate::loss::topk::descending_order;
    use candle_core::{Device, Var};
    use std::time::Instant;
    let (vs, vt) = (151_669usize, 32_000usize);
    // Student ids below V_t map one-hot to the same teacher id; the rest to two teacher ids.
    let (mut indptr, mut indices, mut weights) = (vec![0usize], vec![], vec![]);
    for s in 0..vs {
        if s < vt {
            indices.push(s as u32);
            weights.push(1.0f32);
        } else {
            indices.extend([(s % vt) as u32, ((s * 7) % vt) as u32]);
            weights.extend([0.5f32, 0.5]);
        }
        indptr.push(indices.len());
    }
    let first = (0..vt).map(|u| Some(u as u32)).collect();
    let p = Projection::from_csr(vs, vt, &indptr, &indices, &weights)
        .unwrap()
        .with_teacher_first(first)
        .unwrap();
    let d = Device::Cpu;
    println!(
        "gold_full, V_s = {vs}, V_t = {vt}, f32, this CPU ({} rayon threads):",
        rayon::current_num_threads()
    );
    for c in [16usize, 64] {
        let z = Var::from_tensor(&Tensor::randn(0f32, 2.0, (c, vs), &d).unwrap()).unwrap();
        let t = candle_nn::ops::log_softmax(&Tensor::randn(0f32, 2.0, (c, vt), &d).unwrap(), 1)
            .unwrap();
        for (what, m) in [("unmatched", false), ("matched", true)] {
            let flags = vec![m; c];
            let run = || {
                let (l, _) = gold_full(
                    z.as_tensor(),
                    &t,
                    &flags,
                    &p,
                    1.0,
                    1.0,
                    Temperature::ONE,
                    None,
                )
                .unwrap();
                l.backward().unwrap();
            };
            run();
            let t0 = Instant::now();
            for _ in 0..3 {
                run();
            }
            let ms = t0.elapsed().as_secs_f64() * 1e3 / (3 * c) as f64;
            println!("  {c:>3} chunks, all {what:<9} {ms:8.3} ms/chunk (forward + backward)");
        }
        // For scale: the first-token KL over the same rows.
        let run = || {
            let (l, _) = first_kl_full(z.as_tensor(), &t, &p, Temperature::ONE, None).unwrap();
            l.backward().unwrap();
        };
        run();
        let t0 = Instant::now();
        for _ in 0..3 {
            run();
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / (3 * c) as f64;
        println!("  {c:>3} chunks, first_kl_full    {ms:8.3} ms/chunk (forward + backward)");
        let probs = candle_nn::ops::softmax_last_dim(z.as_tensor()).unwrap();
        let t0 = Instant::now();
        descending_order(&probs).unwrap();
        let ms = t0.elapsed().as_secs_f64() * 1e3 / c as f64;
        println!("  {c:>3} chunks, the host sort alone {ms:8.3} ms/chunk");
    }
}
