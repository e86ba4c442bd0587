//! Tests of P-KL and gold against f64 loop references on a hand-made aligned batch.

use candle_core::DType;

use super::*;
use crate::loss::testutil::*;

pub(crate) const B: usize = 2;
pub(crate) const TS: usize = 6;
pub(crate) const TT: usize = 5;
pub(crate) const VS: usize = 9;
/// Student logits carry one padded LM-head column beyond the vocabulary.
pub(crate) const VL: usize = VS + 1;
pub(crate) const VT: usize = 7;
pub(crate) const K: usize = 3;

/// W: student ids 0..3 map exactly to teacher ids 0..3; the others to 2 or 3 teacher ids with
/// weights ∝ 0.9·0.1^i, first entry `s mod 7` so every teacher id has a student source.
pub(crate) fn projection() -> Projection {
    let (mut indptr, mut indices, mut weights) = (vec![0], vec![], vec![]);
    for s in 0..VS {
        let ids: Vec<u32> = match s {
            0..=2 => vec![s as u32],
            3..=6 => vec![s as u32, ((s + 2) % VT) as u32],
            _ => vec![
                (s % VT) as u32,
                ((s + 1) % VT) as u32,
                ((s + 3) % VT) as u32,
            ],
        };
        let raw: Vec<f32> = (0..ids.len())
            .map(|i| 0.9 * 0.1f32.powi(i as i32))
            .collect();
        let sum: f32 = raw.iter().sum();
        indices.extend(&ids);
        weights.extend(raw.iter().map(|w| w / sum));
        indptr.push(indices.len());
    }
    Projection::from_csr(VS, VT, &indptr, &indices, &weights).unwrap()
}

/// Two rows. Row 0 chunks: 0 = 1:1 (exactly mapped target), 1 = 2 student : 1 teacher,
/// 2 = 1:2, 3 = student only (ignored). Row 1: 0 = 2:1, 1 = 1:2, 2 = 1:1 whose student target
/// maps exactly to a *different* teacher id (unmatched).
pub(crate) fn fixture(seed: u64, tau: f64) -> (XTokenBatch, Vec<f64>) {
    let mut r = rng(seed);
    let zs = uniform(&mut r, B * TS * VL, 2.0);
    let zt = uniform(&mut r, B * TT * VT, 2.0);
    let mut ids = vec![];
    let mut lps = vec![];
    let mut target_lp = vec![];
    let teacher_targets: Vec<u32> = vec![1, 4, 5, 6, 0, 3, 2, 6, 1, 0];
    for p in 0..B * TT {
        let row: Vec<f64> = zt[p * VT..(p + 1) * VT].iter().map(|z| z / tau).collect();
        let lp = log_softmax(&row);
        for i in topk(&lp, K) {
            ids.push(i as u32);
            lps.push(lp[i] as f32);
        }
        target_lp.push(lp[teacher_targets[p] as usize] as f32);
    }
    // Make sure the teacher top-k at row 0 position 0 contains an exactly mapped id (0..3).
    if !ids[..K].iter().any(|&u| u < 3) {
        ids[K - 1] = 0;
    }
    let batch = XTokenBatch {
        batch: B,
        student_len: TS,
        teacher_len: TT,
        k: K,
        student_chunk: vec![0, 1, 1, 2, 3, -1, 0, 0, 1, 2, -1, -1],
        teacher_chunk: vec![0, 1, 2, 2, -1, 0, 1, 1, 2, -1],
        num_chunks: vec![4, 3],
        // Row 0 pos 0 predicts student 1 = teacher 1 (matched); row 1 pos 3 predicts student 2
        // while the teacher predicts 1 (unmatched).
        student_targets: vec![1, 4, 8, 5, 7, 0, 3, 6, 8, 2, 0, 0],
        teacher_targets,
        teacher_topk_ids: ids,
        teacher_topk_logprobs: lps,
        teacher_target_logprobs: target_lp,
    };
    (batch, zs)
}

/// Chunks by naive scanning: (row, student positions, teacher positions), both non-empty.
pub(crate) fn ref_chunks(x: &XTokenBatch) -> Vec<(usize, Vec<usize>, Vec<usize>)> {
    let mut out = vec![];
    for b in 0..x.batch {
        for c in 0..x.num_chunks[b] as i64 {
            let s: Vec<usize> = (0..x.student_len)
                .filter(|&t| x.student_chunk[b * x.student_len + t] == c)
                .collect();
            let t: Vec<usize> = (0..x.teacher_len)
                .filter(|&t| x.teacher_chunk[b * x.teacher_len + t] == c)
                .collect();
            if !s.is_empty() && !t.is_empty() {
                out.push((b, s, t));
            }
        }
    }
    out
}

fn dense_w(p: &Projection) -> Vec<Vec<f64>> {
    (0..VS)
        .map(|s| {
            let mut row = vec![0.0; VT];
            let (ids, w) = p.row(s);
            for (u, w) in ids.iter().zip(w) {
                row[*u as usize] = *w as f64;
            }
            row
        })
        .collect()
}

/// Student probabilities at temperature τ over the real vocabulary (padded column dropped).
fn student_probs(zs: &[f64], b: usize, t: usize, tau: f64) -> Vec<f64> {
    let o = (b * TS + t) * VL;
    let z: Vec<f64> = zs[o..o + VS].iter().map(|z| z / tau).collect();
    log_softmax(&z).iter().map(|l| l.exp()).collect()
}

fn teacher_row(x: &XTokenBatch, b: usize, t: usize) -> (Vec<usize>, Vec<f64>) {
    let o = (b * TT + t) * K;
    (
        x.teacher_topk_ids[o..o + K]
            .iter()
            .map(|&u| u as usize)
            .collect(),
        x.teacher_topk_logprobs[o..o + K]
            .iter()
            .map(|&l| l as f64)
            .collect(),
    )
}

fn ref_pkl(x: &XTokenBatch, zs: &[f64], anchor: Anchor, tail: TailMode, tau: f64) -> f64 {
    let w = dense_w(&projection());
    let chunks = ref_chunks(x);
    let mut total = 0.0;
    for (b, s, t) in &chunks {
        let a = if anchor == Anchor::First {
            t[0]
        } else {
            *t.last().unwrap()
        };
        let (ids, l) = teacher_row(x, *b, a);
        // Q[j] = mean over student positions of Σ_s W[s, K_j]·p(s), then renormalised.
        let mut q = [0.0; K];
        for &pos in s {
            let p = student_probs(zs, *b, pos, tau);
            for (j, &u) in ids.iter().enumerate() {
                q[j] += (0..VS).map(|v| w[v][u] * p[v]).sum::<f64>() / s.len() as f64;
            }
        }
        let qs: f64 = q.iter().sum();
        let norm = if tail == TailMode::Renormalize {
            qs
        } else {
            1.0
        };
        total += (0..K)
            .map(|j| l[j].exp() * (l[j] - (q[j] / norm).ln()))
            .sum::<f64>();
        if tail == TailMode::Bucket {
            // One more entry: the mass outside K on each side (floored as the loss does).
            let t_tail = (1.0 - l.iter().map(|v| v.exp()).sum::<f64>()).max(1e-6);
            let s_tail = (1.0 - qs).max(1e-6);
            total += t_tail * (t_tail.ln() - s_tail.ln());
        }
    }
    tau * tau * total / chunks.len() as f64
}

fn ref_gold(x: &XTokenBatch, zs: &[f64], wm: f64, wu: f64, tau: f64) -> (f64, usize) {
    let w = dense_w(&projection());
    let exact_t = |s: usize| -> Option<usize> {
        let nz: Vec<usize> = (0..VT).filter(|&u| w[s][u] != 0.0).collect();
        (nz.len() == 1 && w[s][nz[0]] == 1.0).then(|| nz[0])
    };
    let exact_s = |u: usize| (0..VS).find(|&s| exact_t(s) == Some(u));
    let chunks = ref_chunks(x);
    let (mut total, mut matched) = (0.0, 0);
    for (b, s, t) in &chunks {
        let p = student_probs(zs, *b, s[0], tau);
        let (ids, l) = teacher_row(x, *b, t[0]);
        let s_tok = x.student_targets[b * TS + s[0]] as usize;
        let u_tok = x.teacher_targets[b * TT + t[0]] as usize;
        let kept: Vec<(usize, usize)> = (0..K)
            .filter_map(|j| exact_s(ids[j]).map(|sv| (j, sv)))
            .collect();
        if s.len() == 1 && t.len() == 1 && exact_t(s_tok) == Some(u_tok) && !kept.is_empty() {
            matched += 1;
            let zt: f64 = kept.iter().map(|&(j, _)| l[j].exp()).sum();
            let zs_: f64 = kept.iter().map(|&(_, sv)| p[sv]).sum();
            total += wm
                * kept
                    .iter()
                    .map(|&(j, sv)| {
                        let pt = l[j].exp() / zt;
                        pt * (pt / (p[sv] / zs_)).ln()
                    })
                    .sum::<f64>();
        } else {
            let mut pt: Vec<f64> = l.iter().map(|l| l.exp()).collect();
            pt.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let mut ps = p.clone();
            ps.sort_by(|a, b| b.partial_cmp(a).unwrap());
            total += wu * (0..K).map(|i| (pt[i] - ps[i]).abs()).sum::<f64>();
        }
    }
    (tau * tau * total / chunks.len() as f64, matched)
}

#[test]
fn chunks_are_found_and_bad_ids_rejected() {
    let (x, _) = fixture(1, 1.0);
    let got: Vec<(usize, Vec<usize>, Vec<usize>)> = x
        .chunks()
        .unwrap()
        .into_iter()
        .map(|c| (c.b, c.student, c.teacher))
        .collect();
    assert_eq!(got, ref_chunks(&x));
    assert_eq!(got.len(), 6);
    let mut bad = x.clone();
    bad.student_chunk[2] = 4; // row 0 has 4 chunks
    assert!(bad.chunks().is_err());
    let mut bad = x.clone();
    bad.teacher_chunk.pop();
    assert!(bad.chunks().is_err());
}

#[test]
fn projection_transpose_and_exact_maps() {
    let p = projection();
    let w = dense_w(&p);
    for u in 0..VT {
        let (ss, ws) = p.column(u);
        let want: Vec<(u32, f64)> = (0..VS)
            .filter(|&s| w[s][u] != 0.0)
            .map(|s| (s as u32, w[s][u]))
            .collect();
        let got: Vec<(u32, f64)> = ss.iter().zip(ws).map(|(&s, &w)| (s, w as f64)).collect();
        assert_eq!(got, want);
    }
    assert_eq!(p.exact_teacher(1), Some(1));
    assert_eq!(p.exact_teacher(5), None);
    assert_eq!(p.exact_student(2), Some(2));
    assert_eq!(p.exact_student(4), None);
    assert!(Projection::from_csr(2, 3, &[0, 1], &[0], &[1.0]).is_err()); // indptr length
    assert!(Projection::from_csr(1, 3, &[0, 1], &[3], &[1.0]).is_err()); // id out of range
    assert!(Projection::from_csr(1, 3, &[0, 1], &[0], &[f32::NAN]).is_err());
}

#[test]
fn pkl_matches_reference_and_finite_differences() {
    for (seed, tau, anchor, tail) in [
        (2, 1.0, Anchor::First, TailMode::Renormalize),
        (3, 2.0, Anchor::Last, TailMode::Renormalize),
        (2, 1.0, Anchor::First, TailMode::Bucket),
        (3, 2.0, Anchor::Last, TailMode::Bucket),
        (5, 1.0, Anchor::First, TailMode::Ignore),
    ] {
        let (x, zs) = fixture(seed, tau);
        let want = ref_pkl(&x, &zs, anchor, tail, tau);
        let p = projection();
        for (dtype, tol) in [(DType::F64, 1e-8), (DType::F32, 2e-5)] {
            let (l, m) = pkl_loss(
                &tensor(&zs, &[B, TS, VL], dtype),
                &x,
                &p,
                anchor,
                tail,
                temperature(tau),
                None,
            )
            .unwrap();
            let m = m.read().unwrap();
            assert!(
                (scalar(&l) - want).abs() < tol * want.abs().max(1e-3),
                "{anchor:?} {tail:?} {dtype:?}: {} vs {want}",
                scalar(&l)
            );
            assert_eq!(m.count, 6.0);
        }
        let v = var(&zs, &[B, TS, VL]);
        let (l, _) = pkl_loss(v.as_tensor(), &x, &p, anchor, tail, temperature(tau), None).unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let fd = numeric_grad(&zs, 1e-5, |z| ref_pkl(&x, z, anchor, tail, tau));
        assert_close(&g, &fd, 1e-7, "pkl grad");
        // The padded column and positions outside any chunk get no gradient.
        assert!((0..B * TS).all(|r| g[r * VL + VS] == 0.0));
        assert!(g[5 * VL..6 * VL].iter().all(|&x| x == 0.0));
    }
}

#[test]
fn pkl_is_zero_when_the_projected_student_equals_the_teacher() {
    // One 1:1 chunk, exact one-hot W, the teacher's K covering its whole vocabulary: then
    // Q = p_S over K and L = the teacher's log-probs; equal logits give 0.
    let (vs, vt, k) = (4, 4, 4);
    let p = Projection::from_csr(vs, vt, &[0, 1, 2, 3, 4], &[0, 1, 2, 3], &[1.0; 4]).unwrap();
    let z = [0.3, -1.0, 2.0, 0.5];
    let lp = log_softmax(&z);
    let order = topk(&lp, k);
    let x = XTokenBatch {
        batch: 1,
        student_len: 1,
        teacher_len: 1,
        k,
        student_chunk: vec![0],
        teacher_chunk: vec![0],
        num_chunks: vec![1],
        teacher_topk_ids: order.iter().map(|&i| i as u32).collect(),
        teacher_topk_logprobs: order.iter().map(|&i| lp[i] as f32).collect(),
        ..Default::default()
    };
    let (l, _) = pkl_loss(
        &tensor(&z, &[1, 1, vs], DType::F64),
        &x,
        &p,
        Anchor::First,
        TailMode::Renormalize,
        Temperature::ONE,
        None,
    )
    .unwrap();
    assert!(scalar(&l).abs() < 1e-7, "{}", scalar(&l));
}

#[test]
fn gold_matches_reference_and_finite_differences() {
    let tau = 1.3;
    let (x, zs) = fixture(4, tau);
    let p = projection();
    let (want, matched) = ref_gold(&x, &zs, 0.7, 1.2, tau);
    assert!(matched >= 1, "the fixture must exercise the matched branch");
    assert_eq!(gold_split(&x, &p).unwrap(), (matched, 6 - matched));
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
        let (l, m) = gold_loss(
            &tensor(&zs, &[B, TS, VL], dtype),
            &x,
            &p,
            0.7,
            1.2,
            temperature(tau),
            None,
        )
        .unwrap();
        let m = m.read().unwrap();
        assert!(
            (scalar(&l) - want).abs() < tol * want.abs().max(1e-3),
            "{dtype:?}: {} vs {want}",
            scalar(&l)
        );
        assert_eq!(m.count, 6.0);
    }
    let v = var(&zs, &[B, TS, VL]);
    let (l, _) = gold_loss(v.as_tensor(), &x, &p, 0.7, 1.2, temperature(tau), None).unwrap();
    let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
    let fd = numeric_grad(&zs, 1e-5, |z| ref_gold(&x, z, 0.7, 1.2, tau).0);
    assert_close(&g, &fd, 1e-6, "gold grad");
}

#[test]
fn normalizer_splits_into_micro_batches() {
    let (x, zs) = fixture(5, 1.0);
    let p = projection();
    let z_full = tensor(&zs, &[B, TS, VL], DType::F64);
    let full = scalar(
        &pkl_loss(
            &z_full,
            &x,
            &p,
            Anchor::First,
            TailMode::Bucket,
            Temperature::ONE,
            None,
        )
        .unwrap()
        .0,
    );
    let mut sum = 0.0;
    for b in 0..B {
        let part = XTokenBatch {
            batch: 1,
            student_chunk: x.student_chunk[b * TS..(b + 1) * TS].to_vec(),
            teacher_chunk: x.teacher_chunk[b * TT..(b + 1) * TT].to_vec(),
            num_chunks: vec![x.num_chunks[b]],
            teacher_topk_ids: x.teacher_topk_ids[b * TT * K..(b + 1) * TT * K].to_vec(),
            teacher_topk_logprobs: x.teacher_topk_logprobs[b * TT * K..(b + 1) * TT * K].to_vec(),
            ..x.clone()
        };
        let z = tensor(
            &zs[b * TS * VL..(b + 1) * TS * VL],
            &[1, TS, VL],
            DType::F64,
        );
        sum += scalar(
            &pkl_loss(
                &z,
                &part,
                &p,
                Anchor::First,
                TailMode::Bucket,
                Temperature::ONE,
                Some(normalizer(6.0)),
            )
            .unwrap()
            .0,
        );
    }
    assert!((sum - full).abs() < 1e-10, "{sum} vs {full}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let (x, zs) = fixture(6, 1.0);
    let p = projection();
    let z = tensor(&zs, &[B, TS, VL], DType::F32);
    let mut bad = x.clone();
    bad.teacher_topk_ids[0] = VT as u32;
    assert!(pkl_loss(
        &z,
        &bad,
        &p,
        Anchor::First,
        TailMode::Bucket,
        Temperature::ONE,
        None
    )
    .is_err());
    let mut bad = x.clone();
    bad.teacher_topk_logprobs.truncate(3);
    assert!(gold_loss(&z, &bad, &p, 1.0, 1.0, Temperature::ONE, None).is_err());
    let mut bad = x.clone();
    bad.student_targets.clear();
    assert!(gold_loss(&z, &bad, &p, 1.0, 1.0, Temperature::ONE, None).is_err());
    let narrow = tensor(&zs[..B * TS * 4], &[B, TS, 4], DType::F32);
    assert!(pkl_loss(
        &narrow,
        &x,
        &p,
        Anchor::First,
        TailMode::Bucket,
        Temperature::ONE,
        None
    )
    .is_err());
    assert!(
        Normalizer::new(0.0).is_err(),
        "a bad normalizer cannot reach the loss"
    );
    // No chunk with both sides: a zero loss, not an error.
    let empty = XTokenBatch {
        teacher_chunk: vec![-1; B * TT],
        ..x.clone()
    };
    let (l, m) = pkl_loss(
        &z,
        &empty,
        &p,
        Anchor::First,
        TailMode::Bucket,
        Temperature::ONE,
        None,
    )
    .unwrap();
    let m = m.read().unwrap();
    assert_eq!((scalar(&l), m.count), (0.0, 0.0));
}

#[test]
fn pkl_bucket_penalises_student_mass_outside_the_teacher_top_k() {
    // Two students with the same distribution *inside* each chunk's K (up to a factor): the one
    // that moves mass outside K (onto student ids 4.., which map to teacher ids outside K) has a
    // larger bucket loss, while NeMo's renormalised P-KL cannot tell them apart.
    let (mut x, zs) = fixture(7, 1.0);
    // Every K is teacher ids {0, 1, 2}; student ids 3 and 4 map only outside it.
    for (i, id) in x.teacher_topk_ids.iter_mut().enumerate() {
        *id = (i % K) as u32;
    }
    let p = projection();
    let loss = |z: &[f64], tail| {
        scalar(
            &pkl_loss(
                &tensor(z, &[B, TS, VL], DType::F64),
                &x,
                &p,
                Anchor::First,
                tail,
                Temperature::ONE,
                None,
            )
            .unwrap()
            .0,
        )
    };
    let outside: Vec<usize> = (0..VS)
        .filter(|&s| p.row(s).0.iter().all(|&u| u as usize >= K))
        .collect();
    assert_eq!(outside, vec![3, 4]);
    // At every position, give ids 3 and 4 together a share `f` of the mass: the distribution
    // over the other ids keeps its shape, scaled by 1 − f.
    let with_outside_share = |f: f64| {
        let mut z = zs.clone();
        for r in 0..B * TS {
            let row = &mut z[r * VL..r * VL + VS];
            let inside: f64 = (0..VS)
                .filter(|s| !outside.contains(s))
                .map(|s| row[s].exp())
                .sum();
            for &s in &outside {
                row[s] = (f / (1.0 - f) * inside / outside.len() as f64).ln();
            }
        }
        z
    };
    let (low, high) = (with_outside_share(0.05), with_outside_share(0.9));
    let (r0, r1) = (
        loss(&low, TailMode::Renormalize),
        loss(&high, TailMode::Renormalize),
    );
    assert!((r0 - r1).abs() < 1e-7, "renormalised: {r0} vs {r1}");
    let (b0, b1) = (loss(&low, TailMode::Bucket), loss(&high, TailMode::Bucket));
    assert!(b1 > b0 + 0.1, "bucket: {b0} -> {b1}");
}

/// Teacher id → first student token for the fixture: ids 3 and 4 share first token 3, id 6 has
/// none (its mass belongs to the teacher's tail).
const FIRST: [Option<u32>; VT] = [Some(0), Some(1), Some(2), Some(3), Some(3), Some(5), None];

pub(crate) fn projection_with_first() -> Projection {
    projection().with_teacher_first(FIRST.to_vec()).unwrap()
}

/// First-token KL by the definition, in f64 with naive loops.
fn ref_first_kl(x: &XTokenBatch, zs: &[f64], tau: f64) -> f64 {
    let chunks = ref_chunks(x);
    let mut total = 0.0;
    for (b, s, t) in &chunks {
        let (ids, l) = teacher_row(x, *b, t[0]);
        let p = student_probs(zs, *b, s[0], tau);
        let mut groups: Vec<(usize, f64)> = vec![];
        for (j, &u) in ids.iter().enumerate() {
            if let Some(g) = FIRST[u] {
                let g = g as usize;
                match groups.iter_mut().find(|e| e.0 == g) {
                    Some(e) => e.1 += l[j].exp(),
                    None => groups.push((g, l[j].exp())),
                }
            }
        }
        let t_tail = (1.0 - groups.iter().map(|e| e.1).sum::<f64>()).max(1e-6);
        let s_tail = (1.0 - groups.iter().map(|e| p[e.0]).sum::<f64>()).max(1e-6);
        total += groups
            .iter()
            .map(|&(g, pt)| pt * (pt.ln() - p[g].ln()))
            .sum::<f64>()
            + t_tail * (t_tail.ln() - s_tail.ln());
    }
    tau * tau * total / chunks.len() as f64
}

#[test]
fn first_kl_matches_reference_and_finite_differences() {
    let p = projection_with_first();
    for (seed, tau) in [(2, 1.0), (3, 2.0), (8, 0.7)] {
        let (x, zs) = fixture(seed, tau);
        let want = ref_first_kl(&x, &zs, tau);
        assert!(want > 0.0, "a proper KL of two different distributions");
        for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 2e-5)] {
            let (l, m) = first_kl_loss(
                &tensor(&zs, &[B, TS, VL], dtype),
                &x,
                &p,
                temperature(tau),
                None,
            )
            .unwrap();
            let m = m.read().unwrap();
            assert!(
                (scalar(&l) - want).abs() < tol * want.abs().max(1e-3),
                "{dtype:?} τ={tau}: {} vs {want}",
                scalar(&l)
            );
            assert_eq!(m.count, ref_chunks(&x).len() as f64);
        }
        let v = var(&zs, &[B, TS, VL]);
        let (l, _) = first_kl_loss(v.as_tensor(), &x, &p, temperature(tau), None).unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let fd = numeric_grad(&zs, 1e-5, |z| ref_first_kl(&x, z, tau));
        assert_close(&g, &fd, 1e-7, "first_kl grad");
        // Only each chunk's first student position gets a gradient, never the padded column.
        let firsts: Vec<usize> = ref_chunks(&x)
            .iter()
            .map(|(b, s, _)| b * TS + s[0])
            .collect();
        for r in 0..B * TS {
            let row = &g[r * VL..(r + 1) * VL];
            assert_eq!(row[VS], 0.0);
            if !firsts.contains(&r) {
                assert!(
                    row.iter().all(|&v| v == 0.0),
                    "row {r} is not a chunk's first"
                );
            }
        }
    }
}

#[test]
fn first_kl_rewards_the_first_piece_of_a_long_teacher_token() {
    // One chunk, teacher certain of id 4, a token no student token spells (W's column 4 only
    // holds partial weights) but whose re-tokenisation starts with student token 3. First-token
    // KL is lowest when the student puts its mass on 3.
    let (mut x, _) = fixture(9, 1.0);
    for (i, (id, lp)) in x
        .teacher_topk_ids
        .iter_mut()
        .zip(x.teacher_topk_logprobs.iter_mut())
        .enumerate()
    {
        (*id, *lp) = match i % K {
            0 => (4, (0.98f32).ln()),
            1 => (0, (0.01f32).ln()),
            _ => (1, (0.005f32).ln()),
        };
    }
    let p = projection_with_first();
    let loss_with_peak_on = |s: usize| {
        let mut z = vec![0.0; B * TS * VL];
        for r in 0..B * TS {
            z[r * VL + s] = 8.0;
        }
        scalar(
            &first_kl_loss(
                &tensor(&z, &[B, TS, VL], DType::F64),
                &x,
                &p,
                Temperature::ONE,
                None,
            )
            .unwrap()
            .0,
        )
    };
    let on_first_piece = loss_with_peak_on(3);
    for other in [0, 1, 2, 4, 5, 6, 7, 8] {
        assert!(
            on_first_piece < loss_with_peak_on(other),
            "peak on 3: {on_first_piece}, on {other}: {}",
            loss_with_peak_on(other)
        );
    }
    // Without the first-token map the loss refuses to run rather than guess.
    let (x2, zs) = fixture(2, 1.0);
    assert!(first_kl_loss(
        &tensor(&zs, &[B, TS, VL], DType::F64),
        &x2,
        &projection(),
        Temperature::ONE,
        None
    )
    .is_err());
    assert!(projection().with_teacher_first(vec![None; VT - 1]).is_err());
    assert!(projection()
        .with_teacher_first(vec![Some(VS as u32); VT])
        .is_err());
}
