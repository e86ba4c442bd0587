//! Approximate likelihood matching (ALM) on byte-aligned chunks: only the teacher's log-probs of
//! the actual next tokens are needed.
//!
//! Per chunk c, `ℓ_c = Σ_{t∈c} lp(x_t)` on each side; `a = ℓT_c/τ`, `b = ℓS_c/τ`;
//! `loss_c = −[e^a·b + (1 − e^a)·log(1 − e^b)]` (a binary cross-entropy between the tempered
//! chunk likelihoods), averaged over chunks with both sides. No τ² factor: τ here flattens chunk
//! likelihoods, it is not a softmax temperature.

use candle_core::Tensor;

use super::stable::log1mexp;
use super::xtoken::{chunk_loglikelihoods, host_tensor, XTokenBatch};
use super::{compute_dtype, KdFigures, KdMetrics, LossError, Normalizer, Result, Temperature};

/// Floor of `1 − e^b` in the log (a chunk the student is certain of, `b = 0`).
const ALM_FLOOR: f64 = 1e-9;

/// ALM loss.
///
/// * `student_logits`: `[B, Ts, V]`; `batch.student_targets` (`[B, Ts]`, `< V`) are the tokens
///   each position predicts, `batch.teacher_target_logprobs` (`[B, Tt]`) the teacher's log-probs
///   of its own next tokens, queried at `temperature` (normally 1; the student uses the same).
/// * `tau`: the ALM temperature (≈ 100).
pub fn alm_loss(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    tau: f64,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let normalizer = normalizer.map(Normalizer::get);
    let temperature = temperature.get();
    if !(tau.is_finite() && tau > 0.0) {
        return Err(LossError::config(
            "kd.tau",
            format!("must be > 0, got {tau}"),
        ));
    }
    let dt = compute_dtype(student_logits);
    let dev = student_logits.device().clone();
    let chunks = batch.chunks()?;
    if chunks.is_empty() {
        return Ok((Tensor::zeros((), dt, &dev)?, KdMetrics::default().into()));
    }
    let (ls, lt) = chunk_loglikelihoods(student_logits, batch, &chunks, temperature)?;
    let n_c = chunks.len();

    // Binary cross-entropy of the tempered chunk likelihoods, [C].
    let pa: Vec<f64> = lt.iter().map(|l| (l / tau).exp()).collect();
    let qa: Vec<f64> = pa.iter().map(|p| 1.0 - p).collect();
    let bb = ls.affine(1.0 / tau, 0.0)?;
    let pa_t = host_tensor(pa, &[n_c], dt, &dev)?;
    let qa_t = host_tensor(qa, &[n_c], dt, &dev)?;
    let per_chunk = ((pa_t * &bb)? + (qa_t * log1mexp(&bb, ALM_FLOOR)?)?)?.neg()?;
    let n = normalizer.unwrap_or(n_c as f64);
    let loss = per_chunk.sum_all()?.affine(1.0 / n, 0.0)?;
    let figures = KdFigures::pending(&loss, &[], n_c as f64)?;
    Ok((loss, figures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::*;
    use crate::loss::xtoken::tests::{fixture, ref_chunks, B, TS, TT, VL};
    use candle_core::DType;

    /// Reference: chunk sums of target log-probs as loops, the BCE with f64 `ln_1p`/`exp_m1`.
    fn reference(x: &XTokenBatch, zs: &[f64], tau: f64, temp: f64) -> f64 {
        let chunks = ref_chunks(x);
        let mut total = 0.0;
        for (b, s, t) in &chunks {
            let lt: f64 = t
                .iter()
                .map(|&p| x.teacher_target_logprobs[b * TT + p] as f64)
                .sum();
            let ls: f64 = s
                .iter()
                .map(|&p| {
                    let o = (b * TS + p) * VL;
                    let z: Vec<f64> = zs[o..o + VL].iter().map(|z| z / temp).collect();
                    log_softmax(&z)[x.student_targets[b * TS + p] as usize]
                })
                .sum();
            let (a, bb) = (lt / tau, ls / tau);
            total -= a.exp() * bb + (-a.exp_m1()) * (-bb.exp_m1()).ln();
        }
        total / chunks.len() as f64
    }

    #[test]
    fn matches_reference_and_finite_differences() {
        for (seed, tau) in [(11, 100.0), (12, 3.0)] {
            let (x, zs) = fixture(seed, 1.0);
            let want = reference(&x, &zs, tau, 1.0);
            for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 1e-4)] {
                let (l, m) = alm_loss(
                    &tensor(&zs, &[B, TS, VL], dtype),
                    &x,
                    tau,
                    Temperature::ONE,
                    None,
                )
                .unwrap();
                let m = m.read().unwrap();
                assert!(
                    (scalar(&l) - want).abs() < tol * want.abs(),
                    "τ={tau} {dtype:?}: {} vs {want}",
                    scalar(&l)
                );
                assert_eq!(m.count, 6.0);
            }
            let v = var(&zs, &[B, TS, VL]);
            let (l, _) = alm_loss(v.as_tensor(), &x, tau, Temperature::ONE, None).unwrap();
            let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
            let fd = numeric_grad(&zs, 1e-5, |z| reference(&x, z, tau, 1.0));
            assert_close(&g, &fd, 1e-7, "alm grad");
        }
    }

    #[test]
    fn equal_chunk_likelihoods_are_a_stationary_point() {
        // Teacher chunk log-likelihoods set to the student's own: ∂loss/∂ℓS = 0 at b = a.
        let (mut x, zs) = fixture(13, 1.0);
        for (b, s, t) in ref_chunks(&x) {
            let ls: f64 = s
                .iter()
                .map(|&p| {
                    let o = (b * TS + p) * VL;
                    log_softmax(&zs[o..o + VL])[x.student_targets[b * TS + p] as usize]
                })
                .sum();
            for (i, &p) in t.iter().enumerate() {
                x.teacher_target_logprobs[b * TT + p] = if i == 0 { ls as f32 } else { 0.0 };
            }
        }
        let v = var(&zs, &[B, TS, VL]);
        let (l, _) = alm_loss(v.as_tensor(), &x, 10.0, Temperature::ONE, None).unwrap();
        let g = flat(l.backward().unwrap().get(v.as_tensor()).unwrap());
        assert!(g.iter().all(|g| g.abs() < 1e-6), "{g:?}");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let (x, zs) = fixture(14, 1.0);
        let z = tensor(&zs, &[B, TS, VL], DType::F32);
        let mut bad = x.clone();
        bad.student_targets[0] = VL as u32;
        assert!(alm_loss(&z, &bad, 100.0, Temperature::ONE, None).is_err());
        let mut bad = x.clone();
        bad.teacher_target_logprobs[0] = f32::NAN;
        assert!(alm_loss(&z, &bad, 100.0, Temperature::ONE, None).is_err());
        assert!(alm_loss(&z, &x, 0.0, Temperature::ONE, None).is_err());
    }
}
