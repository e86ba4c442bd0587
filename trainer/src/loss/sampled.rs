//! On-policy sampled-token distillation (Tinker, ArcticTraining, Cosmos `top_k = 0`): only the
//! teacher's log-prob of each token the student sampled is needed.
//!
//! With `x_t` sampled from the student, `A_t = −(lp_S_old(x_t) − lp_T(x_t))` (no gradient) and
//! `ratio_t = exp(lp_S(x_t) − lp_S_old(x_t))`, the loss is `−Σ_t ratio_t·A_t / N`. With one
//! update per rollout (`old` = the current policy, detached) its value is the sampled reverse-KL
//! estimate `mean(lp_S − lp_T)` and its gradient the REINFORCE step `−A_t·∇lp_S(x_t)`.
//!
//! Across tokenizers ([`chunk_sampled_loss`]) the unit is an aligned chunk c: both sides spell the
//! same text after the same context, so `ℓS_c = Σ_{s∈c} lp_S` and `ℓT_c = Σ_{t∈c} lp_T` are two
//! models' log-probs of one event and `A_c = −(ℓS_old_c − ℓT_c)` is the same reverse-KL
//! advantage, exact up to the tokenizations being the canonical ones.

use candle_core::{DType, Tensor};

use super::stable::{logsumexp_last, mask_count, masked_mean_known, LOG_FLOOR};
use super::xtoken::{chunk_loglikelihoods, host_tensor, XTokenBatch};
use super::{compute_dtype, KdFigures, KdMetrics, LossError, Normalizer, Result, Temperature};
use xdistill_kernels::TopkKd;

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
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdMetrics)> {
    let count = mask_count(&targets.mask)?;
    let (loss, figures) =
        sampled_token_loss_pending(student_logits, targets, count, temperature, normalizer)?;
    Ok((loss, figures.read()?))
}

/// [`sampled_token_loss`] where the caller knows `count = Σ mask` (built from host data): its
/// value stays on the device ([`KdFigures::Pending`], `[1]`), so a GPU's queue never waits on
/// a head chunk's loss (two reads back per chunk before: the count and the value).
pub fn sampled_token_loss_pending(
    student_logits: &Tensor,
    targets: &SampledTargets,
    count: f64,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let normalizer = normalizer.map(Normalizer::get);
    let temperature = temperature.get();
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
    let lp = sampled_logprobs(student_logits, &targets.tokens, temperature)?;
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
    let mask = targets.mask.to_dtype(dt)?;
    let loss = masked_mean_known(&per_tok, &mask, count, normalizer)?;
    let figures = KdFigures::pending(&loss, &[], count)?;
    Ok((loss, figures))
}

/// `log_softmax(z/τ)` at `tokens` `[B, T]` of `logits` `[B, T, V]`, with its gradient, in the
/// loss dtype. Where the fused loss runs ([`TopkKd::runs_on`]) it is the negated cross-entropy
/// at temperature τ of the fused per-row kernel (the logits read once in their own dtype, no
/// `[B, T, V]` f32 copy or log-softmax); elsewhere the composed ops.
fn sampled_logprobs(logits: &Tensor, tokens: &Tensor, temperature: f64) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if TopkKd::runs_on(logits) {
        let n = b * t;
        let ce = TopkKd {
            temperature,
            ..TopkKd::cross_entropy()
        };
        let zero = Tensor::zeros((n, 1), compute_dtype(logits), logits.device())?;
        let out = xdistill_kernels::topk_kd(
            &logits.reshape((n, v))?,
            &tokens.contiguous()?.reshape((n, 1))?,
            &zero,
            ce,
        )?;
        return Ok(out.narrow(1, 0, 1)?.reshape((b, t))?.neg()?);
    }
    let z = logits
        .to_dtype(compute_dtype(logits))?
        .affine(1.0 / temperature, 0.0)?;
    let zx = z
        .gather(&tokens.contiguous()?.unsqueeze(2)?, 2)?
        .squeeze(2)?;
    Ok((zx - logsumexp_last(&z)?)?)
}

/// Chunk-level sampled reverse KL for samples scored by a teacher with another tokenizer.
///
/// Per aligned chunk c with both sides (the student's own sample, re-tokenised by both):
/// `A_c = ℓT_c − ℓS_old_c` (no gradient), `ratio_c = exp(ℓS_c − ℓS_old_c)`, and the loss is
/// `−Σ_c ratio_c·A_c / N`, N the chunks (or `normalizer`). With one update per rollout its value
/// is the per-chunk reverse-KL estimate `mean_c(ℓS_c − ℓT_c)` and its gradient
/// `−A_c·Σ_{s∈c} ∇lp_S(y_s)`: every student token of the chunk shares the chunk's advantage.
/// `student_logits` `[B, Ts, V]`; `batch` needs the targets and the teacher's target log-probs
/// (its top-k buffers are not read). No τ² factor (as [`sampled_token_loss`]).
pub fn chunk_sampled_loss(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let normalizer = normalizer.map(Normalizer::get);
    let temperature = temperature.get();
    let dt = compute_dtype(student_logits);
    let dev = student_logits.device();
    let chunks = batch.chunks()?;
    if chunks.is_empty() {
        return Ok((Tensor::zeros((), dt, dev)?, KdMetrics::default().into()));
    }
    // ℓS_c with gradient and ℓT_c, [C].
    let (ls, lt) = chunk_loglikelihoods(student_logits, batch, &chunks, temperature)?;
    let old = ls.detach();
    let adv = (host_tensor(lt, &[chunks.len()], dt, dev)? - &old)?;
    let ratio = (&ls - &old)?.exp()?;
    let n = normalizer.unwrap_or(chunks.len() as f64);
    let loss = (ratio * adv)?.sum_all()?.affine(-1.0 / n, 0.0)?;
    let figures = KdFigures::pending(&loss, &[], chunks.len() as f64)?;
    Ok((loss, figures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::*;
    use candle_core::Device;

    /// The loss and its gradient against the REINFORCE surrogate in f64 (value to 1e-12,
    /// gradient against central differences), composed and fused (the per-row kernel's f64
    /// reference, forced on here), at two temperatures.
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
        let targets = SampledTargets {
            tokens: Tensor::from_vec(x.clone(), (b, t), &Device::Cpu).unwrap(),
            teacher_logprobs: tensor(&lt, &[b, t], DType::F64),
            old_logprobs: None,
            mask: tensor(&mask, &[b, t], DType::F64),
        };
        for (fused, temp) in [(false, 1.0), (false, 0.7), (true, 1.0), (true, 0.7)] {
            let what = format!("fused {fused} τ {temp}");
            let lp_of = |z: &[f64], p: usize| {
                let row: Vec<f64> = z[p * v..(p + 1) * v].iter().map(|z| z / temp).collect();
                log_softmax(&row)[x[p] as usize]
            };
            xdistill_shared::model::device_ops::force_in_this_thread(fused.then_some(true));
            let vz = var(&zs, &[b, t, v]);
            let tau = Temperature::new(temp).unwrap();
            let (l, m) = sampled_token_loss(vz.as_tensor(), &targets, tau, None).unwrap();
            // Value: mean over valid tokens of lp_S − lp_T (ratio 1).
            let want: f64 = (0..b * t)
                .filter(|&p| mask[p] == 1.0)
                .map(|p| lp_of(&zs, p) - lt[p])
                .sum::<f64>()
                / 5.0;
            assert!((scalar(&l) - want).abs() < 1e-12, "{what}");
            assert_eq!(m.count, 5.0);
            assert_eq!((m.teacher_topk_mass, m.student_topk_mass), (None, None));
            // With the count given, the value stays on the device until read: the same bits.
            let (lp, f) =
                sampled_token_loss_pending(vz.as_tensor(), &targets, 5.0, tau, None).unwrap();
            assert!(matches!(&f, KdFigures::Pending { sums, .. } if sums.dims() == [1]));
            assert_eq!(f.read().unwrap(), m, "{what}");
            assert_eq!(scalar(&lp), scalar(&l), "{what}");
            // Gradient: the surrogate −Σ exp(lp − lp_old)·A / N with lp_old, A frozen at zs.
            let g = flat(l.backward().unwrap().get(vz.as_tensor()).unwrap());
            xdistill_shared::model::device_ops::force_in_this_thread(None);
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
            assert_close(&g, &fd, 1e-8, &format!("{what}: sampled grad"));
        }
    }
}

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use crate::loss::testutil::*;
    use crate::loss::xtoken::tests::{fixture, ref_chunks, B, TS, TT, VL};
    use candle_core::Device;

    /// Student log-prob of the target at `(b, p)`, from plain f64 loops.
    fn lp_at(x: &XTokenBatch, zs: &[f64], b: usize, p: usize, temp: f64) -> f64 {
        let o = (b * TS + p) * VL;
        let z: Vec<f64> = zs[o..o + VL].iter().map(|z| z / temp).collect();
        log_softmax(&z)[x.student_targets[b * TS + p] as usize]
    }

    /// Reference surrogate `−Σ_c exp(ℓS_c(z) − ℓS_c(z0))·(ℓT_c − ℓS_c(z0)) / C` in f64.
    fn reference(x: &XTokenBatch, z: &[f64], z0: &[f64], temp: f64) -> f64 {
        let chunks = ref_chunks(x);
        let ls = |zz: &[f64], b: usize, s: &[usize]| -> f64 {
            s.iter().map(|&p| lp_at(x, zz, b, p, temp)).sum()
        };
        -chunks
            .iter()
            .map(|(b, s, t)| {
                let lt: f64 = t
                    .iter()
                    .map(|&p| x.teacher_target_logprobs[b * TT + p] as f64)
                    .sum();
                let old = ls(z0, *b, s);
                (ls(z, *b, s) - old).exp() * (lt - old)
            })
            .sum::<f64>()
            / chunks.len() as f64
    }

    #[test]
    fn value_and_gradient_match_the_chunk_reinforce_reference() {
        for (seed, temp) in [(91, 1.0), (92, 0.7)] {
            let (x, zs) = fixture(seed, 1.0);
            let want = reference(&x, &zs, &zs, temp);
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                let z = tensor(&zs, &[B, TS, VL], dtype);
                let (l, m) = chunk_sampled_loss(&z, &x, temperature(temp), None).unwrap();
                let m = m.read().unwrap();
                assert!((scalar(&l) - want).abs() < tol * want.abs().max(1.0));
                assert_eq!(m.count, ref_chunks(&x).len() as f64);
            }
            let v = var(&zs, &[B, TS, VL]);
            let (l, _) =
                chunk_sampled_loss(v.as_tensor(), &x, temperature(temp), Some(normalizer(4.0)))
                    .unwrap();
            let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
            let c = ref_chunks(&x).len() as f64;
            let fd = numeric_grad(&zs, 1e-5, |z| reference(&x, z, &zs, temp) * c / 4.0);
            assert_close(&g, &fd, 1e-8, "chunk sampled grad");
        }
    }

    /// With every chunk one student and one teacher token, the chunk loss is the token-level
    /// [`sampled_token_loss`] on the same log-probs (an independent code path).
    #[test]
    fn one_to_one_chunks_equal_the_token_level_loss() {
        let (mut x, zs) = fixture(93, 1.0);
        // Row-major 1:1 chunks over the first min(TS, TT) − 1 positions of each row.
        let n = TS.min(TT) - 1;
        for b in 0..B {
            for p in 0..TS {
                x.student_chunk[b * TS + p] = if p < n { p as i64 } else { -1 };
            }
            for p in 0..TT {
                x.teacher_chunk[b * TT + p] = if p < n { p as i64 } else { -1 };
            }
            x.num_chunks[b] = n;
        }
        let z = tensor(&zs, &[B, TS, VL], DType::F64);
        let (l, _) = chunk_sampled_loss(&z, &x, Temperature::ONE, None).unwrap();
        let (mut tlp, mut mask) = (vec![0.0; B * TS], vec![0.0; B * TS]);
        for b in 0..B {
            for p in 0..n {
                tlp[b * TS + p] = x.teacher_target_logprobs[b * TT + p] as f64;
                mask[b * TS + p] = 1.0;
            }
        }
        let targets = SampledTargets {
            tokens: Tensor::from_vec(x.student_targets.clone(), (B, TS), &Device::Cpu).unwrap(),
            teacher_logprobs: tensor(&tlp, &[B, TS], DType::F64),
            old_logprobs: None,
            mask: tensor(&mask, &[B, TS], DType::F64),
        };
        let (want, _) = sampled_token_loss(&z, &targets, Temperature::ONE, None).unwrap();
        assert!((scalar(&l) - scalar(&want)).abs() < 1e-12);
        let v = var(&zs, &[B, TS, VL]);
        let grad = |l: Tensor| flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let g1 = grad(
            chunk_sampled_loss(v.as_tensor(), &x, Temperature::ONE, None)
                .unwrap()
                .0,
        );
        let g2 = grad(
            sampled_token_loss(v.as_tensor(), &targets, Temperature::ONE, None)
                .unwrap()
                .0,
        );
        assert_close(&g1, &g2, 1e-12, "1:1 chunks vs tokens");
    }

    #[test]
    fn a_chunk_the_teacher_prefers_is_pushed_up() {
        // One chunk, teacher more confident than the student: the loss falls along −∇.
        let (x, zs) = fixture(94, 1.0);
        let mut x = x;
        for v in x.teacher_target_logprobs.iter_mut() {
            *v = 0.0;
        }
        let v = var(&zs, &[B, TS, VL]);
        let (l, _) = chunk_sampled_loss(v.as_tensor(), &x, Temperature::ONE, None).unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        let stepped: Vec<f64> = zs.iter().zip(&g).map(|(z, g)| z - 0.1 * g).collect();
        let lp_sum = |zz: &[f64]| -> f64 {
            ref_chunks(&x)
                .iter()
                .flat_map(|(b, s, _)| s.iter().map(move |&p| (*b, p)))
                .map(|(b, p)| lp_at(&x, zz, b, p, 1.0))
                .sum()
        };
        assert!(lp_sum(&stepped) > lp_sum(&zs) + 1e-3);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let (x, zs) = fixture(95, 1.0);
        let z = tensor(&zs, &[B, TS, VL], DType::F32);
        let mut bad = x.clone();
        bad.student_targets[0] = VL as u32;
        assert!(chunk_sampled_loss(&z, &bad, Temperature::ONE, None).is_err());
        let mut bad = x.clone();
        bad.teacher_target_logprobs[0] = f32::NAN;
        assert!(chunk_sampled_loss(&z, &bad, Temperature::ONE, None).is_err());
        assert!(
            Temperature::new(0.0).is_err(),
            "a bad temperature cannot reach the loss"
        );
        let wrong = tensor(&zs[..TS * VL], &[1, TS, VL], DType::F32);
        assert!(chunk_sampled_loss(&wrong, &x, Temperature::ONE, None).is_err());
    }
}
