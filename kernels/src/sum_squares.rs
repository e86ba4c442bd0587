//! `Σ x²` of a tensor in f64 (gradient norms), read in place on the CPU.

use crate::log_softmax::contiguous_slice;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// `Σ x²` over every element of `t`, accumulated in f64. On the CPU an f32/f64 tensor that is
/// contiguous, or the transpose of a contiguous matrix (a linear layer's weight gradient), is read
/// in place with no temporary; anything else uses tensor ops.
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    let view = if t.is_contiguous() {
        Some(t.clone())
    } else if t.rank() == 2 && t.t()?.is_contiguous() {
        Some(t.t()?)
    } else {
        None
    };
    if let (true, Some(v)) = (t.device().is_cpu(), view) {
        if matches!(v.dtype(), DType::F32 | DType::F64) {
            let out = v.apply_op1_no_bwd(&SumSquares)?;
            return out.to_dtype(DType::F64)?.to_scalar::<f64>();
        }
    }
    t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

struct SumSquares;

/// Chunks of 2^14 squared in their own dtype (vectorisable) and added in f64, in order: the
/// same bits whatever the thread count (a parallel `sum` would add in the pool's split order,
/// and data-parallel ranks must agree on the gradient norm).
fn sum_sq<T: crate::num_like::Float>(x: &[T]) -> f64 {
    let partials: Vec<f64> = x
        .par_chunks(1 << 14)
        .map(|c| c.iter().fold(T::zero(), |a, &v| a + v * v).to_f64())
        .collect();
    partials.iter().fold(0.0, |a, b| a + b)
}

impl CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "xdistill-sum-squares"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = match s {
            CpuStorage::F32(v) => sum_sq(contiguous_slice(v, l)?),
            CpuStorage::F64(v) => sum_sq(contiguous_slice(v, l)?),
            _ => candle_core::bail!("sum_squares: f32 or f64 only"),
        };
        Ok((CpuStorage::F64(vec![v]), Shape::from(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn sum_squares_matches_f64_loop_for_contiguous_transposed_and_strided() {
        let vals: Vec<f64> = (0..3 * 70_000)
            .map(|i| ((i % 977) as f64 * 0.013).sin())
            .collect();
        let want: f64 = vals.iter().map(|&v| (v as f32 as f64).powi(2)).sum();
        let t = Tensor::from_vec(vals.clone(), (3, 70_000), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        for (name, x) in [
            ("contiguous", t.clone()),
            ("transposed", t.t().unwrap()),
            ("f64", t.to_dtype(DType::F64).unwrap()),
        ] {
            let got = sum_squares(&x).unwrap();
            assert!((got - want).abs() < 1e-5 * want, "{name}: {got} vs {want}");
        }
        // A strided view (every other column) falls back to tensor ops.
        let half = t.reshape((3, 35_000, 2)).unwrap().narrow(2, 0, 1).unwrap();
        let want_half: f64 = vals
            .iter()
            .step_by(2)
            .map(|&v| (v as f32 as f64).powi(2))
            .sum();
        assert!((sum_squares(&half).unwrap() - want_half).abs() < 1e-6 * want_half);
    }
}
