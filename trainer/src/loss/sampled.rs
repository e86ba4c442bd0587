//! On-policy sampled-token distillation (Tinker, ArcticTraining, Cosmos `top_k = 0`): only the
//! teacher's log-prob of each token the student sampled is needed.
//!
//! With `x_t` sampled from the student, `A_t = −(lp_S_old(x_t) − lp_T(x_t))` (no gradient) and
//! `ratio_t = exp(lp_S(x_t) − lp_S_old(x_t))`, the loss is `−Σ_t ratio_t·A_t / N`. With one
//! update per rollout (`old` = the current policy, detached) its value is the sampled reverse-KL
//! estimate `mean(lp_S − lp_T)` and its gradient the REINFORCE step `−A_t·∇lp_S(x_t)`.

use candle_core::{DType, Tensor};

use super::stable::{check_normalizer, check_temperature, logsumexp_last, masked_mean, LOG_FLOOR};
use super::{compute_dtype, KdMetrics, LossError, Result};

/// Inputs of [`sampled_token_loss`], all `[B, T]`, row `t` describing token `t + 1`.
#[derive(Debug, Clone)]
pub struct SampledTargets {
    /// u32: the sampled tokens (every entry `< V`; use 0 where masked).
    pub tokens: Tensor,
    /// f32: the teacher's log-prob of each sampled token.
    pub teacher_logprobs: Tensor,
    /// f32: the sampling policy's log-probs; `None` = the current student (one update/rollout).
    pub old_logprobs: Option<Tensor>,
    /// f32: 1 = a sampled (completion) token that counts.
    pub mask: Tensor,
}

/// Sampled-token loss from the student logits `[B, T, V]` at `temperature` (the sampling one).
/// No τ² factor. Metrics: `loss` is the surrogate's value.
pub fn sampled_token_loss(
    student_logits: &Tensor,
    targets: &SampledTargets,
    temperature: f64,
    normalizer: Option<f64>,
) -> Result<(Tensor, KdMetrics)> {
    check_normalizer(normalizer)?;
    check_temperature(temperature)?;
    let (b, t, _v) = student_logits.dims3()?;
    let same = |x: &Tensor| x.dims() == [b, t];
    if !same(&targets.tokens)
        || !same(&targets.teacher_logprobs)
        || !same(&targets.mask)
        || targets.old_logprobs.as_ref().is_some_and(|o| !same(o))
    {
        return Err(LossError::input(
            "sampled targets",
            format!("every input must be [B, T] = [{b}, {t}]"),
        ));
    }
    if targets.tokens.dtype() != DType::U32 {
        return Err(LossError::input("tokens", "must be u32"));
    }
    let dt = compute_dtype(student_logits);
    // 1. lp_S(x_t) = z[x] − logsumexp(z), [B, T].
    let z = student_logits
        .to_dtype(dt)?
        .affine(1.0 / temperature, 0.0)?;
    let zx = z
        .gather(&targets.tokens.contiguous()?.unsqueeze(2)?, 2)?
        .squeeze(2)?;
    let lp = (zx - logsumexp_last(&z)?)?;
    // 2. Advantage and ratio (the old policy and the teacher carry no gradient).
    let old = match &targets.old_logprobs {
        Some(o) => o.detach().to_dtype(dt)?,
        None => lp.detach(),
    };
    let lt = targets
        .teacher_logprobs
        .detach()
        .to_dtype(dt)?
        .maximum(LOG_FLOOR)?;
    let adv = (&lt - &old)?;
    let ratio = (&lp - &old)?.exp()?;
    let per_tok = (ratio * adv)?.neg()?;
    let (loss, count) = masked_mean(&per_tok, &targets.mask.to_dtype(dt)?, normalizer)?;
    let metrics = KdMetrics {
        loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        count,
        teacher_topk_mass: None,
        student_topk_mass: None,
    };
    Ok((loss, metrics))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::*;
    use candle_core::Device;

    #[test]
    fn value_and_gradient_match_the_reinforce_reference() {
        let (b, t, v) = (2, 3, 6);
        let mut r = rng(81);
        let zs = uniform(&mut r, b * t * v, 2.0);
        let x: Vec<u32> = (0..b * t).map(|i| ((i * 5 + 1) % v) as u32).collect();
        let lt = uniform(&mut r, b * t, 1.0)
            .iter()
            .map(|u| u - 2.0)
            .collect::<Vec<_>>();
        let mask = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
        let lp_of = |z: &[f64], p: usize| log_softmax(&z[p * v..(p + 1) * v])[x[p] as usize];
        let targets = SampledTargets {
            tokens: Tensor::from_vec(x.clone(), (b, t), &Device::Cpu).unwrap(),
            teacher_logprobs: tensor(&lt, &[b, t], DType::F64),
            old_logprobs: None,
            mask: tensor(&mask, &[b, t], DType::F64),
        };
        let vz = var(&zs, &[b, t, v]);
        let (l, m) = sampled_token_loss(vz.as_tensor(), &targets, 1.0, None).unwrap();
        // Value: mean over valid tokens of lp_S − lp_T (ratio 1).
        let want: f64 = (0..b * t)
            .filter(|&p| mask[p] == 1.0)
            .map(|p| lp_of(&zs, p) - lt[p])
            .sum::<f64>()
            / 5.0;
        assert!((scalar(&l) - want).abs() < 1e-12);
        assert_eq!(m.count, 5.0);
        // Gradient: the surrogate −Σ exp(lp − lp_old)·A / N with lp_old, A frozen at zs.
        let g = flat(l.backward().unwrap().get(vz.as_tensor()).unwrap());
        let fd = numeric_grad(&zs, 1e-5, |z| {
            -(0..b * t)
                .filter(|&p| mask[p] == 1.0)
                .map(|p| {
                    let old = lp_of(&zs, p);
                    (lp_of(z, p) - old).exp() * (lt[p] - old)
                })
                .sum::<f64>()
                / 5.0
        });
        assert_close(&g, &fd, 1e-8, "sampled grad");
    }
}
