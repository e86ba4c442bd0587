//! The fused log-softmax over the last dimension, with its fused backward (`g − softmax · Σg`):
//! on the CPU (f32, f64) here, on CUDA (f32, with the project's kernels on:
//! `xdistill_shared::device::cuda_kernels`) through `kernels/cuda/src/log_softmax.cu`.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// `log_softmax` over the last dimension, with a backward pass.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let fused = if x.device().is_cpu() {
        matches!(x.dtype(), DType::F32 | DType::F64)
    } else {
        x.device().is_cuda() && x.dtype() == DType::F32 && xdistill_shared::device::cuda_kernels()
    };
    if fused {
        x.contiguous()?.apply_op1(LogSoftmax)
    } else {
        candle_nn::ops::log_softmax(x, D::Minus1)
    }
}

struct LogSoftmax;

fn rows_fwd<T: crate::num_like::Float>(src: &[T], dim: usize) -> Vec<T> {
    let mut out = vec![T::zero(); src.len()];
    out.par_chunks_mut(dim)
        .zip(src.par_chunks(dim))
        .for_each(|(o, x)| {
            let m = T::row_max(x);
            let lse = m + T::from_f64(T::sum_exp(x, m).ln());
            for (o, &v) in o.iter_mut().zip(x) {
                *o = v - lse;
            }
        });
    out
}

/// Backward: `grad_in = g − exp(y) · Σ_j g_j` per row, where `y` is the log-softmax output.
fn rows_bwd<T: crate::num_like::Float>(g: &[T], y: &[T], dim: usize) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    out.par_chunks_mut(dim)
        .zip(g.par_chunks(dim).zip(y.par_chunks(dim)))
        .for_each(|(o, (g, y))| {
            let s: f64 = g.iter().map(|v| v.to_f64()).sum();
            // o = e^y · s, then g − o.
            T::exp_scaled(y, T::zero(), T::from_f64(s), o);
            for (o, &g) in o.iter_mut().zip(g) {
                *o = g - *o;
            }
        });
    out
}

pub(crate) fn contiguous_slice<'a, T>(s: &'a [T], l: &Layout) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("fused log_softmax needs a contiguous input"),
    }
}

impl CustomOp1 for LogSoftmax {
    fn name(&self) -> &'static str {
        "xdistill-log-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dim = *l.dims().last().unwrap_or(&1);
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(rows_fwd(contiguous_slice(v, l)?, dim)),
            CpuStorage::F64(v) => CpuStorage::F64(rows_fwd(contiguous_slice(v, l)?, dim)),
            _ => candle_core::bail!("fused log_softmax: f32 or f64 only"),
        };
        Ok((out, l.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        xdistill_cuda_kernels::log_softmax_f32(s, l)
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            grad_res
                .contiguous()?
                .apply_op2_no_bwd(&res.contiguous()?, &LogSoftmaxBwd)?,
        ))
    }
}

struct LogSoftmaxBwd;

impl CustomOp2 for LogSoftmaxBwd {
    fn name(&self) -> &'static str {
        "xdistill-log-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dim = *lg.dims().last().unwrap_or(&1);
        let out = match (g, y) {
            (CpuStorage::F32(g), CpuStorage::F32(y)) => CpuStorage::F32(rows_bwd(
                contiguous_slice(g, lg)?,
                contiguous_slice(y, ly)?,
                dim,
            )),
            (CpuStorage::F64(g), CpuStorage::F64(y)) => CpuStorage::F64(rows_bwd(
                contiguous_slice(g, lg)?,
                contiguous_slice(y, ly)?,
                dim,
            )),
            _ => candle_core::bail!("fused log_softmax backward: f32 or f64 only"),
        };
        Ok((out, lg.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        xdistill_cuda_kernels::log_softmax_bwd_f32(g, lg, y, ly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{data, max_abs};
    use candle_core::{Device, Var};

    #[test]
    fn forward_and_backward_match_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&data(12 * 50, dtype)).unwrap();
            // A weighting so the upstream gradient is not uniform.
            let w = data(12 * 50, dtype).sin().unwrap();
            let fused = log_softmax(x.as_tensor()).unwrap();
            let composed = candle_nn::ops::log_softmax(x.as_tensor(), D::Minus1).unwrap();
            assert!(max_abs(&fused, &composed) < 1e-5);
            let g1 = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (composed * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (g1, g2) = (
                g1.get(x.as_tensor()).unwrap(),
                g2.get(x.as_tensor()).unwrap(),
            );
            assert!(max_abs(g1, g2) < 1e-5, "{dtype:?}");
        }
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let base: Vec<f64> = (0..7).map(|i| (i as f64 * 0.9).cos() * 3.0).collect();
        let w: Vec<f64> = (0..7).map(|i| i as f64 - 2.5).collect();
        let f = |v: &[f64]| -> f64 {
            let t = Tensor::from_vec(v.to_vec(), (1, 7), &Device::Cpu).unwrap();
            let y: Vec<f64> = log_softmax(&t)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            y.iter().zip(&w).map(|(a, b)| a * b).sum()
        };
        let x = Var::from_tensor(&Tensor::from_vec(base.clone(), (1, 7), &Device::Cpu).unwrap())
            .unwrap();
        let wt = Tensor::from_vec(w.clone(), (1, 7), &Device::Cpu).unwrap();
        let g = (log_softmax(x.as_tensor()).unwrap() * wt)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<f64> = g
            .get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for i in 0..7 {
            let (mut p, mut m) = (base.clone(), base.clone());
            p[i] += 1e-6;
            m[i] -= 1e-6;
            let fd = (f(&p) - f(&m)) / 2e-6;
            assert!((fd - g[i]).abs() < 1e-6, "{i}: {fd} vs {}", g[i]);
        }
    }
}
