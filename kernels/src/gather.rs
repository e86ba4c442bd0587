//! `log_softmax` gathered at given ids: the student's log-probs at the teacher's top-k ids and
//! the target, without materialising the `[.., V]` log-softmax on the CPU.

use crate::log_softmax::contiguous_slice;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// `log_softmax(x)` gathered at `idx` along the last dimension, `x[.., idx] − logsumexp(x)`:
/// `x [.., V]` (f32/f64) × `idx [.., m]` (u32, every id `< V`) `-> [.., m]`, with a backward pass.
///
/// A distillation step needs the student's log-probs only at the teacher's top-k ids and at the
/// target, so on the CPU the `[.., V]` log-softmax is never materialised: forward reads `x` twice
/// (max, then Σexp) and writes `[.., m]`; backward writes the one `[.., V]` gradient
/// `scatter(g) − softmax(x) · Σg`. On CUDA with the project's kernels on, the fused
/// [`crate::log_softmax`] then a gather; composed ops elsewhere.
pub fn gather_log_softmax(x: &Tensor, idx: &Tensor) -> Result<Tensor> {
    let (xd, id) = (x.dims(), idx.dims());
    if xd.is_empty() || xd.len() != id.len() || xd[..xd.len() - 1] != id[..id.len() - 1] {
        candle_core::bail!(
            "gather_log_softmax: ids {id:?} do not match x {xd:?} (all dims but the last)"
        );
    }
    if idx.dtype() != DType::U32 {
        candle_core::bail!("gather_log_softmax: ids must be u32");
    }
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        x.contiguous()?
            .apply_op2(&idx.contiguous()?, GatherLogSoftmax)
    } else if x.device().is_cuda()
        && x.dtype() == DType::F32
        && xdistill_shared::device::cuda_kernels()
    {
        // One kernel for the row's log-softmax (and one for its backward), then the gather.
        crate::log_softmax(x)?.gather(&idx.contiguous()?, D::Minus1)
    } else {
        let m = x.max_keepdim(D::Minus1)?.detach();
        let lse = (x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
        x.gather(&idx.contiguous()?, D::Minus1)?.broadcast_sub(&lse)
    }
}

struct GatherLogSoftmax;

/// `log Σ exp(x)` of one row, accumulated in f64.
pub(crate) fn row_lse<T: crate::num_like::Float>(x: &[T]) -> f64 {
    let m = T::row_max(x);
    m.to_f64() + T::sum_exp(x, m).ln()
}

fn check_ids(idx: &[u32], dim: usize) -> Result<()> {
    match idx.iter().find(|&&i| i as usize >= dim) {
        Some(i) => candle_core::bail!("gather_log_softmax: id {i} >= vocabulary {dim}"),
        None => Ok(()),
    }
}

fn gather_lsm_fwd<T: crate::num_like::Float>(x: &[T], idx: &[u32], dim: usize, m: usize) -> Vec<T> {
    let mut out = vec![T::zero(); idx.len()];
    out.par_chunks_mut(m.max(1))
        .zip(x.par_chunks(dim).zip(idx.par_chunks(m.max(1))))
        .for_each(|(o, (x, ids))| {
            let lse = row_lse(x);
            for (o, &i) in o.iter_mut().zip(ids) {
                *o = T::from_f64(x[i as usize].to_f64() - lse);
            }
        });
    out
}

/// `grad_x[j] = Σ_{i: idx_i = j} g_i − softmax(x)_j · Σ_i g_i` per row.
fn gather_lsm_bwd<T: crate::num_like::Float>(
    x: &[T],
    idx: &[u32],
    g: &[T],
    dim: usize,
    m: usize,
) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    let m = m.max(1);
    out.par_chunks_mut(dim)
        .zip(
            x.par_chunks(dim)
                .zip(idx.par_chunks(m).zip(g.par_chunks(m))),
        )
        .for_each(|(o, (x, (ids, g)))| {
            let lse = T::from_f64(row_lse(x));
            let s = g.iter().map(|v| v.to_f64()).sum::<f64>();
            // −softmax(x) · Σg (lse ≥ max, so every exponent is ≤ 0).
            T::exp_scaled(x, lse, T::from_f64(-s), o);
            for (&i, &gi) in ids.iter().zip(g) {
                o[i as usize] = o[i as usize] + gi;
            }
        });
    out
}

impl CustomOp2 for GatherLogSoftmax {
    fn name(&self) -> &'static str {
        "xdistill-gather-log-softmax"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        si: &CpuStorage,
        li: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dim = *l.dims().last().unwrap_or(&1);
        let m = *li.dims().last().unwrap_or(&1);
        let idx = match si {
            CpuStorage::U32(v) => contiguous_slice(v, li)?,
            _ => candle_core::bail!("gather_log_softmax: ids must be u32"),
        };
        check_ids(idx, dim)?;
        let out = match s {
            CpuStorage::F32(v) => {
                CpuStorage::F32(gather_lsm_fwd(contiguous_slice(v, l)?, idx, dim, m))
            }
            CpuStorage::F64(v) => {
                CpuStorage::F64(gather_lsm_fwd(contiguous_slice(v, l)?, idx, dim, m))
            }
            _ => candle_core::bail!("gather_log_softmax: f32 or f64 only"),
        };
        Ok((out, li.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        idx: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad_res.to_dtype(x.dtype())?.contiguous()?;
        let gx = x
            .contiguous()?
            .apply_op3_no_bwd(&idx.contiguous()?, &g, &GatherLogSoftmaxBwd)?;
        Ok((Some(gx), None))
    }
}

struct GatherLogSoftmaxBwd;

impl candle_core::CustomOp3 for GatherLogSoftmaxBwd {
    fn name(&self) -> &'static str {
        "xdistill-gather-log-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        si: &CpuStorage,
        li: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dim = *l.dims().last().unwrap_or(&1);
        let m = *li.dims().last().unwrap_or(&1);
        let idx = match si {
            CpuStorage::U32(v) => contiguous_slice(v, li)?,
            _ => candle_core::bail!("gather_log_softmax backward: ids must be u32"),
        };
        let out = match (s, sg) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(gather_lsm_bwd(
                contiguous_slice(x, l)?,
                idx,
                contiguous_slice(g, lg)?,
                dim,
                m,
            )),
            (CpuStorage::F64(x), CpuStorage::F64(g)) => CpuStorage::F64(gather_lsm_bwd(
                contiguous_slice(x, l)?,
                idx,
                contiguous_slice(g, lg)?,
                dim,
                m,
            )),
            _ => candle_core::bail!("gather_log_softmax backward: f32 or f64 only"),
        };
        Ok((out, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{data, max_abs};
    use candle_core::{Device, Var};

    /// Composed reference: full log-softmax, then gather.
    fn composed_gather(x: &Tensor, idx: &Tensor) -> Tensor {
        candle_nn::ops::log_softmax(x, D::Minus1)
            .unwrap()
            .gather(idx, D::Minus1)
            .unwrap()
    }

    #[test]
    fn gather_log_softmax_matches_composed_ops_with_repeated_ids() {
        let v = 50;
        // [3, 4, 5] ids with repeats within rows (the target may also be in the top-k).
        let mut ids: Vec<u32> = (0..60).map(|i| ((i * 13 + i / 7) % v) as u32).collect();
        for row in ids.chunks_mut(5) {
            row[2] = row[0]; // a repeated id in every row
        }
        let ids = Tensor::from_vec(ids, (3, 4, 5), &Device::Cpu).unwrap();
        for dtype in [DType::F64, DType::F32] {
            let x = Var::from_tensor(&data(12 * v, dtype)).unwrap();
            let w = Tensor::from_vec(
                (0..60).map(|i| (i as f64 * 0.7).sin()).collect::<Vec<_>>(),
                (3, 4, 5),
                &Device::Cpu,
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
            let fused = gather_log_softmax(x.as_tensor(), &ids).unwrap();
            let composed = composed_gather(x.as_tensor(), &ids);
            assert!(max_abs(&fused, &composed) < 1e-5, "{dtype:?} forward");
            let g1 = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (composed * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let d = max_abs(
                g1.get(x.as_tensor()).unwrap(),
                g2.get(x.as_tensor()).unwrap(),
            );
            assert!(d < 1e-5, "{dtype:?} backward {d}");
        }
    }

    #[test]
    fn gather_log_softmax_gradient_matches_finite_differences() {
        let base: Vec<f64> = (0..14).map(|i| (i as f64 * 0.9).cos() * 3.0).collect();
        let ids = Tensor::from_vec(vec![3u32, 0, 3, 6, 1, 1], (2, 3), &Device::Cpu).unwrap();
        let w = [0.5, -1.5, 2.0, 1.0, -0.25, 3.0];
        let f = |v: &[f64]| -> f64 {
            let t = Tensor::from_vec(v.to_vec(), (2, 7), &Device::Cpu).unwrap();
            let y: Vec<f64> = gather_log_softmax(&t, &ids)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            y.iter().zip(&w).map(|(a, b)| a * b).sum()
        };
        let x = Var::from_tensor(&Tensor::from_vec(base.clone(), (2, 7), &Device::Cpu).unwrap())
            .unwrap();
        let wt = Tensor::from_vec(w.to_vec(), (2, 3), &Device::Cpu).unwrap();
        let g = (gather_log_softmax(x.as_tensor(), &ids).unwrap() * wt)
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
        for i in 0..14 {
            let (mut p, mut m) = (base.clone(), base.clone());
            p[i] += 1e-6;
            m[i] -= 1e-6;
            let fd = (f(&p) - f(&m)) / 2e-6;
            assert!((fd - g[i]).abs() < 1e-6, "{i}: {fd} vs {}", g[i]);
        }
    }

    #[test]
    fn gather_log_softmax_rejects_bad_ids() {
        let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        let out_of_range = Tensor::from_vec(vec![0u32, 5], (2, 1), &Device::Cpu).unwrap();
        assert!(gather_log_softmax(&x, &out_of_range).is_err());
        let wrong_rows = Tensor::from_vec(vec![0u32, 1, 2], (3, 1), &Device::Cpu).unwrap();
        assert!(gather_log_softmax(&x, &wrong_rows).is_err());
        let wrong_dtype = Tensor::zeros((2, 1), DType::F32, &Device::Cpu).unwrap();
        assert!(gather_log_softmax(&x, &wrong_dtype).is_err());
    }
}
