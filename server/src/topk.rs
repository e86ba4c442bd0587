//! Per-position top-k, target log-prob and logsumexp of logit rows (pure CPU function).
//!
//! This is the only place the scores are computed, so a device implementation can replace
//! [`score_rows`] behind the same signature.

use rayon::prelude::*;
use std::cmp::Ordering;
use xdistill_shared::protocol::{SequenceScores, ValuesKind};

/// What a request asks for, shared by all its sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    pub k: usize,
    pub temperature: f32,
    pub values: ValuesKind,
}

/// Descending by value, ascending id among equal values (deterministic tie order).
fn desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Scores of one logit row. `row`: [width] of which the first `valid` are real tokens (the rest
/// is LM-head padding: excluded from the softmax and never returned). `buf` is scratch space.
/// Returns `(ids [k], values [k], target value, logsumexp)`.
fn score_row(
    row: &[f32],
    valid: usize,
    target: u32,
    p: &ScoreParams,
    buf: &mut Vec<(f32, u32)>,
    ids: &mut [u32],
    vals: &mut [f32],
) -> (f32, f32) {
    let row = &row[..valid];
    let inv_t = 1.0 / p.temperature as f64;
    // 1. logsumexp of row / T: max in f32, sum of exponentials accumulated in f64.
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = inv_t as f32;
    let sum: f64 = row
        .chunks(1024)
        .map(|c| {
            c.iter()
                .map(|&x| ((x - m) * scale).exp() as f64)
                .sum::<f64>()
        })
        .sum();
    let lse = m as f64 * inv_t + sum.ln();
    // 2. Top-k by partial selection, then sort only the k survivors.
    buf.clear();
    buf.extend(row.iter().enumerate().map(|(i, &x)| (x, i as u32)));
    let k = p.k.min(valid);
    if k < buf.len() {
        buf.select_nth_unstable_by(k - 1, desc);
        buf.truncate(k);
    }
    buf.sort_unstable_by(desc);
    // 3. Values in f64 before the final rounding.
    let value = |x: f32| -> f32 {
        let y = x as f64 * inv_t;
        match p.values {
            ValuesKind::Logprobs => (y - lse) as f32,
            ValuesKind::Logits => y as f32,
        }
    };
    for (j, &(x, id)) in buf.iter().enumerate() {
        ids[j] = id;
        vals[j] = value(x);
    }
    let t = row
        .get(target as usize)
        .map(|&x| (x as f64 * inv_t - lse) as f32)
        .unwrap_or(f32::NEG_INFINITY);
    (t, lse as f32)
}

/// Scores `rows` logit rows. `logits`: [rows, width] row-major; `valid` ≤ width real tokens;
/// `targets`: [rows], the actual next token of each row. `p.k` must be ≤ `valid`.
pub fn score_rows(
    logits: &[f32],
    width: usize,
    valid: usize,
    targets: &[u32],
    p: &ScoreParams,
) -> SequenceScores {
    let rows = targets.len();
    debug_assert_eq!(logits.len(), rows * width);
    let valid = valid.min(width);
    let k = p.k;
    let mut out = SequenceScores {
        rows,
        k,
        topk_ids: vec![0; rows * k],
        topk_values: vec![0.0; rows * k],
        target_logprobs: vec![0.0; rows],
        logsumexp: vec![0.0; rows],
    };
    if rows == 0 || k == 0 {
        return out;
    }
    logits
        .par_chunks(width)
        .zip(targets.par_iter())
        .zip(out.topk_ids.par_chunks_mut(k))
        .zip(out.topk_values.par_chunks_mut(k))
        .zip(
            out.target_logprobs
                .par_iter_mut()
                .zip(out.logsumexp.par_iter_mut()),
        )
        .for_each_init(
            || Vec::with_capacity(valid),
            |buf, ((((row, &target), ids), vals), (tl, lse))| {
                let (t, l) = score_row(row, valid, target, p, buf, ids, vals);
                *tl = t;
                *lse = l;
            },
        );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference in f64 with a full sort (independent of the partial selection above).
    fn reference(row: &[f32], valid: usize, t: f64) -> (Vec<(usize, f64)>, f64) {
        let y: Vec<f64> = row[..valid].iter().map(|&x| x as f64 / t).collect();
        let m = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + y.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let mut all: Vec<(usize, f64)> = y.iter().map(|&v| v - lse).enumerate().collect();
        all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
        (all, lse)
    }

    fn pseudo_logits(rows: usize, width: usize) -> Vec<f32> {
        let mut s = 7u64;
        (0..rows * width)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
            })
            .collect()
    }

    #[test]
    fn matches_f64_reference_and_masks_padding() {
        let (rows, width, valid) = (5, 300, 290);
        let mut logits = pseudo_logits(rows, width);
        // Padded LM-head rows with huge logits must neither appear nor count in the softmax.
        for r in 0..rows {
            for c in valid..width {
                logits[r * width + c] = 1e4;
            }
        }
        let targets = [0u32, 7, 289, 100, 5];
        for t in [1.0f32, 0.7, 2.5] {
            let p = ScoreParams {
                k: 17,
                temperature: t,
                values: ValuesKind::Logprobs,
            };
            let s = score_rows(&logits, width, valid, &targets, &p);
            s.check_shapes().unwrap();
            for r in 0..rows {
                let (all, lse) = reference(&logits[r * width..(r + 1) * width], valid, t as f64);
                assert!((s.logsumexp[r] as f64 - lse).abs() < 1e-5 * lse.abs().max(1.0));
                for j in 0..p.k {
                    assert_eq!(s.ids_row(r)[j] as usize, all[j].0);
                    assert!((s.values_row(r)[j] as f64 - all[j].1).abs() < 1e-5);
                }
                let tl = all.iter().find(|e| e.0 == targets[r] as usize).unwrap().1;
                assert!((s.target_logprobs[r] as f64 - tl).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn logits_mode_and_ties() {
        let row = vec![1.0f32, 3.0, 3.0, -2.0, 3.0];
        let p = ScoreParams {
            k: 3,
            temperature: 2.0,
            values: ValuesKind::Logits,
        };
        let s = score_rows(&row, 5, 5, &[3], &p);
        // Equal values come in ascending id order.
        assert_eq!(s.topk_ids, vec![1, 2, 4]);
        assert_eq!(s.topk_values, vec![1.5, 1.5, 1.5]);
        // lse of [0.5, 1.5, 1.5, -1, 1.5], computed by hand in f64.
        let lse = (0.5f64.exp() + 3.0 * 1.5f64.exp() + (-1.0f64).exp()).ln();
        assert!((s.logsumexp[0] as f64 - lse).abs() < 1e-6);
        assert!((s.target_logprobs[0] as f64 - (-1.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn k_equal_to_vocab_and_zero_rows() {
        let row = vec![0.0f32, 1.0, 2.0];
        let p = ScoreParams {
            k: 3,
            temperature: 1.0,
            values: ValuesKind::Logprobs,
        };
        let s = score_rows(&row, 3, 3, &[0], &p);
        assert_eq!(s.topk_ids, vec![2, 1, 0]);
        let total: f64 = s.topk_values.iter().map(|&v| (v as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        let e = score_rows(&[], 3, 3, &[], &p);
        assert_eq!(e.rows, 0);
        e.check_shapes().unwrap();
    }
}
