//! How a source's answers lie against the student's tokens, in one place: the same tokenizer
//! ([`same`]), another tokenizer through aligned chunks and a projection ([`cross`]), or a
//! chunk-level ensemble's virtual teacher ([`mixture`]), the same tokenizer with the teacher's
//! whole distribution from its hidden states ([`full_vocab`]), or another tokenizer with it
//! ([`cross_full`]); on-policy samples of the same
//! tokenizer train with the sampled-token loss ([`sampled`]). The [`Pairing`] is decided once per
//! source when the run connects to its teachers; each pairing owns turning a record into its
//! training [`Item`], collating a micro-batch (student ids, teacher rows laid against them, the
//! chunk layout) and its loss terms and validation figures ([`Pairing::lay_out`]: a
//! [`MicroBatch`] the one loss pipeline, [`super::micro`], runs). The training loop
//! ([`super::step`]) and the objectives call the pairing instead of matching on it.

pub mod cross;
pub mod cross_full;
pub mod full_vocab;
pub mod mixture;
pub mod same;
pub mod sampled;

use super::head_chunks::HeadOpts;
use super::micro::{MicroBatch, RowPieces, Units};
use crate::align::{AlignTokenizer, TokenizedPair};
use crate::collate::{Encoded, TokenBatch};
use crate::data::Record;
use crate::loss::{LossConfig, Projection};
use anyhow::{bail, Result};
use candle_core::Device;
use tokenizers::Tokenizer;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

/// Whether student and teacher share a tokenizer: decided once, when the run connects to its
/// teacher, and carried by [`LossCtx`] (a cross-tokenizer run always has its projection).
#[derive(Clone, Copy)]
pub enum Pairing<'a> {
    Same,
    Cross(&'a Projection),
    /// A chunk-level ensemble's virtual teacher in the student's own tokenization (identity
    /// projection, one chunk per chunk common to every teacher): trained like `Cross`,
    /// validated with first-token KL (its rows exist only at chunk starts).
    Mixture(&'a Projection),
    /// The same tokenizer, the teacher sending hidden states (`teacher.transport = "hidden"`):
    /// exact losses over the whole vocabulary through the teacher's head ([`full_vocab`]).
    FullVocab(&'a crate::loss::full_vocab::TeacherHead),
    /// Another tokenizer, the teacher sending hidden states: first-token KL over the teacher's
    /// whole distribution at each aligned chunk ([`cross_full`]).
    CrossFullVocab(&'a Projection, &'a crate::loss::full_vocab::TeacherHead),
}

impl<'a> Pairing<'a> {
    /// Lays a micro-batch of `items` out for the loss pipeline ([`super::micro`]): the one
    /// place the pairing is matched for its losses. `scores[i]` answers `items[i]`.
    pub fn lay_out<'b>(
        self,
        ctx: &LossCtx<'b>,
        items: &'b [Item],
        scores: &'b [&'b SequenceScores],
        purpose: Purpose,
    ) -> Result<Box<dyn MicroBatch + 'b>>
    where
        'a: 'b,
    {
        // The layout keeps its own copy of the context, naming this pairing.
        let ctx: LossCtx<'b> = LossCtx {
            pairing: self,
            ..*ctx
        };
        Ok(match self {
            Pairing::Same => Box::new(same::SameBatch::new(ctx, items, scores, purpose)?),
            Pairing::Cross(p) => Box::new(cross::topk_batch(
                ctx,
                p,
                cross::validation_kd(),
                items,
                scores,
                purpose,
            )?),
            Pairing::Mixture(p) => Box::new(cross::topk_batch(
                ctx,
                p,
                mixture::validation_kd(),
                items,
                scores,
                purpose,
            )?),
            Pairing::FullVocab(head) => Box::new(full_vocab::FullVocabBatch::new(
                ctx, head, items, scores, purpose,
            )?),
            Pairing::CrossFullVocab(projection, head) => {
                cross_full::lay_out(ctx, projection, head, items, scores, purpose)?
            }
        })
    }

    /// Whether records are aligned across tokenizers (the loss is `[loss_cross]`).
    pub fn is_cross(self) -> bool {
        !matches!(self, Pairing::Same | Pairing::FullVocab(_))
    }

    /// Whether the teacher scores tokens of its own (a chunk-level ensemble has no per-token
    /// log-probs to compare with the student's).
    pub fn scores_tokens(self) -> bool {
        !matches!(self, Pairing::Mixture(_))
    }
}

/// What a micro-batch is laid out for: training cuts the head at the rows the loss reads (and
/// the cross-entropy's, when `[loss] ce` asks for it); validation always reports the CE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Train,
    Validate,
}

/// Everything the loss of a micro-batch needs besides the batch itself.
#[derive(Clone, Copy)]
pub struct LossCtx<'a> {
    pub model: &'a Decoder,
    /// The teacher's top-k per position.
    pub k: usize,
    pub loss: &'a LossConfig,
    pub pairing: Pairing<'a>,
    pub device: &'a Device,
    /// Sequences per forward/backward pass in [`super::step::accumulate`].
    pub micro_batch: usize,
    /// Activation checkpointing and the head's chunk size.
    pub head: HeadOpts,
}

impl<'a> LossCtx<'a> {
    /// The student's vocabulary: the bound of every id it is fed.
    pub fn vocab(&self) -> usize {
        self.model.config().vocab_size
    }

    /// What the loss pipeline runs with.
    pub fn drive(&self) -> super::micro::Drive<'a> {
        super::micro::Drive {
            model: self.model,
            head: self.head,
            loss: self.loss,
        }
    }
}

/// Length limits, in tokens, per side.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_student_tokens: usize,
    pub max_teacher_tokens: usize,
    /// Over-long records are truncated (both sides at one chunk boundary) instead of skipped
    /// (`data.truncate`).
    pub truncate: bool,
}

/// How records are tokenized: one tokenizer for both sides, or two aligned ones.
#[allow(clippy::large_enum_variant)] // one value per run
pub enum Tokenization {
    Same(Tokenizer),
    Cross {
        student: AlignTokenizer,
        teacher: AlignTokenizer,
    },
}

impl Tokenization {
    pub fn is_cross(&self) -> bool {
        matches!(self, Tokenization::Cross { .. })
    }

    /// The student's tokenizer.
    pub fn student_tokenizer(&self) -> &Tokenizer {
        match self {
            Tokenization::Same(t) => t,
            Tokenization::Cross { student, .. } => &student.tokenizer,
        }
    }

    /// Whether `r` exceeds a token limit on either side (without truncation).
    pub fn too_long(&self, r: &Record, lim: Limits) -> bool {
        match self {
            Tokenization::Same(t) => same::too_long(t, r, lim),
            Tokenization::Cross { student, teacher } => cross::too_long(student, teacher, r, lim),
        }
    }

    /// Tokenizes one record; the error says why it cannot be used.
    pub fn item(&self, r: &Record, lim: Limits) -> std::result::Result<Item, String> {
        match self {
            Tokenization::Same(t) => same::item(t, r, lim),
            Tokenization::Cross { student, teacher } => cross::item(student, teacher, r, lim),
        }
    }
}

/// One record ready for the step.
#[derive(Debug, Clone)]
pub enum Item {
    /// Same tokenizer: the teacher scores exactly these ids.
    Same(Encoded),
    /// Different tokenizers: both tokenizations of the same (canonical) text and their chunks;
    /// `loss_start` is the byte of that text where training starts (0: everything).
    Cross {
        pair: TokenizedPair,
        loss_start: usize,
    },
}

impl Item {
    /// The ids sent to the teacher.
    pub fn teacher_ids(&self) -> &[u32] {
        match self {
            Item::Same(e) => &e.ids,
            Item::Cross { pair, .. } => &pair.teacher_ids,
        }
    }

    /// The student's ids.
    pub fn student_ids(&self) -> &[u32] {
        match self {
            Item::Same(e) => &e.ids,
            Item::Cross { pair, .. } => &pair.student_ids,
        }
    }

    /// The aligned pair and where its training starts (`None`: same tokenizer).
    pub fn aligned(&self) -> Option<(&TokenizedPair, usize)> {
        match self {
            Item::Cross { pair, loss_start } => Some((pair, *loss_start)),
            Item::Same(_) => None,
        }
    }

    /// The trained units of this item: tokens (same tokenizer) or chunks (cross), and the
    /// trained student tokens.
    pub fn units(&self) -> Units {
        match self {
            Item::Same(e) => same::units(e),
            Item::Cross { pair, loss_start } => cross::units(pair, *loss_start),
        }
    }
}

/// The trained units of `items`.
pub fn units(items: &[Item]) -> Units {
    let mut u = Units::default();
    for it in items {
        u += it.units();
    }
    u
}

/// The trained positions of a same-tokenizer micro-batch, the token each predicts and what the
/// teacher's answer holds there (`T`: its top-k rows, or its hidden states), with the head's
/// pieces over them.
#[derive(Default)]
struct TrainedRows<T> {
    /// `[N]` the token each trained position predicts.
    targets: Vec<u32>,
    teacher: T,
}

impl<T: Default> TrainedRows<T> {
    /// The trained positions of `tb` (masked targets, row-major over `[B, T]`) in head pieces of
    /// `ctx.head`'s rows; `gather(r, p, &mut teacher)` appends answer `r`'s row `p`. An error
    /// when nothing is trained, except when validating (then there are no rows).
    fn lay_out(
        ctx: &LossCtx,
        tb: &TokenBatch,
        purpose: Purpose,
        mut gather: impl FnMut(usize, usize, &mut T) -> Result<()>,
    ) -> Result<(TrainedRows<T>, RowPieces)> {
        if purpose == Purpose::Validate && tb.n_targets == 0 {
            return Ok((TrainedRows::default(), RowPieces::new(&tb.ids, vec![], 1)));
        }
        let t = tb.ids.dim(1)?;
        let (mask, all_targets) = (&tb.host_mask, &tb.host_targets);
        let sel: Vec<u32> = (0..mask.len())
            .filter(|&i| mask[i] > 0.0)
            .map(|i| i as u32)
            .collect();
        if sel.is_empty() {
            bail!("micro-batch has no trained tokens");
        }
        let mut rows = TrainedRows {
            targets: sel.iter().map(|&i| all_targets[i as usize]).collect(),
            teacher: T::default(),
        };
        for &i in &sel {
            gather(i as usize / t, i as usize % t, &mut rows.teacher)?;
        }
        // The same tokenizer's top-k losses and the cross-entropy run fused where they can
        // (larger chunks); the full-vocabulary ones stay composed.
        let head = ctx.model.lm_head();
        let per = match ctx.pairing {
            Pairing::Same => ctx.head.fused_rows(head)?,
            _ => ctx.head.rows(head.dim(0)?),
        };
        Ok((rows, RowPieces::new(&tb.ids, sel, per)))
    }
}

/// Checks a teacher answer's shape against its sequence of `len` tokens.
fn check_rows(s: &SequenceScores, len: usize, k: usize) -> Result<()> {
    if s.rows + 1 != len || s.k != k {
        bail!("teacher returned {} rows of k={} for a sequence of {len} tokens (expected {} of k={k})", s.rows, s.k, len - 1);
    }
    Ok(())
}
