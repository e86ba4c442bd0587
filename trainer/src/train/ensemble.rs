//! The target of a same-tokenizer ensemble: the weighted mixture, in probability space, of
//! several teachers' next-token distributions, exact on a per-row set of ids.
//!
//! 1. [`union_ids`]: per row, the union of the teachers' top-k ids, padded to one width `m` for
//!    the whole request (with the smallest ids outside the union, so every entry stays exact).
//! 2. Every teacher scores those ids (the protocol's candidate `ids`: full-vocabulary log-probs).
//! 3. [`mix`]: `log p_mix(v) = log Σ_t w_t p_t(v)` at each id, and at the target token. Each
//!    teacher's mass outside the set is `1 − Σ_v p_t(v)`, so the mixture's mass outside it is
//!    `1 − Σ_v p_mix(v)`: the tail bucket of the top-k losses (`tail = "bucket"`) is exactly the
//!    mixture's tail.
//!
//! The result is laid out as a top-k answer with `k = m` (sorted by descending value), so the
//! same-tokenizer loss code trains on it unchanged.

use xdistill_shared::protocol::SequenceScores;

/// Step 1: per sequence and row, the union of the teachers' top-k ids (in order of first
/// appearance), padded to the request's widest union with the smallest ids outside it.
/// `answers[t][s]` is teacher `t`'s top-k answer for sequence `s`. Shape: `[S][rows][m]`.
pub fn union_ids(answers: &[&[SequenceScores]]) -> Vec<Vec<Vec<u32>>> {
    let Some(first) = answers.first() else {
        return vec![];
    };
    let mut out: Vec<Vec<Vec<u32>>> = (0..first.len())
        .map(|s| {
            (0..first[s].rows)
                .map(|r| {
                    let mut row: Vec<u32> = Vec::new();
                    for a in answers {
                        for &id in a[s].ids_row(r) {
                            if !row.contains(&id) {
                                row.push(id);
                            }
                        }
                    }
                    row
                })
                .collect()
        })
        .collect();
    let m = out.iter().flatten().map(Vec::len).max().unwrap_or(0);
    for row in out.iter_mut().flatten() {
        let mut next = 0u32;
        while row.len() < m {
            if !row.contains(&next) {
                row.push(next);
            }
            next += 1;
        }
    }
    out
}

/// Step 3: the mixture at the scored ids. `scored[t][s]` is teacher `t`'s answer for sequence `s`
/// to the request whose candidate ids were `ids[s]` (its `ids_logprobs` are `[rows, m]`,
/// `target_logprobs` `[rows]`); `weights` sum to 1. Returns one top-k-shaped answer per sequence
/// with `k = m` (values sorted descending, ties by id), the mixture's log-prob of the target
/// token, and `logsumexp` 0 (the values are normalised log-probs).
pub fn mix(
    ids: &[Vec<Vec<u32>>],
    scored: &[&[SequenceScores]],
    weights: &[f64],
) -> Vec<SequenceScores> {
    let log_w: Vec<f64> = weights.iter().map(|w| w.ln()).collect();
    // log Σ_t w_t exp(lp_t), in f64.
    let mixture = |lps: &mut dyn Iterator<Item = f32>| -> f32 {
        let terms: Vec<f64> = lps.zip(&log_w).map(|(lp, lw)| lw + lp as f64).collect();
        let hi = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if hi == f64::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        (hi + terms.iter().map(|x| (x - hi).exp()).sum::<f64>().ln()) as f32
    };
    ids.iter()
        .enumerate()
        .map(|(s, rows)| {
            let m = rows.first().map_or(0, Vec::len);
            let n = rows.len();
            let mut out = SequenceScores {
                rows: n,
                k: m,
                topk_ids: Vec::with_capacity(n * m),
                topk_values: Vec::with_capacity(n * m),
                target_logprobs: Vec::with_capacity(n),
                logsumexp: vec![0.0; n],
                ..Default::default()
            };
            for (r, row) in rows.iter().enumerate() {
                let mut entries: Vec<(u32, f32)> = (0..m)
                    .map(|j| {
                        let lp = mixture(&mut scored.iter().map(|a| a[s].ids_logprobs_row(r)[j]));
                        (row[j], lp)
                    })
                    .collect();
                entries.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                out.topk_ids.extend(entries.iter().map(|e| e.0));
                out.topk_values.extend(entries.iter().map(|e| e.1));
                out.target_logprobs
                    .push(mixture(&mut scored.iter().map(|a| a[s].target_logprobs[r])));
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A teacher's full log-softmax rows `[rows][V]`, in f64.
    fn random_rows(rng: &mut ChaCha8Rng, rows: usize, v: usize, sharp: f64) -> Vec<Vec<f64>> {
        (0..rows)
            .map(|_| {
                let z: Vec<f64> = (0..v).map(|_| sharp * rng.random::<f64>()).collect();
                let lse = z.iter().map(|x| x.exp()).sum::<f64>().ln();
                z.iter().map(|x| x - lse).collect()
            })
            .collect()
    }

    /// What a teacher server answers for these rows: top-k (by a host sort), target, and the
    /// log-probs at candidate ids.
    fn answer(
        full: &[Vec<f64>],
        k: usize,
        targets: &[u32],
        ids: Option<&[Vec<u32>]>,
    ) -> SequenceScores {
        let mut s = SequenceScores {
            rows: full.len(),
            k,
            ..Default::default()
        };
        for (r, row) in full.iter().enumerate() {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            for &i in &order[..k] {
                s.topk_ids.push(i as u32);
                s.topk_values.push(row[i] as f32);
            }
            s.target_logprobs.push(row[targets[r] as usize] as f32);
            s.logsumexp.push(0.0);
            if let Some(ids) = ids {
                s.m = ids[r].len();
                s.ids_logprobs
                    .extend(ids[r].iter().map(|&i| row[i as usize] as f32));
            }
        }
        s
    }

    /// The ensemble's target equals the mixture of the teachers' full distributions computed in
    /// f64: at every id of the row's set, at the target, and in the tail (the mass outside the
    /// set), on a tiny vocabulary with teachers that disagree.
    #[test]
    fn mixture_equals_the_f64_mixture_of_full_distributions() {
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        let (v, rows, seqs) = (11, 5, 3);
        let ks = [3usize, 4, 2];
        let weights = [0.5, 0.3, 0.2];
        // [teacher][seq][row][V]
        let full: Vec<Vec<Vec<Vec<f64>>>> = (0..3)
            .map(|t| {
                (0..seqs)
                    .map(|_| random_rows(&mut rng, rows, v, 2.0 + t as f64))
                    .collect()
            })
            .collect();
        let targets: Vec<Vec<u32>> = (0..seqs)
            .map(|_| (0..rows).map(|_| rng.random_range(0..v as u32)).collect())
            .collect();
        let topk: Vec<Vec<SequenceScores>> = (0..3)
            .map(|t| {
                (0..seqs)
                    .map(|s| answer(&full[t][s], ks[t], &targets[s], None))
                    .collect()
            })
            .collect();
        let refs: Vec<&[SequenceScores]> = topk.iter().map(Vec::as_slice).collect();
        let ids = union_ids(&refs);
        let m = ids[0][0].len();
        for (s, seq) in ids.iter().enumerate() {
            for (r, row) in seq.iter().enumerate() {
                assert_eq!(row.len(), m, "one width for the request");
                let mut dedup = row.clone();
                dedup.sort();
                dedup.dedup();
                assert_eq!(dedup.len(), m, "ids are distinct");
                for (t, answers) in topk.iter().enumerate() {
                    for id in answers[s].ids_row(r) {
                        assert!(row.contains(id), "union holds teacher {t}'s top-k");
                    }
                }
            }
        }
        let scored: Vec<Vec<SequenceScores>> = (0..3)
            .map(|t| {
                (0..seqs)
                    .map(|s| answer(&full[t][s], 0, &targets[s], Some(&ids[s])))
                    .collect()
            })
            .collect();
        let refs: Vec<&[SequenceScores]> = scored.iter().map(Vec::as_slice).collect();
        let mixed = mix(&ids, &refs, &weights);
        for s in 0..seqs {
            let out = &mixed[s];
            assert_eq!((out.rows, out.k), (rows, m));
            for r in 0..rows {
                let p_mix: Vec<f64> = (0..v)
                    .map(|i| (0..3).map(|t| weights[t] * full[t][s][r][i].exp()).sum())
                    .collect();
                let vals = out.values_row(r);
                assert!(vals.windows(2).all(|w| w[0] >= w[1]), "sorted");
                let mut inside = 0.0;
                for (&id, &lp) in out.ids_row(r).iter().zip(vals) {
                    let want = p_mix[id as usize];
                    assert!(
                        (lp as f64 - want.ln()).abs() < 1e-5,
                        "row {r} id {id}: {lp} vs {}",
                        want.ln()
                    );
                    inside += want;
                }
                let tail_ref = 1.0 - inside;
                let tail = 1.0 - vals.iter().map(|&x| (x as f64).exp()).sum::<f64>();
                assert!((tail - tail_ref).abs() < 1e-6, "tail {tail} vs {tail_ref}");
                let t = targets[s][r] as usize;
                assert!((out.target_logprobs[r] as f64 - p_mix[t].ln()).abs() < 1e-5);
            }
        }
    }
}
