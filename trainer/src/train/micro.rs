//! A micro-batch's loss, its gradients and its validation figures, driven once for every pairing
//! and objective. The pairing (or SFT) lays the micro-batch out as a [`MicroBatch`] — the
//! student's ids, the rows the LM head runs on cut into pieces, and each part's loss terms — and
//! this module runs the one pipeline on it:
//!
//! - [`grads`]: training pass → head pieces → loss terms per piece → [`head_chunks::run`] → backward
//!   through the decoder (what training runs);
//! - [`loss`]: the same loss as one scalar over the whole micro-batch, plain autograd: the
//!   reference [`grads`] is tested against;
//! - [`validation`]: forward-only head pieces, the pairing's validation divergence and the
//!   student's cross-entropy as sums with their counts (`validation_whole`: its reference, in tests).
//!
//! What differs between pairings is only what they implement of [`MicroBatch`]; how terms
//! combine (`kd_weight`, `ce`) is the [`LossConfig`] the [`Drive`] carries.

use super::head_chunks::{self, ChunkLoss, HeadOpts, HeadSums, Mix, Piece, PieceTerms};
use crate::loss::fused_head::{FusedCe, FusedKd, FusedTerms};
use crate::loss::{
    combine, cross_entropy, cross_entropy_known, BadNormalizer, CeConfig, KdFigures, KdMetrics,
    LossConfig, Normalizer,
};
use crate::optim::{GradAccumulator, OptimError};
use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use std::ops::Range;
use xdistill_shared::model::Decoder;

/// Counts a step's losses are normalised by (summed over its micro-batches, so accumulated
/// micro-batches add up to the mean over the whole step).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Units {
    /// Tokens (same tokenizer) or chunks (cross tokenizer) of the distillation loss.
    pub kd: f64,
    /// Trained student tokens (cross-entropy).
    pub ce: f64,
}

impl Units {
    /// The step's distillation units as the losses' normalizer (an error when there are none).
    pub fn kd_normalizer(&self) -> Result<Normalizer, BadNormalizer> {
        Normalizer::new(self.kd)
    }

    /// The step's trained tokens as the cross-entropy's normalizer (an error when there are none).
    pub fn ce_normalizer(&self) -> Result<Normalizer, BadNormalizer> {
        Normalizer::new(self.ce)
    }
}

impl std::ops::AddAssign for Units {
    fn add_assign(&mut self, o: Units) {
        self.kd += o.kd;
        self.ce += o.ce;
    }
}

/// What a micro-batch's loss evaluation measured (detached).
#[derive(Debug, Clone, Default)]
pub struct MicroOut {
    pub kd: KdMetrics,
    /// Mean cross-entropy over this micro-batch's trained tokens, when computed.
    pub ce: Option<f64>,
    /// Effective KD multiplier (dynamic scaling).
    pub kd_scale: f64,
    pub units: Units,
}

/// Sums of validation figures with their counts (means are `kl / kl_units`, `ce / ce_tokens`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ValSums {
    pub kl: f64,
    pub kl_units: f64,
    pub ce: f64,
    pub ce_tokens: f64,
}

impl std::ops::AddAssign for ValSums {
    fn add_assign(&mut self, o: ValSums) {
        self.kl += o.kl;
        self.kl_units += o.kl_units;
        self.ce += o.ce;
        self.ce_tokens += o.ce_tokens;
    }
}

/// What the pipeline runs a laid-out micro-batch with.
#[derive(Clone, Copy)]
pub struct Drive<'a> {
    pub model: &'a Decoder,
    /// Activation checkpointing and the head's chunk size.
    pub head: HeadOpts,
    /// How the terms combine (`kd_weight`, `ce`: whether the cross-entropy is computed and how
    /// it is weighted) and the temperature validation figures are reported without.
    pub loss: &'a LossConfig,
}

/// Which rows a loss term is asked for: all of the unchunked reference's, or one head piece's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Whole,
    Piece(usize),
}

/// Where the LM head runs over a micro-batch.
pub struct Layout {
    /// `[B, T]` the student's padded ids.
    pub ids: Tensor,
    /// The head's pieces: training and validation cut the rows alike.
    pub pieces: Vec<Piece>,
    /// The rows of the unchunked reference, as one piece.
    pub whole: Piece,
}

/// A micro-batch as its pairing laid it out: what the pipeline needs and pairings differ in.
/// Logits handed to the terms are `[b', t', V]`, shaped as the part's [`Piece::shape`].
pub trait MicroBatch {
    fn layout(&self) -> &Layout;

    /// Whether the objective has a distillation term (false: the cross-entropy alone, SFT).
    fn distills(&self) -> bool {
        true
    }

    /// The distillation term of `part`'s logits (before `kd_weight`), divided by `normalizer`
    /// (`None`: the part's own units), and its figures (left on the device where the loss can).
    fn kd(
        &self,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)>;

    /// The divergence validation reports for `part` (τ² included, the mean over its units), or
    /// `None` where validation reports the cross-entropy alone.
    fn val_kd(&self, part: Part, logits: &Tensor) -> Result<Option<(Tensor, KdMetrics)>>;

    /// `part`'s cross-entropy targets and mask, shaped as its logits, and its trained tokens.
    fn ce(&self, part: Part) -> Result<(Tensor, Tensor, usize)>;

    /// `part`'s distillation term (divided by `normalizer`) in the form a head chunk runs by
    /// hand ([`FusedKd`]), where the pairing's loss has one there; `None`: [`MicroBatch::kd`]
    /// through autograd.
    fn fused_kd(&self, part: Part, normalizer: Normalizer) -> Result<Option<FusedKd>> {
        let _ = (part, normalizer);
        Ok(None)
    }
}

/// Whether `[loss] ce` asks for the cross-entropy term.
pub fn wants_ce(cfg: &LossConfig) -> bool {
    !matches!(cfg.ce, CeConfig::None {})
}

fn value(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// The rows of `piece` of `x` `[B, T, C]`, as `[piece.shape.0, piece.shape.1, C]` (`x` itself
/// when the piece is every row in order).
fn rows_of(x: &Tensor, piece: &Piece) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    let all = piece.shape == (b, t)
        && piece.rows.len() == b * t
        && piece.rows.iter().enumerate().all(|(i, &r)| r as usize == i);
    if all {
        return Ok(x.clone());
    }
    let idx = Tensor::from_vec(piece.rows.clone(), piece.rows.len(), x.device())?;
    Ok(x.reshape((b * t, c))?
        .index_select(&idx, 0)?
        .reshape((piece.shape.0, piece.shape.1, c))?)
}

/// The micro-batch's loss as one scalar, every `[N, V]` logit of [`Layout::whole`] at once
/// and the decoder through plain autograd (call `backward` on it): the reference of [`grads`].
/// Returns what it measured; the caller fills in the units.
pub fn loss(drive: &Drive, mb: &dyn MicroBatch, norm: Units) -> Result<(Tensor, MicroOut)> {
    let (model, layout) = (drive.model, mb.layout());
    let hidden = model.forward_hidden(&layout.ids, None, None, None)?;
    let logits = model.logits(&rows_of(&hidden, &layout.whole)?)?;
    let (kd, kd_m) = if mb.distills() {
        let (kd, figures) = mb.kd(Part::Whole, &logits, Some(norm.kd_normalizer()?))?;
        (kd, figures.read()?)
    } else {
        // Cross-entropy alone: a zero distillation term (its weight is 0, its value adds 0).
        let zero = Tensor::zeros((), logits.dtype(), logits.device())?;
        (zero, KdMetrics::default())
    };
    let (ce, ce_mean) = if wants_ce(drive.loss) {
        let (targets, mask, n) = mb.ce(Part::Whole)?;
        if n > 0 {
            let (ce, _) = cross_entropy(&logits, &targets, &mask, Some(norm.ce_normalizer()?))?;
            let mean = value(&ce)? * norm.ce / n as f64;
            (Some(ce), Some(mean))
        } else {
            (None, None)
        }
    } else {
        (None, None)
    };
    let c = combine(&kd, ce.as_ref(), drive.loss)?;
    let out = MicroOut {
        kd: kd_m,
        ce: ce_mean,
        kd_scale: c.kd_scale,
        units: Units::default(),
    };
    Ok((c.total, out))
}

/// The gradients of [`loss`] (every parameter's, the head's included) and its summed values:
/// the decoder run by `drive.head`'s training pass, the LM head and the loss terms one
/// [`Layout::pieces`] piece at a time (`[N, V]` exists for one piece at a time). With `acc`,
/// each decoder layer's gradients are summed into it as the backward leaves the layer
/// ([`GradAccumulator::absorb`]) and the returned store holds the rest: the caller's
/// `acc.add` of it then ends the micro-batch, with the same sums as adding them all at once.
pub fn grads(
    drive: &Drive,
    mb: &dyn MicroBatch,
    norm: Units,
    mut acc: Option<&mut GradAccumulator>,
) -> Result<(GradStore, HeadSums)> {
    let (model, layout) = (drive.model, mb.layout());
    if let Some(acc) = acc.as_deref_mut() {
        acc.before_micro_batch()?;
    }
    let pass = drive.head.forward(model, &layout.ids)?;
    let mut terms = StepTerms {
        mb,
        kd_norm: mb.distills().then(|| norm.kd_normalizer()).transpose()?,
        ce_norm: wants_ce(drive.loss)
            .then(|| norm.ce_normalizer())
            .transpose()?,
    };
    let out = head_chunks::run(
        model,
        pass.hidden(),
        &layout.pieces,
        Mix::of(drive.loss),
        &mut terms,
    )?;
    out.finish(pass, &mut |g: &mut GradStore| match acc.as_deref_mut() {
        Some(acc) => acc.absorb(g).map_err(|e| match e {
            OptimError::Candle(c) => c,
            e => candle_core::Error::Msg(e.to_string()),
        }),
        None => Ok(()),
    })
}

/// [`grads`]'s loss terms of each head piece: the pairing's, normalised by the step's units.
struct StepTerms<'a> {
    mb: &'a dyn MicroBatch,
    /// The step's distillation units (`None`: no distillation term).
    kd_norm: Option<Normalizer>,
    /// The step's trained tokens (`None`: no cross-entropy).
    ce_norm: Option<Normalizer>,
}

impl StepTerms<'_> {
    /// The cross-entropy's targets, mask and trained tokens of piece `i`, where it has any.
    fn ce(&self, i: usize) -> Result<Option<(Tensor, Tensor, f64)>> {
        if self.ce_norm.is_none() {
            return Ok(None);
        }
        let (targets, mask, count) = self.mb.ce(Part::Piece(i))?;
        Ok((count > 0).then_some((targets, mask, count as f64)))
    }
}

impl PieceTerms for StepTerms<'_> {
    fn composed(&mut self, i: usize, logits: &Tensor) -> Result<ChunkLoss> {
        let kd = match self.kd_norm {
            Some(n) => Some(self.mb.kd(Part::Piece(i), logits, Some(n))?),
            None => None,
        };
        let ce = match (self.ce(i)?, self.ce_norm) {
            (Some((targets, mask, count)), Some(n)) => {
                let ce = cross_entropy_known(logits, &targets, &mask, count, Some(n))?;
                Some((ce, count))
            }
            _ => None,
        };
        Ok(ChunkLoss { kd, ce })
    }

    fn fused(&mut self, i: usize) -> Result<Option<FusedTerms>> {
        let kd = match self.kd_norm {
            Some(n) => match self.mb.fused_kd(Part::Piece(i), n)? {
                Some(kd) => Some(kd),
                None => return Ok(None), // the distillation term has no fused form here
            },
            None => None,
        };
        let ce = match (self.ce(i)?, self.ce_norm) {
            (Some((targets, mask, count)), Some(normalizer)) => Some(FusedCe {
                targets,
                mask,
                count,
                normalizer,
            }),
            _ => None,
        };
        Ok((kd.is_some() || ce.is_some()).then_some(FusedTerms { kd, ce }))
    }
}

/// Validation sums of the micro-batch without gradients: [`MicroBatch::val_kd`] with τ²
/// removed, summed over its units, and the student's cross-entropy, the head in forward-only
/// pieces cut as training cuts them.
pub fn validation(drive: &Drive, mb: &dyn MicroBatch) -> Result<ValSums> {
    let (mut out, layout) = (ValSums::default(), mb.layout());
    if layout.pieces.is_empty() {
        return Ok(out);
    }
    let tau2 = drive.loss.temperature.get() * drive.loss.temperature.get();
    let hidden = drive.model.forward_hidden(&layout.ids, None, None, None)?;
    head_chunks::forward_only(drive.model, &hidden, &layout.pieces, |i, logits| {
        if let Some((kl, m)) = mb.val_kd(Part::Piece(i), logits)? {
            if m.count > 0.0 {
                out.kl += value(&kl)? / tau2 * m.count;
                out.kl_units += m.count;
            }
        }
        let (targets, mask, _) = mb.ce(Part::Piece(i))?;
        add_ce(&mut out, logits, &targets, &mask)
    })?;
    Ok(out)
}

/// The unchunked [`validation`] (`[B, T, V]` logits at once): the reference of its tests.
#[cfg(test)]
pub fn validation_whole(drive: &Drive, mb: &dyn MicroBatch) -> Result<ValSums> {
    let mut out = ValSums::default();
    let tau2 = drive.loss.temperature.get() * drive.loss.temperature.get();
    let layout = mb.layout();
    let logits = rows_of(&drive.model.forward(&layout.ids)?, &layout.whole)?;
    if let Some((kl, m)) = mb.val_kd(Part::Whole, &logits)? {
        out.kl = value(&kl)? / tau2 * m.count;
        out.kl_units = m.count;
    }
    let (targets, mask, _) = mb.ce(Part::Whole)?;
    add_ce(&mut out, &logits, &targets, &mask)?;
    Ok(out)
}

/// Adds the mean CE of `logits` over its masked targets (times their count) to validation sums.
fn add_ce(out: &mut ValSums, logits: &Tensor, targets: &Tensor, mask: &Tensor) -> Result<()> {
    let (ce, n) = cross_entropy(logits, targets, mask, None)?;
    if n > 0.0 {
        out.ce += value(&ce)? * n;
        out.ce_tokens += n;
    }
    Ok(())
}

/// Trained rows (flat indices into `[B·T]`) cut into head pieces of `per` consecutive rows, each
/// laid out as `[1, n]`: the layout of every loss computed per student position (the same
/// tokenizer, its full-vocabulary form, on-policy samples, SFT).
pub struct RowPieces {
    pub layout: Layout,
    per: usize,
}

impl RowPieces {
    /// The rows `sel` (`[N]` flat indices into `ids`' `[B·T]`, row-major) in pieces of at most
    /// `per` rows; the reference takes them all as one `[1, N]` piece.
    pub fn new(ids: &Tensor, sel: Vec<u32>, per: usize) -> RowPieces {
        let per = per.max(1);
        let pieces = head_chunks::row_pieces(&sel, per);
        let whole = Piece {
            shape: (1, sel.len()),
            rows: sel,
        };
        let ids = ids.clone();
        RowPieces {
            layout: Layout { ids, pieces, whole },
            per,
        }
    }

    /// The rows of `part` as a range of indices into the trained rows.
    pub fn range(&self, part: Part) -> Range<usize> {
        match part {
            Part::Whole => 0..self.layout.whole.rows.len(),
            Part::Piece(i) => {
                let a = i * self.per;
                a..a + self.layout.pieces[i].rows.len()
            }
        }
    }

    /// The cross-entropy inputs of `part` when `targets[j]` is the token row `sel[j]` predicts:
    /// `[1, n]` targets, a mask of ones, and `n`.
    pub fn ce(
        &self,
        part: Part,
        targets: &[u32],
        device: &Device,
    ) -> Result<(Tensor, Tensor, usize)> {
        let r = self.range(part);
        let n = r.len();
        Ok((
            Tensor::from_vec(targets[r].to_vec(), (1, n), device)?,
            Tensor::ones((1, n), DType::F32, device)?,
            n,
        ))
    }
}
