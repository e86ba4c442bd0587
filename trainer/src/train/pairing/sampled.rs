//! On-policy samples with the student's own tokenizer: the teacher scores the student's ids, and
//! the sampled-token loss (`[loss] kd = sampled_kl`) trains on the completion positions with
//! the teacher's log-prob of each sampled token. The same pairing's collation of samples
//! ([`super::same`] holds its top-k losses).

use crate::collate::Encoded;
use crate::loss::{sampled_token_loss, Normalizer, SampledTargets};
use crate::train::step::LossCtx;
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

    /// The loss inputs of rows `a..a + n`, as `[1, n]`.
    fn targets(&self, a: usize, n: usize, device: &candle_core::Device) -> Result<SampledTargets> {
        Ok(SampledTargets {
            tokens: Tensor::from_vec(self.tokens[a..a + n].to_vec(), (1, n), device)?,
            teacher_logprobs: Tensor::from_vec(self.teacher[a..a + n].to_vec(), (1, n), device)?,
            old_logprobs: None, // one update per rollout: the ratio is exactly 1 (REINFORCE)
            mask: Tensor::ones((1, n), candle_core::DType::F32, device)?,
        })
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
) -> Result<(GradStore, f64)> {
    let (device, loss) = (ctx.device, ctx.loss);
    let normalizer = Normalizer::new(normalizer)?;
    let tb = crate::collate::pad_batch(&encoded(samples), 0, device)?;
    let rows = SampledRows::new(samples, scores, tb.ids.dim(1)?)?;
    let pass = ctx.head.forward(ctx.model, &tb.ids)?;
    let per = ctx.head.rows(ctx.model.lm_head().dim(0)?);
    let pieces = crate::train::head::row_pieces(&rows.sel, per);
    let chunk = |i: usize, logits: &Tensor| -> Result<crate::train::head::ChunkLoss> {
        let targets = rows.targets(i * per, pieces[i].rows.len(), device)?;
        let kd = sampled_token_loss(logits, &targets, loss.temperature, Some(normalizer))?;
        Ok(crate::train::head::ChunkLoss {
            kd: Some(kd),
            ce: None,
        })
    };
    let mix = crate::train::head::Mix::Linear {
        kd: loss.kd_weight,
        ce: 0.0,
    };
    let out = crate::train::head::run(ctx.model, pass.hidden(), &pieces, mix, chunk)?;
    let (g, sums) = out.finish(pass)?;
    Ok((g, sums.kd.loss))
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
    let (device, loss) = (ctx.device, ctx.loss);
    let normalizer = Normalizer::new(normalizer)?;
    let tb = crate::collate::pad_batch(&encoded(samples), 0, device)?;
    let (b, t) = tb.ids.dims2()?;
    let rows = SampledRows::new(samples, scores, t)?;
    let n = rows.sel.len();
    let hidden = ctx.model.forward_hidden(&tb.ids, None, None, None)?;
    let h = hidden.dim(2)?;
    let picked = hidden
        .reshape((b * t, h))?
        .index_select(&Tensor::from_vec(rows.sel.clone(), n, device)?, 0)?
        .unsqueeze(0)?;
    let logits = ctx.model.logits(&picked)?;
    let targets = rows.targets(0, n, device)?;
    let (l, m) = sampled_token_loss(&logits, &targets, loss.temperature, Some(normalizer))?;
    Ok((l.affine(loss.kd_weight, 0.0)?, m.loss))
}
