//! Fused, differentiable ops the training losses lean on.
//!
//! `log_softmax` over a 150k-column vocabulary is the hottest op of a distillation step after the
//! LM-head matmul. candle's composed version materialises ~6 full `[N, V]` intermediates forward and
//! more backward; the fused CPU kernel below makes one pass to read and one to write, and its
//! backward (`g − softmax · Σg`) is fused too. Other devices use the composed ops.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// `log_softmax` over the last dimension, with a backward pass.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        x.contiguous()?.apply_op1(LogSoftmax)
    } else {
        candle_nn::ops::log_softmax(x, D::Minus1)
    }
}

struct LogSoftmax;

fn rows_fwd<T: num_like::Float>(src: &[T], dim: usize) -> Vec<T> {
    let mut out = vec![T::zero(); src.len()];
    out.par_chunks_mut(dim)
        .zip(src.par_chunks(dim))
        .for_each(|(o, x)| {
            let m = x.iter().fold(T::neg_inf(), |a, &b| a.max(b));
            let s: f64 = x.iter().map(|&v| (v - m).to_f64().exp()).sum();
            let lse = m + T::from_f64(s.ln());
            for (o, &v) in o.iter_mut().zip(x) {
                *o = v - lse;
            }
        });
    out
}

/// Backward: `grad_in = g − exp(y) · Σ_j g_j` per row, where `y` is the log-softmax output.
fn rows_bwd<T: num_like::Float>(g: &[T], y: &[T], dim: usize) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    out.par_chunks_mut(dim)
        .zip(g.par_chunks(dim).zip(y.par_chunks(dim)))
        .for_each(|(o, (g, y))| {
            let s: f64 = g.iter().map(|v| v.to_f64()).sum();
            let s = T::from_f64(s);
            for ((o, &g), &y) in o.iter_mut().zip(g).zip(y) {
                *o = g - y.exp() * s;
            }
        });
    out
}

fn contiguous_slice<'a, T>(s: &'a [T], l: &Layout) -> Result<&'a [T]> {
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
}

/// The little float abstraction the kernels need (f32 and f64).
mod num_like {
    pub trait Float:
        Copy
        + Send
        + Sync
        + PartialOrd
        + std::ops::Add<Output = Self>
        + std::ops::Sub<Output = Self>
        + std::ops::Mul<Output = Self>
    {
        fn zero() -> Self;
        fn neg_inf() -> Self;
        fn max(self, o: Self) -> Self;
        fn exp(self) -> Self;
        fn to_f64(self) -> f64;
        fn from_f64(v: f64) -> Self;
    }
    macro_rules! float {
        ($t:ty) => {
            impl Float for $t {
                fn zero() -> Self {
                    0.0
                }
                fn neg_inf() -> Self {
                    <$t>::NEG_INFINITY
                }
                fn max(self, o: Self) -> Self {
                    <$t>::max(self, o)
                }
                fn exp(self) -> Self {
                    <$t>::exp(self)
                }
                fn to_f64(self) -> f64 {
                    self as f64
                }
                fn from_f64(v: f64) -> Self {
                    v as $t
                }
            }
        };
    }
    float!(f32);
    float!(f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn data(n: usize, dtype: DType) -> Tensor {
        let v: Vec<f64> = (0..n)
            .map(|i| ((i * 37 % 101) as f64 / 10.0) - 5.0)
            .collect();
        Tensor::from_vec(v, (3, 4, n / 12), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    #[test]
    fn forward_and_backward_match_composed_ops() {
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&data(12 * 50, dtype)).unwrap();
            // A weighting so the upstream gradient is not uniform.
            let w = data(12 * 50, dtype).sin().unwrap();
            let fused = log_softmax(x.as_tensor()).unwrap();
            let composed = candle_nn::ops::log_softmax(x.as_tensor(), D::Minus1).unwrap();
            let diff = (&fused - &composed)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            assert!(diff.to_scalar::<f64>().unwrap() < 1e-5);
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
            let diff = (g1 - g2)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            assert!(diff.to_scalar::<f64>().unwrap() < 1e-5, "{dtype:?}");
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
