//! The device path over a packed forward's rows ([`Scorer::score_packed`]): the rows of every
//! sequence that asks the same question (k, temperature, kind of values, ranks, candidates'
//! width) are gathered into blocks of exactly [`Scorer::chunk_rows`] rows, the last one padded,
//! and each block takes one LM-head matmul, one top-k launch and one copy back, instead of a
//! chunk per sequence. Shapes are fixed and every kernel after the matmul works per row, so a
//! row's scores are the same bits whatever else fills its block: a sequence's answer does not
//! depend on its batch (though it is not the per-sequence path's, another matmul shape).

use super::{device, CandidateRows, Phase, Scorer, ScoringError, SeqRef, Timing};
use crate::request::ScoreParams;
use candle_core::Tensor;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

/// A sequence of a packed forward: its rows are `hidden[at..at + S - 1]`.
#[derive(Clone, Copy)]
pub struct PackedRows<'a> {
    pub seq: SeqRef<'a>,
    pub at: usize,
}

/// What a row is asked: rows asking the same share blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Question {
    k: usize,
    temperature: u32,
    values: xdistill_shared::protocol::ValuesKind,
    ranks: bool,
    m: usize,
}

impl Question {
    fn of(seq: &SeqRef<'_>) -> Question {
        let p = seq.params;
        Question {
            k: p.k,
            temperature: p.temperature.to_bits(),
            values: p.values,
            ranks: p.ranks,
            m: seq.candidates.map_or(0, |c| c.m),
        }
    }
}

impl Scorer {
    /// Whether [`Scorer::score_packed`] scores `seq`: top-k rows on the device (no hidden
    /// states, no next row).
    pub fn packs(&self, seq: &SeqRef<'_>) -> bool {
        self.scores_on_device(seq.params) && !seq.params.hidden && seq.params.next.is_none()
    }

    /// The scores of `seqs` (each [`Scorer::packs`]) from the packed forward's `hidden`
    /// `[rows, H]`, in their order. A block that fails fails the sequences with rows in it.
    pub fn score_packed(
        &self,
        decoder: &Decoder,
        hidden: &Tensor,
        seqs: &[PackedRows<'_>],
        timing: &mut Timing,
    ) -> Vec<Result<SequenceScores, ScoringError>> {
        let mut out: Vec<Result<SequenceScores, ScoringError>> =
            seqs.iter().map(|s| Ok(s.seq.empty())).collect();
        // Sequences by question, in order of first appearance.
        let mut groups: Vec<(Question, Vec<usize>)> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let q = Question::of(&s.seq);
            match groups.iter_mut().find(|(g, _)| *g == q) {
                Some((_, members)) => members.push(i),
                None => groups.push((q, vec![i])),
            }
        }
        for (_, members) in &groups {
            // (sequence, position) of every row asked, sequence by sequence.
            let rows: Vec<(usize, usize)> = members
                .iter()
                .flat_map(|&i| {
                    let seq = &seqs[i].seq;
                    (seq.start..seq.ids.len() - 1).map(move |p| (i, p))
                })
                .collect();
            for block in rows.chunks(self.chunk_rows.max(1)) {
                match self.score_block(decoder, hidden, seqs, block, timing) {
                    Ok(s) => {
                        for (r, &(i, _)) in block.iter().enumerate() {
                            if let Ok(acc) = &mut out[i] {
                                push_row(acc, &s, r);
                            }
                        }
                    }
                    Err(e) => {
                        for &(i, _) in block {
                            out[i] = Err(e.clone());
                        }
                    }
                }
            }
        }
        // No result with a non-finite value: the sequence fails with the cause.
        for (s, res) in seqs.iter().zip(out.iter_mut()) {
            let Ok(acc) = res else { continue };
            let (lo, n) = (s.seq.start, s.seq.ids.len() - 1);
            let checked = hidden
                .narrow(0, s.at + lo, n - lo)
                .map_err(ScoringError::from)
                .and_then(|rows| {
                    self.check_finite(acc, decoder, &rows, lo, s.seq.params.temperature)
                });
            if let Err(e) = checked {
                *res = Err(e);
            }
        }
        out
    }

    /// One block: `block`'s rows (sequence, position) of `hidden`, padded to
    /// [`Scorer::chunk_rows`] with copies of its first row; the scores of all of them.
    fn score_block(
        &self,
        decoder: &Decoder,
        hidden: &Tensor,
        seqs: &[PackedRows<'_>],
        block: &[(usize, usize)],
        timing: &mut Timing,
    ) -> Result<SequenceScores, ScoringError> {
        let rows = self.chunk_rows.max(block.len());
        let first = seqs[block[0].0].seq;
        let params: &ScoreParams = first.params;
        let m = Question::of(&first).m;
        let mut idx = Vec::with_capacity(rows);
        let mut targets = Vec::with_capacity(rows);
        let mut cand_ids = Vec::with_capacity(rows * m);
        for &(i, p) in block {
            let s = &seqs[i];
            idx.push((s.at + p) as u32);
            targets.push(s.seq.ids[p + 1]);
            cand_ids.extend_from_slice(s.seq.candidates(p, p + 1).ids);
        }
        // Padding: the first row again, its target and candidates (answers dropped).
        let (pad_idx, pad_target) = (idx[0], targets[0]);
        let pad_cands: Vec<u32> = cand_ids[..m].to_vec();
        while idx.len() < rows {
            idx.push(pad_idx);
            targets.push(pad_target);
            cand_ids.extend_from_slice(&pad_cands);
        }
        let states = timing.in_phase(Phase::Head, || {
            let idx = Tensor::from_vec(idx, rows, hidden.device())?;
            hidden.index_select(&idx, 0) // [R, H]
        })?;
        let logits = timing.in_phase(Phase::Head, || decoder.logits(&states))?; // [R, V]
        let cands = CandidateRows { ids: &cand_ids, m };
        let found = timing.in_phase(Phase::Topk, || {
            device::topk_on_device(&logits, &targets, cands, params, self.valid())
        })?;
        Ok(timing.in_phase(Phase::Copy, || found.into_host(&targets, params.k))?)
    }
}

/// Appends row `r` of `s` to `acc` (the same k and m).
fn push_row(acc: &mut SequenceScores, s: &SequenceScores, r: usize) {
    acc.rows += 1;
    acc.topk_ids.extend_from_slice(s.ids_row(r));
    acc.topk_values.extend_from_slice(s.values_row(r));
    acc.target_logprobs.push(s.target_logprobs[r]);
    acc.logsumexp.push(s.logsumexp[r]);
    acc.ids_logprobs.extend_from_slice(s.ids_logprobs_row(r));
    if let Some(&rank) = s.target_ranks.get(r) {
        acc.target_ranks.push(rank);
    }
}
