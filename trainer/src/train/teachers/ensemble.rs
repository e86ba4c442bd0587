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
//!
//! Teachers with other tokenizers are mixed at the chunk level instead ([`chunk_item`],
//! [`mix_first_tokens`]): at every student position where a chunk starts for *every* teacher,
//! each teacher's top-k at the row predicting its chunk's first token is grouped by the first
//! student token of each teacher token (first_kl's projection; the identity for a teacher that
//! shares the student's tokenizer), and the groups' probabilities are mixed,
//! `P_mix[g] = Σ_t w_t P_t[g]`, the rest `Σ_t w_t T_t` being the tail. That target is written as
//! a virtual teacher in the student's own tokenization (identity projection) with one chunk per
//! common chunk, and trained with first_kl.
//!
//! `Teachers::score_mixture` and `Teachers::score_chunk_mixture` ask the teachers (all at
//! once, on the pool) and apply these steps.

use super::score::Scores;
use super::Group;
use super::{Source, Teachers};
use crate::align::{Chunk, TokenizedPair};
use crate::loss::xtoken::GroupedMass;
use crate::train::pairing::Item;
use std::collections::BTreeMap;
use xdistill_shared::protocol::{SequenceScores, TopkRequest};

impl Teachers {
    /// The same-tokenizer mixture's answers to `req`: every teacher's top-k (each with its own
    /// k) together, then every teacher's log-probs at the union together, mixed ([`mix`]).
    pub(super) async fn score_mixture(&self, req: &TopkRequest) -> Scores {
        let topk = self
            .ask_every_teacher(|i| TopkRequest {
                k: self.list[i].cfg.k,
                ..req.clone()
            })
            .await?;
        let refs: Vec<&[SequenceScores]> = topk.iter().map(Vec::as_slice).collect();
        let ids = union_ids(&refs);
        let scored = self
            .ask_every_teacher(|_| TopkRequest {
                k: 0,
                ids: Some(ids.clone()),
                ..req.clone()
            })
            .await?;
        let refs: Vec<&[SequenceScores]> = scored.iter().map(Vec::as_slice).collect();
        Ok(mix(&ids, &refs, &self.weights()))
    }

    /// The chunk-level mixture's answers for group `g`: every teacher scores its own
    /// tokenization of the records (`g.parts`), all together; then, per item, the teachers'
    /// first-token groups are mixed at every common chunk ([`mix_first_tokens`]) and written as
    /// the virtual teacher's answer ([`virtual_answer`]).
    pub(super) async fn score_chunk_mixture(&self, g: &Group) -> Scores {
        let answers = self
            .ask_every_teacher(|i| {
                let seqs = g.parts[i]
                    .iter()
                    .map(|it| it.teacher_ids().to_vec())
                    .collect();
                self.request(Source::One(i), seqs, None)
            })
            .await?;
        let weights = self.weights();
        let firsts: Vec<Box<dyn Fn(u32) -> Option<u32> + '_>> = self
            .list
            .iter()
            .map(|t| -> Box<dyn Fn(u32) -> Option<u32> + '_> {
                match &t.projection {
                    Some(p) => Box::new(move |u| p.teacher_first(u as usize)),
                    None => Box::new(Some),
                }
            })
            .collect();
        let first_refs: Vec<&dyn Fn(u32) -> Option<u32>> =
            firsts.iter().map(|f| f.as_ref()).collect();
        let mut rows_per_item = vec![];
        for (r, item) in g.items.iter().enumerate() {
            let Some((pair, _)) = item.aligned() else {
                unreachable!("a chunk-level ensemble's items are aligned")
            };
            let starts: Vec<BTreeMap<usize, usize>> =
                g.parts.iter().map(|p| item_starts(&p[r])).collect();
            let scored: Vec<&SequenceScores> = answers.iter().map(|a| &a[r]).collect();
            let rows: Vec<(usize, Vec<(u32, f64)>)> = chunk_rows(pair)
                .into_iter()
                .map(|j| {
                    (
                        j,
                        mix_first_tokens(j, &starts, &scored, &first_refs, &weights),
                    )
                })
                .collect();
            rows_per_item.push((pair.student_ids.len(), rows));
        }
        let m = rows_per_item
            .iter()
            .flat_map(|(_, rows)| rows.iter().map(|(_, g)| g.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(rows_per_item
            .iter()
            .map(|(n, rows)| virtual_answer(*n, rows, m))
            .collect())
    }

    /// Every teacher asked its own request (`make(i)` for teacher `i`), all at once.
    async fn ask_every_teacher(
        &self,
        make: impl Fn(usize) -> TopkRequest,
    ) -> std::result::Result<Vec<Vec<SequenceScores>>, super::ScoreError> {
        let reqs: Vec<(usize, TopkRequest)> = (0..self.list.len()).map(|i| (i, make(i))).collect();
        self.pool.ask_each(&reqs).await
    }

    /// The teachers' normalised weights, in teacher order.
    fn weights(&self) -> Vec<f64> {
        self.list.iter().map(|t| t.weight).collect()
    }
}

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

/// A teacher's chunk starts in its item (student token index → first teacher token index).
pub fn item_starts(item: &Item) -> BTreeMap<usize, usize> {
    chunk_starts(item.aligned().map(|(p, _)| p), item.student_ids().len())
}

/// The chunk-level ensemble's record from every teacher's tokenization of it: the first aligned
/// one is the reference; all must agree on the student's tokens.
pub fn virtual_item(each: &[Item]) -> std::result::Result<Item, String> {
    let Some((pair, loss_start)) = each.iter().find_map(Item::aligned) else {
        return Err("no teacher of the ensemble has another tokenizer".into());
    };
    if each.iter().any(|it| it.student_ids() != pair.student_ids) {
        return Err("the teachers' alignments disagree on the student's tokens (special tokens or truncation)".into());
    }
    let starts: Vec<BTreeMap<usize, usize>> = each.iter().map(item_starts).collect();
    let pair = chunk_item(pair, &starts);
    Ok(Item::Cross { pair, loss_start })
}

/// One teacher's side of a record in a chunk-level ensemble: for each student token index where
/// one of its chunks starts, the index of its first teacher token (a same-tokenizer teacher: the
/// same index).
pub fn chunk_starts(pair: Option<&TokenizedPair>, student_len: usize) -> BTreeMap<usize, usize> {
    match pair {
        Some(p) => p
            .chunks
            .iter()
            .map(|c| (c.student.start, c.teacher.start))
            .collect(),
        None => (0..student_len).map(|j| (j, j)).collect(),
    }
}

/// The virtual teacher's record: the student's tokens on both sides, one chunk per run of
/// `reference`'s chunks between consecutive common starts (student indices where a chunk
/// starts for every teacher, `starts[t]`), kept only where every teacher has a row predicting
/// the chunk's first token (its first teacher token is not at index 0) — the BOS-like first
/// chunk is kept for the cross-entropy's start and never distilled ([`chunk_rows`] lists the
/// distilled starts).
pub fn chunk_item(reference: &TokenizedPair, starts: &[BTreeMap<usize, usize>]) -> TokenizedPair {
    let common = |j: usize| starts.iter().all(|s| s.contains_key(&j));
    let has_rows = |j: usize| starts.iter().all(|s| s.get(&j).is_some_and(|&a| a > 0));
    let mut merged: Vec<Chunk> = vec![];
    for c in &reference.chunks {
        match merged.last_mut() {
            Some(m) if !common(c.student.start) => {
                m.student.end = c.student.end;
                m.teacher.end = c.student.end;
                m.bytes.end = m.bytes.end.max(c.bytes.end);
            }
            _ => merged.push(Chunk {
                student: c.student.clone(),
                teacher: c.student.clone(),
                bytes: c.bytes.clone(),
                kind: c.kind,
            }),
        }
    }
    merged
        .retain(|c| c.student.start == 0 || (common(c.student.start) && has_rows(c.student.start)));
    TokenizedPair {
        text: reference.text.clone(),
        student_ids: reference.student_ids.clone(),
        teacher_ids: reference.student_ids.clone(),
        chunks: merged,
        truncated: reference.truncated,
    }
}

/// The virtual teacher's rows to fill: the starts (> 0) of its chunks.
pub fn chunk_rows(pair: &TokenizedPair) -> Vec<usize> {
    pair.chunks
        .iter()
        .map(|c| c.student.start)
        .filter(|&j| j > 0)
        .collect()
}

/// The first-token mixture at student index `j` (a chunk start for every teacher): teacher `t`'s
/// top-k at its row `starts[t][j] − 1`, each id's probability added to the group of its first
/// student token (`first[t]`; ids without one go to the tail), the groups mixed with `weights`.
/// Returns the groups `(student id, P_mix)` in order of first appearance.
pub fn mix_first_tokens(
    j: usize,
    starts: &[BTreeMap<usize, usize>],
    answers: &[&SequenceScores],
    first: &[&dyn Fn(u32) -> Option<u32>],
    weights: &[f64],
) -> Vec<(u32, f64)> {
    let mut groups = GroupedMass::default();
    for t in 0..answers.len() {
        let row = starts[t][&j] - 1;
        for (&u, &lp) in answers[t]
            .ids_row(row)
            .iter()
            .zip(answers[t].values_row(row))
        {
            let Some(g) = first[t](u) else { continue };
            let p = weights[t] * (lp as f64).exp();
            groups.add(g, p);
        }
    }
    groups.into_vec()
}

/// The virtual teacher's answer over `student_len` tokens: at row `j − 1` of each mixed start
/// the groups sorted by descending probability as log-probs, padded to `m` with the first
/// group's id at probability 0 (first_kl merges repeated ids, so padding changes nothing);
/// every other row is never read (id 0, log-prob 0).
pub fn virtual_answer(
    student_len: usize,
    rows: &[(usize, Vec<(u32, f64)>)],
    m: usize,
) -> SequenceScores {
    let n = student_len.saturating_sub(1);
    let mut out = SequenceScores {
        rows: n,
        k: m,
        topk_ids: vec![0; n * m],
        topk_values: vec![0.0; n * m],
        target_logprobs: vec![0.0; n],
        logsumexp: vec![0.0; n],
        ..Default::default()
    };
    for (j, groups) in rows {
        let mut g = groups.clone();
        g.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let pad = g.first().map_or(0, |e| e.0);
        let dst = (j - 1) * m;
        for i in 0..m {
            let (id, lp) = g
                .get(i)
                .map_or((pad, f32::NEG_INFINITY), |e| (e.0, e.1.ln() as f32));
            out.topk_ids[dst + i] = id;
            out.topk_values[dst + i] = lp;
        }
    }
    out
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

    fn chunk(
        s: std::ops::Range<usize>,
        t: std::ops::Range<usize>,
        b: std::ops::Range<usize>,
    ) -> Chunk {
        Chunk {
            student: s,
            teacher: t,
            bytes: b,
            kind: crate::align::ChunkKind::Text,
        }
    }

    /// Two teachers whose chunks start at different student tokens: the virtual record keeps
    /// the starts common to both (and to a same-tokenizer teacher, which starts everywhere), one
    /// chunk per run between them; its rows hold the first-token mixture computed in f64 by hand.
    #[test]
    fn chunk_mixture_keeps_common_starts_and_mixes_first_tokens() {
        // Student tokens 0..6 (0 = BOS), bytes: 1 → 0..1, 2 → 1..3, 3 → 3..4, 4 → 4..6, 5 → 6..7.
        let a = TokenizedPair {
            text: "abcdefg".into(),
            student_ids: vec![1, 10, 11, 12, 13, 14],
            teacher_ids: vec![0, 100, 101, 102, 103],
            chunks: vec![
                chunk(0..1, 0..1, 0..0),
                chunk(1..3, 1..2, 0..3),
                chunk(3..4, 2..3, 3..4),
                chunk(4..6, 3..5, 4..7),
            ],
            truncated: false,
        };
        // Teacher b: chunks start at student 1, 3 and 5 (no BOS of its own: first token at 0).
        let b = TokenizedPair {
            teacher_ids: vec![200, 201, 202],
            chunks: vec![
                chunk(1..3, 0..1, 0..3),
                chunk(3..5, 1..2, 3..6),
                chunk(5..6, 2..3, 6..7),
            ],
            ..a.clone()
        };
        let starts = vec![
            chunk_starts(Some(&a), 6),
            chunk_starts(Some(&b), 6),
            chunk_starts(None, 6),
        ];
        let v = chunk_item(&a, &starts);
        // Common starts: 1 (b's first token is at index 0: no row, dropped), 3; 4 and 5 are not
        // common; the BOS chunk stays for the cross-entropy.
        let spans: Vec<_> = v
            .chunks
            .iter()
            .map(|c| (c.student.clone(), c.bytes.clone()))
            .collect();
        assert_eq!(spans, [(0..1, 0..0), (3..6, 3..7)]);
        assert!(v.chunks.iter().all(|c| c.student == c.teacher));
        assert_eq!(v.teacher_ids, v.student_ids);
        assert_eq!(chunk_rows(&v), [3]);
        // Answers: a's row 1 (predicting its token 2), b's row 0, the same teacher's row 2.
        let answer = |rows: usize, k: usize, at: usize, ids: &[u32], lps: &[f32]| {
            let mut s = SequenceScores {
                rows,
                k,
                topk_ids: vec![0; rows * k],
                topk_values: vec![0.0; rows * k],
                target_logprobs: vec![0.0; rows],
                logsumexp: vec![0.0; rows],
                ..Default::default()
            };
            s.topk_ids[at * k..at * k + k].copy_from_slice(ids);
            s.topk_values[at * k..at * k + k].copy_from_slice(lps);
            s
        };
        let (la, lb, ls) = (
            [0.5f32.ln(), 0.3f32.ln(), 0.1f32.ln()],
            [0.6f32.ln(), 0.4f32.ln(), 0.0f32.ln() - 9.0],
            [0.7f32.ln(), 0.2f32.ln(), 0.05f32.ln()],
        );
        let ans_a = answer(4, 3, 1, &[101, 102, 103], &la);
        let ans_b = answer(2, 3, 0, &[201, 200, 202], &lb);
        let ans_s = answer(5, 3, 2, &[12, 13, 14], &ls);
        // First student tokens: a's 101 → 12, 102 → 12, 103 → none; b's 201 → 12, 200 → 13, 202 → 14.
        let fa = |u: u32| match u {
            101 | 102 => Some(12),
            _ => None,
        };
        let fb = |u: u32| match u {
            201 => Some(12),
            200 => Some(13),
            202 => Some(14),
            _ => None,
        };
        let id = |u: u32| Some(u);
        let first: Vec<&dyn Fn(u32) -> Option<u32>> = vec![&fa, &fb, &id];
        let w = [0.5, 0.3, 0.2];
        let got = mix_first_tokens(3, &starts, &[&ans_a, &ans_b, &ans_s], &first, &w);
        let p = |x: f32| (x as f64).exp();
        let want: Vec<(u32, f64)> = vec![
            (
                12,
                w[0] * (p(la[0]) + p(la[1])) + w[1] * p(lb[0]) + w[2] * p(ls[0]),
            ),
            (13, w[1] * p(lb[1]) + w[2] * p(ls[1])),
            (14, w[1] * p(lb[2]) + w[2] * p(ls[2])),
        ];
        assert_eq!(got.len(), 3);
        for ((g, x), (h, y)) in got.iter().zip(&want) {
            assert_eq!(g, h);
            assert!((x - y).abs() < 1e-12, "{g}: {x} vs {y}");
        }
        // Laid out at row 2 (predicting student token 3), sorted, padded with a zero-mass repeat.
        let out = virtual_answer(6, &[(3, got)], 4);
        assert_eq!((out.rows, out.k), (5, 4));
        assert_eq!(out.ids_row(2), [12, 13, 14, 12]);
        assert!((out.values_row(2)[0] as f64 - want[0].1.ln()).abs() < 1e-6);
        assert_eq!(out.values_row(2)[3], f32::NEG_INFINITY);
    }
}
