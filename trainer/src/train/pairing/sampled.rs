//! On-policy samples with the student's own tokenizer: the teacher scores the student's ids, and
//! the sampled-token loss (`[loss] kd = sampled_kl`) trains on the completion positions with
//! the teacher's log-prob of each sampled token. The same pairing's collation of samples
//! ([`super::same`] holds its top-k losses).

use super::LossCtx;
use crate::collate::{pad_batch, Encoded};
use crate::loss::fused_head::FusedKd;
use crate::loss::{
    sampled_token_loss_pending, CeConfig, KdFigures, KdMetrics, LossConfig, Normalizer,
    SampledTargets,
};
use crate::optim::GradAccumulator;
use crate::train::micro::{self, Layout, MicroBatch, Part, RowPieces, Units};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use xdistill_shared::protocol::SequenceScores;

/// A sampled completion ready for the teacher: same tokenizer keeps the student's own ids.
pub struct Sample {
    pub ids: Vec<u32>,
    /// First completion token index.
    pub completion_from: usize,
    /// The student's log-probs of its sampled tokens.
    pub old_lp: Vec<f32>,
}

/// The completion positions of same-tokenizer samples: flat indices into `[B·T]` with the
/// sampled token each predicts and the teacher's log-prob of it.
struct SampledRows {
    sel: Vec<u32>,
    tokens: Vec<u32>,
    teacher: Vec<f32>,
}

impl SampledRows {
    fn new(samples: &[Sample], scores: &[&SequenceScores], t: usize) -> Result<SampledRows> {
        let mut r = SampledRows {
            sel: vec![],
            tokens: vec![],
            teacher: vec![],
        };
        for (b, (x, sc)) in samples.iter().zip(scores).enumerate() {
            if x.completion_from == 0 || sc.target_logprobs.len() + 1 < x.ids.len() {
                bail!(
                    "a sample of {} tokens scored with {} target log-probs (completion from {})",
                    x.ids.len(),
                    sc.target_logprobs.len(),
                    x.completion_from
                );
            }
            for p in x.completion_from - 1..x.ids.len() - 1 {
                r.sel.push((b * t + p) as u32);
                r.tokens.push(x.ids[p + 1]);
                r.teacher.push(sc.target_logprobs[p]);
            }
        }
        Ok(r)
    }

    /// The tokens and the teacher's log-probs on `device`, `[1, N]` each: uploaded once per
    /// micro-batch, narrowed per head chunk ([`OnDevice::targets`]).
    fn upload(&self, device: &candle_core::Device) -> Result<OnDevice> {
        let n = self.tokens.len();
        Ok(OnDevice {
            tokens: Tensor::from_vec(self.tokens.clone(), (1, n), device)?,
            teacher: Tensor::from_vec(self.teacher.clone(), (1, n), device)?,
        })
    }
}

/// [`SampledRows`]' loss inputs on the device.
struct OnDevice {
    tokens: Tensor,
    teacher: Tensor,
}

impl OnDevice {
    /// The loss inputs of rows `a..a + n`, as `[1, n]`.
    fn targets(&self, a: usize, n: usize) -> Result<SampledTargets> {
        Ok(SampledTargets {
            tokens: self.tokens.narrow(1, a, n)?,
            teacher_logprobs: self.teacher.narrow(1, a, n)?,
            old_logprobs: None, // one update per rollout: the ratio is exactly 1 (REINFORCE)
            mask: Tensor::ones((1, n), candle_core::DType::F32, self.tokens.device())?,
        })
    }
}

/// Same-tokenizer samples laid out for the sampled-token loss: the LM head runs only on the
/// completion positions.
struct SampledBatch<'a> {
    ctx: LossCtx<'a>,
    rows: SampledRows,
    on_device: OnDevice,
    layout: RowPieces,
}

impl<'a> SampledBatch<'a> {
    fn new(
        ctx: LossCtx<'a>,
        samples: &[Sample],
        scores: &[&SequenceScores],
    ) -> Result<SampledBatch<'a>> {
        let tb = pad_batch(&encoded(samples), 0, ctx.vocab(), ctx.device)?;
        let rows = SampledRows::new(samples, scores, tb.ids.dim(1)?)?;
        // The sampled-token loss runs fused where it can (larger chunks).
        let per = ctx.head.fused_rows(ctx.model.lm_head())?;
        let layout = RowPieces::new(&tb.ids, rows.sel.clone(), per);
        let on_device = rows.upload(ctx.device)?;
        Ok(SampledBatch {
            ctx,
            rows,
            on_device,
            layout,
        })
    }

    /// The sampled-token loss alone (× `kd_weight`, no cross-entropy), whatever `[loss] ce` says.
    fn loss_config(&self) -> LossConfig {
        LossConfig {
            ce: CeConfig::None {},
            ..self.ctx.loss.clone()
        }
    }
}

impl MicroBatch for SampledBatch<'_> {
    fn layout(&self) -> &Layout {
        &self.layout.layout
    }

    fn kd(
        &self,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)> {
        let r = self.layout.range(part);
        let targets = self.on_device.targets(r.start, r.len())?;
        let tau = self.ctx.loss.temperature;
        // Every row of the range is a completion token (the mask is ones): the count is known
        // here, so the chunk reads nothing back.
        let count = r.len() as f64;
        Ok(sampled_token_loss_pending(
            logits, &targets, count, tau, normalizer,
        )?)
    }

    /// The chunk's loss by hand where the fused kernels run ([`FusedKd::sampled`]): its
    /// gradient is each row's cross-entropy gradient times a weight from the same pass.
    fn fused_kd(&self, part: Part, normalizer: Normalizer) -> Result<Option<FusedKd>> {
        let r = self.layout.range(part);
        if r.is_empty() {
            return Ok(None);
        }
        let targets = self.on_device.targets(r.start, r.len())?;
        Ok(FusedKd::sampled(
            targets,
            r.len() as f64,
            self.ctx.loss.temperature,
            normalizer,
            self.ctx.model.lm_head(),
        ))
    }

    /// On-policy validation runs on the objective's own figures, not through this layout.
    fn val_kd(&self, _: Part, _: &Tensor) -> Result<Option<(Tensor, KdMetrics)>> {
        Ok(None)
    }

    fn ce(&self, part: Part) -> Result<(Tensor, Tensor, usize)> {
        self.layout.ce(part, &self.rows.tokens, self.ctx.device)
    }
}

/// The gradients of the sampled-token loss (× `kd_weight`) on the completion positions of
/// same-tokenizer samples, and its value before `kd_weight`: the LM head runs only on those
/// rows, in chunks (`ctx.head`), after the training pass.
pub fn sampled_grads(
    ctx: &LossCtx,
    samples: &[Sample],
    scores: &[&SequenceScores],
    normalizer: f64,
    acc: Option<&mut GradAccumulator>,
) -> Result<(GradStore, f64)> {
    let batch = SampledBatch::new(*ctx, samples, scores)?;
    let loss = batch.loss_config();
    let drive = micro::Drive {
        loss: &loss,
        ..ctx.drive()
    };
    let (g, sums) = micro::grads(&drive, &batch, units(normalizer), acc)?;
    Ok((g, sums.kd.loss))
}

/// The step's normalizer as the pipeline's units (the sampled-token loss has no CE term).
fn units(normalizer: f64) -> Units {
    Units {
        kd: normalizer,
        ce: 0.0,
    }
}

/// The samples as the student's training inputs (trained from their first completion token).
fn encoded(samples: &[Sample]) -> Vec<Encoded> {
    samples
        .iter()
        .map(|x| Encoded {
            ids: x.ids.clone(),
            loss_from: x.completion_from,
        })
        .collect()
}

/// The unchunked reference of [`sampled_grads`]: the loss as one scalar (call `backward`).
#[cfg(test)]
pub fn sampled_loss(
    ctx: &LossCtx,
    samples: &[Sample],
    scores: &[&SequenceScores],
    normalizer: f64,
) -> Result<(Tensor, f64)> {
    let batch = SampledBatch::new(*ctx, samples, scores)?;
    let loss = batch.loss_config();
    let drive = micro::Drive {
        loss: &loss,
        ..ctx.drive()
    };
    let (l, out) = micro::loss(&drive, &batch, units(normalizer))?;
    Ok((l, out.kd.loss))
}
