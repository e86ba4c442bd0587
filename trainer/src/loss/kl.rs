//! Same-tokenizer distillation over the teacher's top-k set K: forward KL, reverse KL,
//! generalized JSD(β) and the total variation distance, with the mass outside K renormalised
//! away, kept as a tail bucket, or ignored.
//!
//! Conventions: row `t` of the student logits predicts token `t + 1`, as the teacher's rows do.
//! The client asks the server for `temperature = τ`, so the teacher values are already
//! `log_softmax(z_T/τ)`; the student side is `log_softmax(z_S/τ)` over its full vocabulary,
//! gathered at K. The loss is multiplied by τ² and averaged over valid tokens.

use candle_core::{DType, Device, Tensor, D};

use super::stable::{
    log1mexp, logaddexp, logsumexp_last, mask_count, masked_mean_known, LOG_FLOOR, TAIL_FLOOR,
};
use super::{
    compute_dtype, KdFigures, KdMetrics, LossError, Normalizer, Result, TailMode, Temperature,
};
use xdistill_kernels::{KdDivergence, KdTail, TopkKd};

/// A divergence between the teacher (T) and student (S) distributions over K (+ tail).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Divergence {
    /// KL(T‖S) = Σ p_T (lp_T − lp_S).
    Forward,
    /// KL(S‖T) = Σ p_S (lp_S − lp_T).
    Reverse,
    /// β·KL(T‖M) + (1−β)·KL(S‖M), M = β·p_T + (1−β)·p_S. As in TRL, β = 0 is exactly forward KL
    /// and β = 1 exactly reverse KL (the mixture formula itself tends to β·KL(T‖S) and
    /// (1−β)·KL(S‖T) there).
    Jsd { beta: f64 },
    /// TV(T, S) = ½ Σ |p_T − p_S|.
    TotalVariation,
}

/// The teacher's top-k targets for a batch, on the student's device.
#[derive(Debug, Clone)]
pub struct TopkTargets {
    /// `[B, T, k]` u32: teacher top-k ids (every id below the student's vocabulary size).
    pub ids: Tensor,
    /// `[B, T, k]` f32: the teacher's `log_softmax(z_T/τ)` at `ids` (finite, ≤ 0).
    pub logprobs: Tensor,
    /// `[B, T]` f32: 1 where the position counts, 0 for padding / prompt.
    pub mask: Tensor,
    /// Every position's ids are distinct (a teacher's top-k always are): the fused loss
    /// ([`xdistill_kernels::topk_kd()`]) may run; otherwise the composed one does.
    pub distinct: bool,
    /// `Σ mask`, known on the host (so the loss reads nothing back to count its units).
    pub count: f64,
}

impl TopkTargets {
    /// Targets from tensors already on the device (`distinct` as [`TopkTargets::distinct`]
    /// says); the mask is read back once to count its units.
    pub fn new(ids: Tensor, logprobs: Tensor, mask: Tensor, distinct: bool) -> Result<Self> {
        let count = mask_count(&mask)?;
        Ok(Self {
            ids,
            logprobs,
            mask,
            distinct,
            count,
        })
    }

    /// Builds validated targets from host buffers (row-major `[B, T, k]`, `[B, T]`).
    ///
    /// Valid positions must have ids `< vocab` and non-NaN log-probs (−∞ becomes [`LOG_FLOOR`],
    /// rounding above 0 is clipped to 0). Masked positions are overwritten with harmless values.
    #[allow(clippy::too_many_arguments)]
    pub fn from_host(
        batch: usize,
        len: usize,
        k: usize,
        ids: &[u32],
        logprobs: &[f32],
        mask: &[f32],
        vocab: usize,
        device: &Device,
    ) -> Result<Self> {
        let n = batch * len;
        if k == 0 {
            return Err(LossError::input("k", "must be at least 1"));
        }
        if ids.len() != n * k || logprobs.len() != n * k || mask.len() != n {
            return Err(LossError::input(
                "targets",
                format!(
                    "expected {} ids/logprobs and {n} mask values for [B={batch}, T={len}, k={k}], \
                     got {} / {} / {}",
                    n * k,
                    ids.len(),
                    logprobs.len(),
                    mask.len()
                ),
            ));
        }
        let mut ids = ids.to_vec();
        let mut lps = logprobs.to_vec();
        let uniform = -(k as f32).ln();
        let mut distinct = true;
        let mut count = 0.0;
        // Each id's last position (its stamp), to see a repeated id in O(k) per position
        // (a sort of each row's k ids was a quarter of a k = 32,000 test's time).
        let mut seen_at = vec![0u32; vocab];
        let mut stamp = 0u32;
        for (p, &valid) in mask.iter().enumerate() {
            let row = p * k..(p + 1) * k;
            if valid == 0.0 {
                ids[row.clone()].fill(0);
                lps[row].fill(uniform);
                continue;
            }
            count += 1.0;
            if valid != 1.0 {
                return Err(LossError::input(
                    "mask",
                    format!("position {p}: mask must be 0 or 1, got {valid}"),
                ));
            }
            stamp = stamp.checked_add(1).unwrap_or_else(|| {
                seen_at.fill(0);
                1
            });
            for i in row {
                let id = ids[i] as usize;
                if id >= vocab {
                    return Err(LossError::input(
                        "ids",
                        format!("position {p}: id {id} >= vocab {vocab}"),
                    ));
                }
                if seen_at[id] == stamp {
                    distinct = false;
                }
                seen_at[id] = stamp;
                let v = lps[i];
                if v.is_nan() {
                    return Err(LossError::input("logprobs", format!("position {p}: NaN")));
                }
                lps[i] = v.clamp(LOG_FLOOR as f32, 0.0);
            }
        }
        Ok(Self {
            ids: Tensor::from_vec(ids, (batch, len, k), device)?,
            logprobs: Tensor::from_vec(lps, (batch, len, k), device)?,
            mask: Tensor::from_vec(mask.to_vec(), (batch, len), device)?,
            distinct,
            count,
        })
    }

    /// Batch rows `start..start + n` of these targets (gradient accumulation's micro-batches).
    pub fn batch_rows(&self, start: usize, n: usize) -> Result<Self> {
        let rows = |t: &Tensor| t.narrow(0, start, n);
        Self::new(
            rows(&self.ids)?,
            rows(&self.logprobs)?,
            rows(&self.mask)?,
            self.distinct,
        )
    }
}

/// Per-position divergence `[.., n] × [.., n] -> [..]`, summed over the last dim.
pub fn divergence(lp_t: &Tensor, lp_s: &Tensor, div: Divergence) -> Result<Tensor> {
    let fwd =
        |a: &Tensor, b: &Tensor| -> Result<Tensor> { Ok((a.exp()? * (a - b)?)?.sum(D::Minus1)?) };
    match div {
        Divergence::Forward => fwd(lp_t, lp_s),
        Divergence::Reverse => fwd(lp_s, lp_t),
        Divergence::Jsd { beta } if beta <= 0.0 => fwd(lp_t, lp_s),
        Divergence::Jsd { beta } if beta >= 1.0 => fwd(lp_s, lp_t),
        Divergence::Jsd { beta } => {
            let lm = logaddexp(
                &lp_t.affine(1.0, beta.ln())?,
                &lp_s.affine(1.0, (1.0 - beta).ln())?,
            )?;
            let kt = fwd(lp_t, &lm)?;
            let ks = fwd(lp_s, &lm)?;
            Ok((kt.affine(beta, 0.0)? + ks.affine(1.0 - beta, 0.0)?)?)
        }
        Divergence::TotalVariation => Ok((lp_t.exp()? - lp_s.exp()?)?
            .abs()?
            .sum(D::Minus1)?
            .affine(0.5, 0.0)?),
    }
}

/// `x / τ` in the compute dtype (no extra op when τ = 1).
fn scaled(x: &Tensor, dt: DType, inv_t: f64) -> Result<Tensor> {
    let x = x.to_dtype(dt)?;
    Ok(if inv_t == 1.0 {
        x
    } else {
        x.affine(inv_t, 0.0)?
    })
}

/// Top-k distillation loss.
///
/// * `student_logits`: `[B, T, V]` (any float dtype; computed in f32, or f64 when given f64).
/// * `targets`: teacher top-k ids / log-probs `[B, T, k]` at temperature τ, mask `[B, T]`.
/// * `normalizer`: divide by this instead of the local valid-token count (pass the global count
///   of an accumulated batch so that micro-batch losses add up to the full-batch mean).
///
/// Returns `τ² · Σ_valid D_t / N` (a scalar) and detached metrics.
pub fn topk_divergence(
    student_logits: &Tensor,
    targets: &TopkTargets,
    div: Divergence,
    tail: TailMode,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdMetrics)> {
    let (loss, figures) =
        topk_divergence_figures(student_logits, targets, div, tail, temperature, normalizer)?;
    Ok((loss, figures.read()?))
}

/// [`topk_divergence`] with its figures as the loss left them: the fused loss's still on the
/// device ([`KdFigures::Pending`]), for a caller that reads a whole step's figures at once.
pub fn topk_divergence_figures(
    student_logits: &Tensor,
    targets: &TopkTargets,
    div: Divergence,
    tail: TailMode,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let (b, t, _v) = student_logits.dims3()?;
    let (tb, tt, k) = targets.ids.dims3()?;
    if (tb, tt) != (b, t) || targets.logprobs.dims() != [b, t, k] || targets.mask.dims() != [b, t] {
        return Err(LossError::input(
            "targets",
            format!(
                "shapes ids {:?} logprobs {:?} mask {:?} do not match logits {:?}",
                targets.ids.dims(),
                targets.logprobs.dims(),
                targets.mask.dims(),
                student_logits.dims()
            ),
        ));
    }
    if targets.ids.dtype() != DType::U32 {
        return Err(LossError::input("targets.ids", "must be u32"));
    }
    if targets.distinct && TopkKd::runs_on(student_logits) {
        return fused_topk_divergence(student_logits, targets, div, tail, temperature, normalizer);
    }
    let temperature = temperature.get();
    let normalizer = normalizer.map(Normalizer::get);
    let dt = compute_dtype(student_logits);
    let inv_t = 1.0 / temperature;
    let ids = targets.ids.contiguous()?;

    // 1. Teacher log-probs at K (no gradient), [B, T, k]; their log-mass in K, [B, T].
    let lp_t = targets.logprobs.detach().to_dtype(dt)?.maximum(LOG_FLOOR)?;
    let lse_t = logsumexp_last(&lp_t)?;

    // 2. Both sides as n-way log-distributions (n = k or k + 1), [B, T, n].
    let (lp_t_n, lp_s_n, lse_s_k) = match tail {
        TailMode::Renormalize => {
            // The full-vocab normaliser cancels: only the gathered logits enter the graph.
            let zk = scaled(&student_logits.gather(&ids, 2)?, dt, inv_t)?;
            let lse_zk = logsumexp_last(&zk)?;
            let lp_s = zk.broadcast_sub(&lse_zk.unsqueeze(2)?)?;
            let lp_tn = lp_t.broadcast_sub(&lse_t.unsqueeze(2)?)?;
            // Metric only: log mass of K under the full student distribution.
            let lse_full = logsumexp_last(&scaled(&student_logits.detach(), dt, inv_t)?)?;
            (lp_tn, lp_s, (lse_zk.detach() - lse_full)?)
        }
        TailMode::Bucket | TailMode::Ignore => {
            // log p_S[K] = z[K]/τ − logsumexp(z/τ): no full [B, T, V] log-softmax is kept.
            // Fused on the CPU: the full [B, T, V] log-softmax is never materialised.
            let z = scaled(student_logits, dt, inv_t)?;
            let lsk = xdistill_kernels::gather_log_softmax(&z, &ids)?;
            let lse_s = logsumexp_last(&lsk)?;
            if tail == TailMode::Bucket {
                let tail_s = log1mexp(&lse_s, TAIL_FLOOR)?.unsqueeze(2)?;
                let tail_t = log1mexp(&lse_t, TAIL_FLOOR)?.unsqueeze(2)?;
                (
                    Tensor::cat(&[&lp_t, &tail_t], 2)?,
                    Tensor::cat(&[&lsk, &tail_s], 2)?,
                    lse_s.detach(),
                )
            } else {
                (lp_t, lsk, lse_s.detach())
            }
        }
    };

    // 3. Per-position divergence [B, T], masked mean, τ².
    let per_pos = divergence(&lp_t_n, &lp_s_n, div)?;
    let mask = targets.mask.to_dtype(dt)?;
    let count = targets.count;
    let loss = masked_mean_known(&per_pos, &mask, count, normalizer)?;
    let loss = loss.affine(temperature * temperature, 0.0)?;

    // The masses on K summed over the valid positions, left on the device with the loss.
    let mass_sum = |x: &Tensor| -> Result<Tensor> { Ok((x.exp()? * &mask)?.sum_all()?) };
    let figures = KdFigures::pending(&loss, &[&mass_sum(&lse_t)?, &mass_sum(&lse_s_k)?], count)?;
    Ok((loss, figures))
}

/// [`topk_divergence`] through the fused per-row loss ([`xdistill_kernels::topk_kd()`]: one
/// read of the logits forward, one backward, the gradient written once, the logits read in
/// their own dtype): what runs on CUDA with the project's kernels on; on the CPU its f64
/// reference (the tests hold it against the composed loss). Needs distinct ids per position.
/// Its figures stay on the device ([`KdFigures::Pending`]): nothing is read back.
pub(crate) fn fused_topk_divergence(
    student_logits: &Tensor,
    targets: &TopkTargets,
    div: Divergence,
    tail: TailMode,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let (b, t, v) = student_logits.dims3()?;
    let k = targets.ids.dim(2)?;
    let loss = fused_loss(div, tail, temperature);
    let lts = targets
        .logprobs
        .detach()
        .to_dtype(compute_dtype(student_logits))?
        .maximum(LOG_FLOOR)?;
    // [n, 4]: divergence, teacher mass on K, student mass on K, logsumexp.
    let out = xdistill_kernels::topk_kd(
        &student_logits.reshape((b * t, v))?,
        &targets.ids.reshape((b * t, k))?,
        &lts.reshape((b * t, k))?,
        loss,
    )?;
    kd_value_and_figures(
        &out,
        &targets.mask.reshape(b * t)?,
        targets.count,
        normalizer,
        temperature.get(),
    )
}

/// The fused kernels' loss for `div`, `tail` and `temperature` (JSD's β at 0 or 1 is exactly
/// forward or reverse KL, as the composed loss has it).
pub(crate) fn fused_loss(div: Divergence, tail: TailMode, temperature: Temperature) -> TopkKd {
    let divergence = match div {
        Divergence::Forward => KdDivergence::Forward,
        Divergence::Reverse => KdDivergence::Reverse,
        Divergence::Jsd { beta } if beta <= 0.0 => KdDivergence::Forward,
        Divergence::Jsd { beta } if beta >= 1.0 => KdDivergence::Reverse,
        Divergence::Jsd { beta } => KdDivergence::Jsd(beta),
        Divergence::TotalVariation => KdDivergence::TotalVariation,
    };
    let tail = match tail {
        TailMode::Renormalize => KdTail::Renormalize,
        TailMode::Bucket => KdTail::Bucket,
        TailMode::Ignore => KdTail::Ignore,
    };
    TopkKd {
        divergence,
        tail,
        temperature: temperature.get(),
        tail_floor: TAIL_FLOOR,
    }
}

/// The distillation term from the fused kernels' rows `out` `[n, ≥ 4]` (divergence, teacher
/// mass on K, student mass on K, …) and the units' `mask` `[n]`: the masked mean of the
/// divergences over `count` units (or `normalizer`) times τ², and its figures left on the
/// device ([`KdFigures::Pending`]).
pub(crate) fn kd_value_and_figures(
    out: &Tensor,
    mask: &Tensor,
    count: f64,
    normalizer: Option<Normalizer>,
    tau: f64,
) -> Result<(Tensor, KdFigures)> {
    let n = mask.elem_count();
    let mask = mask.to_dtype(out.dtype())?;
    let column = |c: usize| out.narrow(1, c, 1).and_then(|x| x.reshape(n));
    let loss = masked_mean_known(&column(0)?, &mask, count, normalizer.map(Normalizer::get))?;
    let loss = loss.affine(tau * tau, 0.0)?;
    // The loss and both masses summed over the valid units, left on the device.
    let mass_sum = |c: usize| -> Result<Tensor> { Ok((column(c)?.detach() * &mask)?.sum_all()?) };
    let figures = KdFigures::pending(&loss, &[&mass_sum(1)?, &mass_sum(2)?], count)?;
    Ok((loss, figures))
}

#[cfg(test)]
mod tests;
