//! Another tokenizer with the teacher's **whole** distribution (`teacher.transport = "hidden"`,
//! `kd = first_kl`, `pkl`, `gold` or `alm`): records are aligned as in [`super::cross`], the
//! teacher sends its hidden states, and at each aligned chunk the teacher's full log-softmax at
//! the chunk's anchor (its head applied on the student's device) is compared with the student's:
//! grouped by first student token ([`crate::loss::xtoken_full::first_kl_full`]), against the
//! chunk's projected student distribution over every teacher id
//! ([`crate::loss::xtoken_full::pkl_full`]), or by gold's exact-pair KL and whole-distribution
//! ULD ([`crate::loss::xtoken_full::gold_full`]). No top-k set. The LM head runs in the same
//! alignment-chunk pieces as [`super::cross`] ([`crate::train::xpieces`]); validation reports
//! the run's own divergence, exactly (P-KL over every teacher id for gold). ALM needs only the
//! teacher's log-probs of its own tokens: they are computed from the hidden states and the head,
//! and [`super::cross`]'s ALM runs on them (validation: P-KL over every teacher id).

use super::cross::{topk_batch, ChunkTerm, CrossBatch, CrossPieces};
use super::full_vocab::{hidden_row, target_logprobs_from_hidden};
use super::{Item, LossCtx, Purpose};
use crate::loss::full_vocab::TeacherHead;
use crate::loss::{
    kd_loss_figures, CeConfig, KdFigures, KdInputs, LossConfig, LossError, Normalizer, Projection,
    TeacherStates, XTokenFull,
};
use crate::train::micro::{MicroBatch, Part};
use anyhow::{bail, Result};
use candle_core::Tensor;
use xdistill_shared::protocol::SequenceScores;

/// Lays a cross-tokenizer micro-batch out against the teacher's hidden states. ALM reads only
/// the teacher's log-probs of its own tokens: it trains as the top-k pairing
/// ([`CrossBatch`]) on answers carrying them, computed from the hidden states and the head (what
/// the top-k transport sends as `target_logprobs`); its validation reports P-KL here.
pub fn lay_out<'b>(
    ctx: LossCtx<'b>,
    projection: &'b Projection,
    head: &'b TeacherHead,
    items: &'b [Item],
    scores: &'b [&'b SequenceScores],
    purpose: Purpose,
) -> Result<Box<dyn MicroBatch + 'b>> {
    if !ctx.loss.kd.is_cross_tokenizer() {
        bail!(
            "teacher.transport = \"hidden\" across tokenizers trains with first_kl, pkl, \
             gold or alm, not {:?}",
            ctx.loss.kd
        );
    }
    if purpose == Purpose::Train && ctx.loss.kd.reads_token_logprobs_only() {
        let answers = token_logprob_answers(ctx, head, items, scores)?;
        let refs: Vec<&SequenceScores> = answers.iter().collect();
        let ctx = LossCtx { k: 0, ..ctx };
        let validation_kd = super::cross::validation_kd();
        let batch = topk_batch(ctx, projection, validation_kd, items, &refs, purpose)?;
        return Ok(Box::new(batch));
    }
    let teacher = FullChunks {
        projection,
        head,
        scores,
    };
    let validation = validation_loss(ctx.loss);
    let ctx = LossCtx { k: 0, ..ctx };
    let batch = CrossBatch::new(ctx, teacher, validation, items, scores, purpose)?;
    Ok(Box::new(batch))
}

/// The answers ALM runs on: each row's log-prob of the next teacher token, from the hidden
/// states and the teacher's head.
fn token_logprob_answers(
    ctx: LossCtx,
    head: &TeacherHead,
    items: &[Item],
    scores: &[&SequenceScores],
) -> Result<Vec<SequenceScores>> {
    let mut want = vec![];
    for (r, (it, sc)) in items.iter().zip(scores).enumerate() {
        let ids = it.teacher_ids();
        let rows = sc.rows.min(ids.len().saturating_sub(1));
        want.extend((0..rows).map(|p| (r, p, ids[p + 1])));
    }
    let filled =
        target_logprobs_from_hidden(head, ctx.loss.temperature, ctx.device, scores, &want)?;
    Ok(scores
        .iter()
        .zip(filled)
        .map(|(sc, target_logprobs)| SequenceScores {
            rows: sc.rows,
            k: 0,
            logsumexp: vec![0.0; sc.rows],
            target_logprobs,
            ..Default::default()
        })
        .collect())
}

/// What validation measures for a run's loss: the loss itself when it is a divergence
/// (first_kl, P-KL), else (ALM and gold: a chunk likelihood and a KL/L1 hybrid) P-KL over the
/// teacher's whole distribution, the figure the top-k pairing reports across tokenizers.
fn validation_loss(loss: &LossConfig) -> LossConfig {
    if loss.kd.is_chunk_divergence() {
        return LossConfig {
            ce: CeConfig::None {},
            kd_weight: 1.0,
            ..loss.clone()
        };
    }
    LossConfig {
        kd: super::cross::validation_kd(),
        tail: None,
        temperature: loss.temperature,
        kd_weight: 1.0,
        ce: CeConfig::None {},
    }
}

/// The teacher's whole distribution at each chunk's anchor, from its hidden states and head.
struct FullChunks<'a> {
    projection: &'a Projection,
    head: &'a TeacherHead,
    scores: &'a [&'a SequenceScores],
}

/// The answers' hidden states as a (sub-)batch reads them: piece `i`'s teacher position `p` of
/// its segment `row` is at `(segment.row, segment.teacher.start + p)` of the whole batch.
struct States<'a> {
    scores: &'a [&'a SequenceScores],
    hidden_size: usize,
    /// `None`: the whole batch.
    piece: Option<&'a crate::train::xpieces::XPiece>,
}

impl TeacherStates for States<'_> {
    fn append_row(
        &self,
        row: usize,
        pos: usize,
        out: &mut Vec<f32>,
    ) -> std::result::Result<(), LossError> {
        let (r, p) = match self.piece {
            None => (row, pos),
            Some(piece) => {
                let seg = &piece.segments[row];
                (seg.row, seg.teacher.start + pos)
            }
        };
        let values = hidden_row(self.scores[r], r, p, self.hidden_size)
            .map_err(|e| LossError::input("hidden", e.to_string()))?;
        out.extend(values);
        Ok(())
    }
}

impl ChunkTerm for FullChunks<'_> {
    fn term(
        &self,
        cp: &CrossPieces,
        cfg: &LossConfig,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)> {
        let batch = cp.part_batch(part);
        let piece = match part {
            Part::Whole => None,
            Part::Piece(i) => Some(&cp.plan[i]),
        };
        let states = States {
            scores: self.scores,
            hidden_size: self.head.hidden_size(),
            piece,
        };
        let inputs = KdInputs::XTokenFull(XTokenFull {
            batch: &batch,
            projection: self.projection,
            head: self.head,
            states: &states,
        });
        Ok(kd_loss_figures(cfg, logits, inputs, normalizer)?)
    }
}
