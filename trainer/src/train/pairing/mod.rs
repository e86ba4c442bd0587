//! How a source's answers lie against the student's tokens, in one place: the same tokenizer
//! ([`same`]), another tokenizer through aligned chunks and a projection ([`cross`]), or a
//! chunk-level ensemble's virtual teacher ([`mixture`]), the same tokenizer with the teacher's
//! whole distribution from its hidden states ([`full_vocab`]), or another tokenizer with it
//! ([`cross_full`]); on-policy samples of the same
//! tokenizer train with the sampled-token loss ([`sampled`]). The [`Pairing`] is decided once per
//! source when the run connects to its teachers; each pairing owns turning a record into its
//! training [`Item`], collating a micro-batch (student ids, teacher rows laid against them, the
//! chunk layout) and its loss and validation figures ([`Collation`]). The training loop
//! ([`super::step`]) and the objectives call the pairing instead of matching on it.

pub mod cross;
pub mod cross_full;
pub mod full_vocab;
pub mod mixture;
pub mod same;
pub mod sampled;

use super::head::HeadSums;
use super::step::{LossCtx, MicroOut, Units, ValSums};
use crate::align::{AlignTokenizer, TokenizedPair};
use crate::collate::Encoded;
use crate::data::Record;
use crate::loss::{combine, cross_entropy, CeConfig, KdMetrics, LossConfig, Projection};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use tokenizers::Tokenizer;
use xdistill_shared::protocol::SequenceScores;

use super::prepare::Limits;

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
    /// The pairing's collation and losses (the one place the pairing is matched for them).
    pub fn collation(self) -> Box<dyn Collation + 'a> {
        match self {
            Pairing::Same => Box::new(same::Same),
            Pairing::Cross(p) => Box::new(cross::Cross::new(p)),
            Pairing::Mixture(p) => Box::new(mixture::collation(p)),
            Pairing::FullVocab(head) => Box::new(full_vocab::FullVocab { head }),
            Pairing::CrossFullVocab(projection, head) => {
                Box::new(cross_full::CrossFullVocab { projection, head })
            }
        }
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

/// What a pairing does with a micro-batch of its items and their teacher answers
/// (`scores[i]` answers `items[i]`): the training loss as one scalar (the reference), its
/// gradients with the LM head in row chunks, and the validation figures.
pub trait Collation {
    /// The loss as one scalar, `[N, V]` logits at once (call `backward` on it).
    fn loss(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(Tensor, MicroOut)>;

    /// The same loss's gradients, the LM head + loss run in row chunks.
    fn grads(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(GradStore, HeadSums)>;

    /// Validation sums, the head in forward-only row chunks cut as training cuts them.
    fn validation(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums>;

    /// The unchunked validation sums (`[B, T, V]` logits at once): the reference of the tests.
    #[cfg(test)]
    fn validation_whole(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums>;
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

/// Checks a teacher answer's shape against its sequence of `len` tokens.
/// The trained positions of a padded batch (flat indices into `[B·T]`, row-major) and the token
/// each predicts; an error when there are none.
fn trained_positions(tb: &crate::collate::TokenBatch) -> Result<(Vec<u32>, Vec<u32>)> {
    let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
    let all_targets: Vec<u32> = tb.targets.flatten_all()?.to_vec1()?;
    let sel: Vec<u32> = (0..mask.len())
        .filter(|&i| mask[i] > 0.0)
        .map(|i| i as u32)
        .collect();
    if sel.is_empty() {
        bail!("micro-batch has no trained tokens");
    }
    let targets = sel.iter().map(|&i| all_targets[i as usize]).collect();
    Ok((sel, targets))
}

fn check_rows(s: &SequenceScores, len: usize, k: usize) -> Result<()> {
    if s.rows + 1 != len || s.k != k {
        bail!("teacher returned {} rows of k={} for a sequence of {len} tokens (expected {} of k={k})", s.rows, s.k, len - 1);
    }
    Ok(())
}

/// Whether `[loss] ce` asks for the cross-entropy term.
fn wants_ce(cfg: &LossConfig) -> bool {
    !matches!(cfg.ce, CeConfig::None {})
}

/// Adds the cross-entropy term (when `ce` gives targets `[B, T]`, mask `[B, T]` and the count of
/// trained tokens) to the distillation loss as `[loss] ce` says, and reports the parts (the
/// caller fills in the units).
fn finish(
    cfg: &LossConfig,
    logits: &Tensor,
    (kd, kd_m): (Tensor, KdMetrics),
    ce: Option<(Tensor, Tensor, usize)>,
    norm: Units,
) -> Result<(Tensor, MicroOut)> {
    let (ce, ce_mean) = match ce {
        Some((targets, mask, n)) if n > 0 => {
            let (ce, _) = cross_entropy(logits, &targets, &mask, Some(norm.ce_normalizer()?))?;
            let mean =
                ce.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? * norm.ce / n as f64;
            (Some(ce), Some(mean))
        }
        _ => (None, None),
    };
    let c = combine(&kd, ce.as_ref(), cfg)?;
    Ok((
        c.total,
        MicroOut {
            kd: kd_m,
            ce: ce_mean,
            kd_scale: c.kd_scale,
            units: Units::default(),
        },
    ))
}

/// Adds a chunk's mean CE over its `n` targets (mean: no normalizer given) to validation sums.
fn val_ce(out: &mut ValSums, logits: &Tensor, tg: Tensor, mask: Tensor) -> Result<()> {
    let (ce, n) = cross_entropy(logits, &tg, &mask, None)?;
    if n > 0.0 {
        out.ce += ce.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? * n;
        out.ce_tokens += n;
    }
    Ok(())
}

/// Unchunked validation: the mean KL (τ² removed) over `units` and the student's CE of one
/// micro-batch, as sums with their counts.
#[cfg(test)]
fn whole_sums(
    temperature: crate::loss::Temperature,
    kl: &Tensor,
    units: f64,
    logits: &Tensor,
    tb: &crate::collate::TokenBatch,
) -> Result<ValSums> {
    let (ce, n) = cross_entropy(logits, &tb.targets, &tb.mask, None)?;
    let kl = kl.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?
        / (temperature.get() * temperature.get());
    let ce = ce.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
    Ok(ValSums {
        kl: kl * units,
        kl_units: units,
        ce: ce * n,
        ce_tokens: n,
    })
}
