//! The loss of one micro-batch and of a step: the source's pairing lays the micro-batch out
//! ([`super::pairing`]) and the one loss pipeline runs it ([`super::micro`]). [`micro_grads`]
//! returns its gradients with the LM head and loss run in row chunks ([`super::head_chunks`]);
//! [`micro_loss`] is the same loss as one scalar over the whole micro-batch (every `[N, V]`
//! logit at once), kept as the reference the chunked path is tested against; [`accumulate`]
//! runs a step's micro-batches.

use super::micro::{self, MicroOut, Units, ValSums};
use super::pairing::{units, Item, LossCtx, Purpose};
use crate::optim::GradAccumulator;
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use xdistill_shared::protocol::SequenceScores;

/// Checks that every item has its teacher answer.
fn check_answers(items: &[Item], scores: &[&SequenceScores]) -> Result<()> {
    if items.is_empty() || items.len() != scores.len() {
        bail!(
            "micro-batch of {} items with {} teacher answers",
            items.len(),
            scores.len()
        );
    }
    Ok(())
}

/// The loss of one micro-batch as one scalar, `[N, V]` logits at once and the decoder through
/// plain autograd (call `backward` on it): the reference for [`micro_grads`]. `scores[i]` is
/// the teacher's answer for `items[i]`.
pub fn micro_loss(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(Tensor, MicroOut)> {
    check_answers(items, scores)?;
    let batch = ctx.pairing.lay_out(ctx, items, scores, Purpose::Train)?;
    let (loss, mut out) = micro::loss(&ctx.drive(), &*batch, norm)?;
    out.units = units(items);
    Ok((loss, out))
}

/// The gradients of one micro-batch's loss (every parameter's, the head's included) and what
/// it measured: the loss of [`micro_loss`], with the decoder run by `ctx.head`'s training pass
/// and the LM head + loss in row chunks (`[N, V]` exists for one chunk at a time).
/// With `acc`, each decoder layer's gradients go into it as the backward leaves the layer and
/// the returned store holds the rest (add it to `acc` to end the micro-batch: the same sums).
pub fn micro_grads(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
    acc: Option<&mut GradAccumulator>,
) -> Result<(GradStore, MicroOut)> {
    check_answers(items, scores)?;
    let batch = ctx.pairing.lay_out(ctx, items, scores, Purpose::Train)?;
    let (grads, sums) = micro::grads(&ctx.drive(), &*batch, norm, acc)?;
    let out = MicroOut {
        kd: sums.kd,
        ce: sums.ce.filter(|c| c.1 > 0.0).map(|(v, n)| v * norm.ce / n),
        kd_scale: sums.kd_scale,
        units: units(items),
    };
    Ok((grads, out))
}

/// Validation figures of one micro-batch, without gradients: forward KL to the teacher over its
/// top-k with a tail bucket (same tokenizer) or chunk-level P-KL in NeMo's renormalised form
/// (cross tokenizer), and the student's cross-entropy, at `ctx.loss`'s temperature. Returns sums
/// (not means) with their counts. The head runs in forward-only row chunks (`ctx.head`), cut as
/// the training path cuts them.
pub fn validation_sums(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
) -> Result<ValSums> {
    let batch = ctx.pairing.lay_out(ctx, items, scores, Purpose::Validate)?;
    micro::validation(&ctx.drive(), &*batch)
}

/// The unchunked [`validation_sums`] (`[B, T, V]` logits at once): the reference of its tests.
#[cfg(test)]
pub fn validation_sums_whole(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
) -> Result<ValSums> {
    let batch = ctx.pairing.lay_out(ctx, items, scores, Purpose::Validate)?;
    micro::validation_whole(&ctx.drive(), &*batch)
}

/// What [`accumulate`] measured over a step's micro-batches.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepSums {
    /// Σ over micro-batches of (KD value × step units): divide by `norm.kd` for the step's mean.
    pub kd_sum: f64,
    /// Σ of CE means weighted by their tokens, and the tokens.
    pub ce_sum: f64,
    pub ce_n: f64,
    /// Effective KD multiplier of the last micro-batch (dynamic scaling).
    pub kd_scale: f64,
}

impl std::ops::AddAssign for StepSums {
    /// Sums add; `kd_scale` is the last one's.
    fn add_assign(&mut self, o: StepSums) {
        self.kd_sum += o.kd_sum;
        self.ce_sum += o.ce_sum;
        self.ce_n += o.ce_n;
        self.kd_scale = o.kd_scale;
    }
}

impl StepSums {
    pub fn kd_mean(&self, norm: Units) -> f64 {
        self.kd_sum / norm.kd.max(1.0)
    }
    pub fn ce_mean(&self) -> Option<f64> {
        (self.ce_n > 0.0).then(|| self.ce_sum / self.ce_n)
    }
}

/// Runs `items` in micro-batches of `ctx.micro_batch`, each loss normalised by the whole step's
/// `norm` (so the summed gradients are those of the step's mean), and adds every backward to
/// `acc`.
pub fn accumulate(
    ctx: &LossCtx,
    acc: &mut crate::optim::GradAccumulator,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<StepSums> {
    let mb = ctx.micro_batch.max(1);
    let mut s = StepSums {
        kd_scale: 1.0,
        ..Default::default()
    };
    for (it, sc) in items.chunks(mb).zip(scores.chunks(mb)) {
        let u = units(it);
        if u.kd == 0.0 {
            continue;
        }
        let (grads, m) = micro_grads(ctx, it, sc, norm, Some(&mut *acc))?;
        acc.add(&grads)?;
        s.kd_sum += m.kd.loss * norm.kd;
        if let Some(ce) = m.ce {
            s.ce_sum += ce * u.ce;
            s.ce_n += u.ce;
        }
        s.kd_scale = m.kd_scale;
    }
    Ok(s)
}

#[cfg(test)]
mod tests;
