//! A head chunk's loss and its gradient by hand: the same tokenizer's top-k divergence and the
//! next-token cross-entropy from one kernel pass over the chunk's logits, and their gradient
//! written over those logits by a second (llm.c's fused classifier;
//! [`xdistill_kernels::TopkKdTrain`]). It runs where each row's gradient is known before the
//! loss, a linear mix of the terms (`kd_weight·KD + w·CE`): the gradient of the chunk's loss at
//! row r's divergence is `kd_weight·τ²·mask_r/N_kd`, at its cross-entropy `w·mask_r/N_ce`. The
//! on-policy sampled-token loss too: at row r's cross-entropy (the sampled token's), its
//! gradient is `kd_weight·A_r·mask_r/N` with the advantage `A_r` from the same kernel pass.
//!
//! Through autograd the same chunk ran two losses, each its own kernels and `[n, V]` gradient,
//! and candle's backward gave every node that reaches the logits a fill and an add of `[n, V]`
//! (each loss's reshape, then the logits': about twenty passes over `[n, V]` where this makes
//! three). The values are the autograd path's (`super::kl::fused_topk_divergence`,
//! `super::ce::fused_cross_entropy`): the same kernels' arithmetic, one rounding of the summed
//! gradient instead of one per term and one for their sum.

use super::kl::{fused_loss, kd_value_and_figures, Divergence, TopkTargets};
use super::stable::{masked_mean_known, LOG_FLOOR};
use super::{
    compute_dtype, KdFigures, LossConfig, Normalizer, Result, SampledTargets, TailMode, Temperature,
};
use candle_core::Tensor;
use xdistill_kernels::{TopkKd, TopkKdTrain, TRAIN_MAX_K};

/// The distillation term of a chunk in the fused form.
#[derive(Debug, Clone)]
pub enum FusedKd {
    /// The same tokenizer's top-k divergence.
    Topk(FusedTopk),
    /// The on-policy sampled-token loss (`sampled_kl`, one update per rollout).
    Sampled(FusedSampled),
}

/// The same tokenizer's top-k divergence of a chunk.
#[derive(Debug, Clone)]
pub struct FusedTopk {
    /// The chunk's teacher rows `[1, n, k]` (distinct ids).
    pub targets: TopkTargets,
    pub divergence: Divergence,
    pub tail: TailMode,
    pub temperature: Temperature,
    /// The step's distillation units.
    pub normalizer: Normalizer,
}

impl FusedKd {
    /// `config`'s distillation term over `targets` in the fused form, where it has one: a top-k
    /// divergence ([`LossConfig::divergence`]) with distinct teacher ids, at most
    /// [`TRAIN_MAX_K`] of them per row, on logits the fused kernels run for (`head`: the LM
    /// head whose logits these are). `None`: the term runs through autograd.
    pub fn topk(
        config: &LossConfig,
        targets: TopkTargets,
        normalizer: Normalizer,
        head: &Tensor,
    ) -> Result<Option<FusedKd>> {
        let Some(divergence) = config.divergence() else {
            return Ok(None);
        };
        let k = targets.ids.dim(2)?;
        if !targets.distinct || k > TRAIN_MAX_K || !TopkKd::runs_on(head) {
            return Ok(None);
        }
        Ok(Some(FusedKd::Topk(FusedTopk {
            targets,
            divergence,
            tail: config.tail.unwrap_or(TailMode::Bucket),
            temperature: config.temperature,
            normalizer,
        })))
    }

    /// The sampled-token loss over `targets` in the fused form, where the fused kernels run
    /// for `head` (the LM head whose logits these are) and the ratio is exactly 1 (no old
    /// log-probs: one update per rollout); `count` = Σ mask, known on the host.
    pub fn sampled(
        targets: SampledTargets,
        count: f64,
        temperature: Temperature,
        normalizer: Normalizer,
        head: &Tensor,
    ) -> Option<FusedKd> {
        (targets.old_logprobs.is_none() && TopkKd::runs_on(head)).then_some(FusedKd::Sampled(
            FusedSampled {
                targets,
                count,
                temperature,
                normalizer,
            },
        ))
    }
}

/// The on-policy sampled-token loss of a chunk: `−Σ_r ratio_r·A_r / N` with the ratio 1 and
/// `A_r = lp_T − lp_S` (no gradient), so each row's gradient is its cross-entropy's at the
/// sampled token times `A_r / N`, a weight the kernel's first pass gives (`lp_S = −CE`).
#[derive(Debug, Clone)]
pub struct FusedSampled {
    /// `[1, n]` each: the sampled tokens, the teacher's log-probs of them, the mask.
    pub targets: SampledTargets,
    /// Σ mask.
    pub count: f64,
    /// The sampling temperature.
    pub temperature: Temperature,
    /// The step's distillation units.
    pub normalizer: Normalizer,
}

/// The cross-entropy of a chunk: each row's next token `[1, n]` u32, its mask `[1, n]` and
/// count, and the step's trained tokens.
#[derive(Debug, Clone)]
pub struct FusedCe {
    pub targets: Tensor,
    pub mask: Tensor,
    pub count: f64,
    pub normalizer: Normalizer,
}

/// A chunk's terms in the fused form.
#[derive(Debug, Clone)]
pub struct FusedTerms {
    pub kd: Option<FusedKd>,
    pub ce: Option<FusedCe>,
}

/// What [`run`] computed (detached scalars on the device, as the autograd path's values).
#[derive(Debug)]
pub struct FusedOut {
    /// The distillation term (τ² and the normalizer applied, before its weight) and its
    /// figures ([`KdFigures::Pending`]).
    pub kd: Option<(Tensor, KdFigures)>,
    /// The cross-entropy (normalised, before its weight) and the chunk's trained tokens.
    pub ce: Option<(Tensor, f64)>,
}

/// Runs `terms` on `logits` `[1, n, V]` (or `[n, V]`; contiguous, their own buffer) and writes
/// the gradient of `kd_w·KD + ce_w·CE` over them. Returns the terms' values.
pub fn run(logits: &Tensor, terms: &FusedTerms, kd_w: f64, ce_w: f64) -> Result<FusedOut> {
    apply(logits, terms, Some((kd_w, ce_w)))
}

/// The terms' values alone (one kernel pass over the logits, nothing written): what a mix
/// whose weights come from the totals (NeMo's dynamic scaling) reads first.
pub fn values(logits: &Tensor, terms: &FusedTerms) -> Result<FusedOut> {
    apply(logits, terms, None)
}

/// [`run`] (`weights` given) or [`values`] (`None`).
fn apply(logits: &Tensor, terms: &FusedTerms, weights: Option<(f64, f64)>) -> Result<FusedOut> {
    if !logits.is_contiguous() {
        // A reshape would copy them, and the gradient would land in the copy.
        return Err(super::LossError::input(
            "logits",
            "the fused head writes its gradient over contiguous logits",
        ));
    }
    let v = logits.dim(candle_core::D::Minus1)?;
    let n = logits.elem_count() / v.max(1);
    let z = logits.reshape((n, v))?; // a view: the gradient is written into `logits`
    let acc = compute_dtype(logits);
    let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.reshape((n, 1))?.to_dtype(acc)?) };
    match (&terms.kd, &terms.ce) {
        (Some(FusedKd::Sampled(sk)), None) => {
            let kd = sampled(&z, sk, weights.map(|w| w.0))?;
            Ok(FusedOut {
                kd: Some(kd),
                ce: None,
            })
        }
        (Some(FusedKd::Sampled(_)), Some(_)) => Err(super::LossError::config(
            "ce",
            "the sampled-token loss trains without the cross-entropy term",
        )),
        (Some(FusedKd::Topk(kd)), ce) => {
            let k = kd.targets.ids.dim(2)?;
            let tau = kd.temperature.get();
            let lts = kd
                .targets
                .logprobs
                .detach()
                .to_dtype(acc)?
                .maximum(LOG_FLOOR)?
                .reshape((n, k))?;
            let ids = kd.targets.ids.reshape((n, k))?;
            let ce_targets = ce.as_ref().map(|c| c.targets.reshape(n)).transpose()?;
            let loss = fused_loss(kd.divergence, kd.tail, kd.temperature);
            let op = TopkKdTrain::new(&z, &ids, &lts, ce_targets.as_ref(), loss)?;
            // [n, 4 | 6]: divergence, masses, lse (and the cross-entropy, lse₁).
            let out = op.figures(&z)?;
            if let Some((kd_w, ce_w)) = weights {
                let kd_mask = rows(&kd.targets.mask)?;
                let g_kd = kd_mask.affine(kd_w * tau * tau / kd.normalizer.get(), 0.0)?;
                let g_ce = match ce {
                    Some(c) => rows(&c.mask)?.affine(ce_w / c.normalizer.get(), 0.0)?,
                    None => g_kd.zeros_like()?,
                };
                op.grad_into_logits(&z, &out, &Tensor::cat(&[&g_kd, &g_ce], 1)?)?;
            }
            let kd_out = kd_value_and_figures(
                &out,
                &kd.targets.mask.reshape(n)?,
                kd.targets.count,
                Some(kd.normalizer),
                tau,
            )?;
            let ce_out = match ce {
                Some(c) => {
                    let nll = out.narrow(1, 4, 1)?.reshape((1, n))?;
                    Some((ce_value(&nll, c)?, c.count))
                }
                None => None,
            };
            Ok(FusedOut {
                kd: Some(kd_out),
                ce: ce_out,
            })
        }
        // The cross-entropy alone (SFT): the k = 1 case of the same kernels.
        (None, Some(c)) => {
            let ids = c.targets.reshape((n, 1))?;
            let zero = Tensor::zeros((n, 1), acc, logits.device())?;
            let op = TopkKdTrain::new(&z, &ids, &zero, None, TopkKd::cross_entropy())?;
            let out = op.figures(&z)?;
            if let Some((_, ce_w)) = weights {
                let g = rows(&c.mask)?.affine(ce_w / c.normalizer.get(), 0.0)?;
                op.grad_into_logits(&z, &out, &Tensor::cat(&[&g, &g.zeros_like()?], 1)?)?;
            }
            let nll = out.narrow(1, 0, 1)?.reshape((1, n))?;
            Ok(FusedOut {
                kd: None,
                ce: Some((ce_value(&nll, c)?, c.count)),
            })
        }
        (None, None) => Ok(FusedOut { kd: None, ce: None }),
    }
}

/// The sampled-token loss of `sk` on `z` `[n, V]` (its gradient × `kd_w` written over `z` where
/// a weight is given): the value as [`super::sampled_token_loss_pending`] gives it, and its
/// figures.
fn sampled(z: &Tensor, sk: &FusedSampled, kd_w: Option<f64>) -> Result<(Tensor, KdFigures)> {
    let n = z.dim(0)?;
    let acc = compute_dtype(z);
    let t = &sk.targets;
    let ids = t.tokens.contiguous()?.reshape((n, 1))?;
    let zero = Tensor::zeros((n, 1), acc, z.device())?;
    let ce = TopkKd {
        temperature: sk.temperature.get(),
        ..TopkKd::cross_entropy()
    };
    let op = TopkKdTrain::new(z, &ids, &zero, None, ce)?;
    let out = op.figures(z)?;
    let lp = out.narrow(1, 0, 1)?.neg()?; // [n, 1]: log_softmax(z/τ) at the sampled token
    let lt = t
        .teacher_logprobs
        .detach()
        .to_dtype(acc)?
        .maximum(LOG_FLOOR)?
        .reshape((n, 1))?;
    let mask = t.mask.to_dtype(acc)?.reshape((n, 1))?;
    // d(−lp·A/N)/dCE = A/N (lp = −CE, A frozen), per unit of the loss's weight.
    let adv = (&lt - &lp)?;
    if let Some(kd_w) = kd_w {
        let g = (&adv * &mask)?.affine(kd_w / sk.normalizer.get(), 0.0)?;
        op.grad_into_logits(z, &out, &Tensor::cat(&[&g, &g.zeros_like()?], 1)?)?;
    }
    // The value: mean over the units of −ratio·A = lp − lp_T.
    let per_tok = adv.neg()?.reshape(n)?;
    let loss = masked_mean_known(
        &per_tok,
        &mask.reshape(n)?,
        sk.count,
        Some(sk.normalizer.get()),
    )?;
    let figures = KdFigures::pending(&loss, &[], sk.count)?;
    Ok((loss, figures))
}

/// The cross-entropy's value as [`super::ce::cross_entropy_known`] gives it.
fn ce_value(nll: &Tensor, c: &FusedCe) -> Result<Tensor> {
    let mask = c.mask.to_dtype(nll.dtype())?;
    masked_mean_known(nll, &mask, c.count, Some(c.normalizer.get()))
}
