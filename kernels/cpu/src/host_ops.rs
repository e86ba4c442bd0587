//! Inference ops on f32 host tensors where candle's lose time or accuracy: the attention's row
//! softmax and the gated MLP's `silu(gate) · up` (candle calls a scalar `exp` per element; these
//! use the shared SIMD exp, [`crate::simd`], at the level chosen at start-up), and RMSNorm
//! (candle's sums the squares in one running f32 sum and rounds twice per value; this one sums
//! in f64 and rounds once: issue 49, the largest single loss of the f32 forward against f64,
//! `shared/examples/f32_error_by_op.rs`). Each splits the work over rayon by whole rows, so a
//! row's values do not depend on the split or the thread count. Other devices and dtypes, and
//! the differentiable ops, keep candle's.

use crate::simd::{self, exp2_nonpos, Simd};
use crate::simd_dispatch;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Values per rayon job (whole rows): below this, splitting costs more than it saves.
const JOB_VALUES: usize = 16_384;

/// Softmax over the last dimension of `x` ([..., n]). `-inf` entries (masked keys) get exactly
/// 0; a row that is all `-inf` gives NaNs, as candle's does.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !x.device().is_cpu() {
        return candle_nn::ops::softmax_last_dim(x);
    }
    x.contiguous()?.apply_op1_no_bwd(&SoftmaxRows)
}

/// RMSNorm over the last dimension of `x` ([..., n]) with `weight` (\[n\]):
/// `x · w / √(mean(x²) + eps)`, the mean of squares summed in f64 and each value rounded to f32
/// once, from its f64 product.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !x.device().is_cpu() || weight.dtype() != DType::F32 {
        return candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps as f32);
    }
    x.contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &RmsNormRows { eps })
}

/// `silu(gate) · up`, elementwise (`gate` and `up` of one shape).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dtype() != DType::F32 || !gate.device().is_cpu() || gate.shape() != up.shape() {
        return gate.silu()? * up;
    }
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &SiluMul)
}

/// The contiguous f32 values of a host tensor, for a custom op's `cpu_fwd` (`op`: its name).
pub fn values<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(x) = s else {
        candle_core::bail!("{op} takes f32");
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("{op} takes a contiguous tensor");
    };
    Ok(&x[a..b])
}

struct SoftmaxRows;

impl CustomOp1 for SoftmaxRows {
    fn name(&self) -> &'static str {
        "softmax-rows-simd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = values(s, l, self.name())?;
        let n = l.dims().last().copied().unwrap_or(1).max(1);
        let mut y = vec![0f32; x.len()];
        let job = n * (JOB_VALUES / n).max(1);
        let level = Simd::current();
        y.par_chunks_mut(job)
            .zip(x.par_chunks(job))
            .for_each(|(y, x)| {
                for (y, x) in y.chunks_mut(n).zip(x.chunks(n)) {
                    softmax_row(level, x, y);
                }
            });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }
}

struct SiluMul;

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul-simd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (values(s1, l1, self.name())?, values(s2, l2, self.name())?);
        if g.len() != u.len() {
            candle_core::bail!("silu-mul-simd: {:?} and {:?}", l1.dims(), l2.dims());
        }
        let mut y = vec![0f32; g.len()];
        let level = Simd::current();
        y.par_chunks_mut(JOB_VALUES)
            .zip(g.par_chunks(JOB_VALUES).zip(u.par_chunks(JOB_VALUES)))
            .for_each(|(y, (g, u))| silu_mul_slice(level, g, u, y));
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }
}

struct RmsNormRows {
    eps: f64,
}

impl CustomOp2 for RmsNormRows {
    fn name(&self) -> &'static str {
        "rms-norm-rows-f64"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (values(s1, l1, self.name())?, values(s2, l2, self.name())?);
        let n = l1.dims().last().copied().unwrap_or(0);
        if w.len() != n || n == 0 {
            candle_core::bail!("rms-norm: input {:?}, weight {:?}", l1.dims(), l2.dims());
        }
        let mut y = vec![0f32; x.len()];
        let job = n * (JOB_VALUES / n).max(1);
        y.par_chunks_mut(job)
            .zip(x.par_chunks(job))
            .for_each(|(y, x)| {
                for (y, x) in y.chunks_mut(n).zip(x.chunks(n)) {
                    rms_norm_row(x, w, self.eps, y);
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }
}

/// One row of [`rms_norm`]. The squares are exact in f64; four running sums (combined in a
/// fixed order) keep the adds off one dependency chain. Scalar code in a fixed order: the same
/// bits at every SIMD level.
fn rms_norm_row(x: &[f32], w: &[f32], eps: f64, y: &mut [f32]) {
    let mut acc = [0f64; 4];
    let mut quads = x.chunks_exact(4);
    for q in &mut quads {
        for (a, &v) in acc.iter_mut().zip(q) {
            *a += v as f64 * v as f64;
        }
    }
    for (a, &v) in acc.iter_mut().zip(quads.remainder()) {
        *a += v as f64 * v as f64;
    }
    let ss = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    let r = 1.0 / (ss / x.len() as f64 + eps).sqrt();
    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
        *y = (x as f64 * r * w as f64) as f32;
    }
}

simd_dispatch!(fn softmax_row(x: &[f32], y: &mut [f32]) = softmax_body);
simd_dispatch!(fn silu_mul_slice(g: &[f32], u: &[f32], y: &mut [f32]) = silu_mul_body);

/// `e^x` for `x ≤ 0`, exactly 0 below `2^-126` (so `-inf` gives 0, not the smallest normal).
#[inline(always)]
fn exp_or_zero(x: f32) -> f32 {
    let t = x * std::f32::consts::LOG2_E;
    let e = exp2_nonpos(t);
    if t < -126.0 {
        0.0
    } else {
        e
    }
}

#[inline(always)]
fn softmax_body(x: &[f32], y: &mut [f32]) {
    let m = simd::max(x);
    for (y, &v) in y.iter_mut().zip(x) {
        *y = exp_or_zero(v - m);
    }
    // In lanes, as the max: sixteen partial sums added at the end.
    let mut acc = [0f32; simd::LANES];
    let mut it = y.chunks_exact(simd::LANES);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    let sum = acc.iter().chain(it.remainder()).sum::<f32>();
    for y in y.iter_mut() {
        *y /= sum;
    }
}

/// `silu(g) = g · σ(g)`, with `σ(g) = 1 / (1 + e^{-g})` for `g ≥ 0` and `e^g / (1 + e^g)`
/// below, so that the exp's argument is never positive.
#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
        let e = exp_or_zero(-g.abs());
        let num = if g >= 0.0 { g } else { g * e };
        *y = num / (1.0 + e) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lcg_noise;
    use candle_core::Device;

    fn host(x: &Tensor) -> Vec<f32> {
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Rows of several lengths (the remainder of the 16 lanes included), masked keys and a
    /// wide spread: within 1e-6 of the f64 softmax, masked keys exactly 0, every SIMD level
    /// the same bits, and a row's values the same whatever rows share the call.
    #[test]
    fn softmax_matches_f64_and_masks_exactly() {
        let dev = Device::Cpu;
        for n in [1usize, 7, 16, 33, 300] {
            let rows = 70;
            let mut x = lcg_noise(n as u64, rows * n, 8.0);
            for (i, v) in x.iter_mut().enumerate() {
                if i % n > i / n % n {
                    *v = f32::NEG_INFINITY; // a causal mask
                }
            }
            let t = Tensor::from_vec(x.clone(), (2, rows / 2, n), &dev).unwrap();
            let got = host(&softmax_last_dim(&t).unwrap());
            for r in 0..rows {
                let row = &x[r * n..(r + 1) * n];
                let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
                let z: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
                for (j, &v) in row.iter().enumerate() {
                    let want = (v as f64 - m).exp() / z;
                    let g = got[r * n + j];
                    if v == f32::NEG_INFINITY {
                        assert_eq!(g, 0.0, "n {n} row {r} col {j}");
                    } else {
                        assert!(
                            (g as f64 - want).abs() < 1e-6,
                            "n {n} row {r}: {g} vs {want}"
                        );
                    }
                }
                let mut alone = vec![0f32; n];
                for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
                    softmax_row(level, row, &mut alone);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&alone), bits(&got[r * n..(r + 1) * n]), "{level:?}");
                }
            }
        }
        // A row with every key masked has no softmax: NaNs, as candle's op gives.
        let masked = Tensor::new(&[[f32::NEG_INFINITY; 5]], &dev).unwrap();
        let ours = host(&softmax_last_dim(&masked).unwrap());
        let candle = host(&candle_nn::ops::softmax_last_dim(&masked).unwrap());
        assert!(
            ours.iter().chain(&candle).all(|v| v.is_nan()),
            "{ours:?} {candle:?}"
        );
    }

    /// A real-size row (n = 4096, values over six orders of magnitude, and short rows): each
    /// value within half an ulp (plus the f64 sum's rounding) of the f64 RMSNorm — candle's op,
    /// one running f32 sum and two roundings per value, is up to several ulps off here (issue
    /// 49) —, a row's values the same alone and among others, and candle's to 1e-5.
    #[test]
    fn rms_norm_rounds_the_f64_norm_once() {
        let dev = Device::Cpu;
        for (n, rows) in [(4096usize, 6usize), (576, 40), (5, 3), (1, 2)] {
            let mut x = lcg_noise(n as u64 + 7, rows * n, 1.0);
            for (i, v) in x.iter_mut().enumerate() {
                *v *= 10f32.powi((i % 7) as i32 - 3);
            }
            let w = lcg_noise(3, n, 2.0);
            let eps = 1e-6;
            let xt = Tensor::from_vec(x.clone(), (rows, n), &dev).unwrap();
            let wt = Tensor::from_vec(w.clone(), n, &dev).unwrap();
            let got = host(&rms_norm(&xt, &wt, eps).unwrap());
            let candle = host(&candle_nn::ops::rms_norm(&xt, &wt, eps as f32).unwrap());
            for r in 0..rows {
                let row = &x[r * n..(r + 1) * n];
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                for j in 0..n {
                    let want = row[j] as f64 * inv * w[j] as f64;
                    let g = got[r * n + j] as f64;
                    let half_ulp = want.abs() * f32::EPSILON as f64 / 2.0;
                    assert!(
                        (g - want).abs() <= half_ulp * (1.0 + 1e-6) + 1e-45,
                        "n {n} row {r} col {j}: {g} vs {want}"
                    );
                    let c = candle[r * n + j] as f64;
                    assert!(
                        (c - want).abs() <= 1e-5 * want.abs() + 1e-30,
                        "candle {c} vs {want}"
                    );
                }
                let alone = Tensor::from_vec(row.to_vec(), (1, n), &dev).unwrap();
                let alone = host(&rms_norm(&alone, &wt, eps).unwrap());
                assert_eq!(
                    alone,
                    &got[r * n..(r + 1) * n],
                    "n {n} row {r}: batch-invariant"
                );
            }
        }
        // Shapes: the weight must match the last dimension.
        let x = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
        assert!(rms_norm(&x, &Tensor::ones(3, DType::F32, &dev).unwrap(), 1e-6).is_err());
    }

    /// Against f64 over a wide range of gates (the two branches of σ, large |g|), odd lengths,
    /// every SIMD level the same bits, and candle's `silu · up` to f32 rounding.
    #[test]
    fn silu_mul_matches_f64() {
        let dev = Device::Cpu;
        let n = 40_001; // several rayon jobs and a remainder
        let g = lcg_noise(1, n, 30.0);
        let u = lcg_noise(2, n, 2.0);
        let (gt, ut) = (
            Tensor::from_vec(g.clone(), n, &dev).unwrap(),
            Tensor::from_vec(u.clone(), n, &dev).unwrap(),
        );
        let got = host(&silu_mul(&gt, &ut).unwrap());
        let candle = host(&(gt.silu().unwrap() * &ut).unwrap());
        for i in 0..n {
            let (gi, ui) = (g[i] as f64, u[i] as f64);
            let want = gi / (1.0 + (-gi).exp()) * ui;
            let tol = 1e-6 * want.abs() + 1e-30;
            assert!(
                (got[i] as f64 - want).abs() <= tol,
                "g {gi}: {} vs {want}",
                got[i]
            );
            assert!(
                (got[i] - candle[i]).abs() <= 2e-6 * candle[i].abs() + 1e-30,
                "g {gi}"
            );
        }
        // Past the exp's range: σ(-100) ≈ 4e-44 is below f32's normals, σ(100) = 1.
        let edge = silu_mul(
            &Tensor::new(&[-100f32, 100.0, 0.0], &dev).unwrap(),
            &Tensor::new(&[1f32, 0.5, 3.0], &dev).unwrap(),
        )
        .unwrap();
        assert_eq!(host(&edge), [0.0, 50.0, 0.0]);
        for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
            let mut y = vec![0f32; n];
            silu_mul_slice(level, &g, &u, &mut y);
            assert!(
                y.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{level:?}"
            );
        }
    }
}
