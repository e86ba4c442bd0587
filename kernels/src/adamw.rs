//! The AdamW update, in place on the CPU in three passes with no temporaries.

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};
use rayon::prelude::*;

/// AdamW hyper-parameters for one update (bias corrections already folded in by the caller's step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based step number (for bias correction).
    pub step: u64,
}

/// One AdamW update of `param` (f32 master weights) from `grad`, with moments `m`, `v` (f32):
/// `m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²;`
/// `p ← p − lr·wd·p − lr · m̂ / (√v̂ + eps)` with `m̂ = m/(1−β1^t)`, `v̂ = v/(1−β2^t)`.
///
/// On the CPU the three tensors are updated in place in three passes with no temporaries; on other
/// devices it falls back to tensor ops.
pub fn adamw_update(
    param: &candle_core::Var,
    grad: &Tensor,
    m: &candle_core::Var,
    v: &candle_core::Var,
    h: AdamWStep,
) -> Result<()> {
    let t = h.step.max(1) as i32;
    let bc1 = 1.0 - h.beta1.powi(t);
    let bc2 = 1.0 - h.beta2.powi(t);
    let grad = grad.to_dtype(param.dtype())?.contiguous()?;
    let all_cpu_f32 = param.device().is_cpu()
        && [param.dtype(), grad.dtype(), m.dtype(), v.dtype()]
            .iter()
            .all(|d| *d == DType::F32)
        && param.is_contiguous()
        && m.is_contiguous()
        && v.is_contiguous();
    if all_cpu_f32 {
        m.as_tensor().inplace_op2(
            &grad,
            &Moment {
                beta: h.beta1 as f32,
                square: false,
            },
        )?;
        v.as_tensor().inplace_op2(
            &grad,
            &Moment {
                beta: h.beta2 as f32,
                square: true,
            },
        )?;
        param
            .as_tensor()
            .inplace_op3(m.as_tensor(), v.as_tensor(), &Apply { h, bc1, bc2 })?;
        return Ok(());
    }
    let m_new = ((m.as_tensor() * h.beta1)? + (&grad * (1.0 - h.beta1))?)?;
    let v_new = ((v.as_tensor() * h.beta2)? + (grad.sqr()? * (1.0 - h.beta2))?)?;
    let update = ((&m_new / bc1)? / ((&v_new / bc2)?.sqrt()? + h.eps)?)?;
    let p = ((param.as_tensor() * (1.0 - h.lr * h.weight_decay))? - (update * h.lr)?)?;
    param.set(&p)?;
    m.set(&m_new)?;
    v.set(&v_new)?;
    Ok(())
}

/// The in-place CPU kernels alone: updates `param`, `m`, `v` (all contiguous f32 CPU tensors)
/// and returns `true`; returns `false` without touching anything when they do not apply.
/// `m` and `v` must not share storage with anything else.
pub fn adamw_update_in_place(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: AdamWStep,
) -> Result<bool> {
    let ok = param.device().is_cpu()
        && [param.dtype(), grad.dtype(), m.dtype(), v.dtype()]
            .iter()
            .all(|d| *d == DType::F32)
        && param.is_contiguous()
        && m.is_contiguous()
        && v.is_contiguous()
        && param.dims() == grad.dims()
        && param.dims() == m.dims()
        && param.dims() == v.dims();
    if !ok {
        return Ok(false);
    }
    let t = h.step.max(1) as i32;
    let (bc1, bc2) = (1.0 - h.beta1.powi(t), 1.0 - h.beta2.powi(t));
    let grad = grad.contiguous()?;
    m.inplace_op2(
        &grad,
        &Moment {
            beta: h.beta1 as f32,
            square: false,
        },
    )?;
    v.inplace_op2(
        &grad,
        &Moment {
            beta: h.beta2 as f32,
            square: true,
        },
    )?;
    param.inplace_op3(m, v, &Apply { h, bc1, bc2 })?;
    Ok(true)
}

struct Moment {
    beta: f32,
    square: bool,
}

fn f32_slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("in-place AdamW needs contiguous f32 tensors"),
    }
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("in-place AdamW needs contiguous f32 tensors"),
    }
}

impl candle_core::InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "xdistill-adamw-moment"
    }
    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        let (m, g) = (f32_slice_mut(dst, dl)?, f32_slice(g, gl)?);
        if m.len() != g.len() {
            candle_core::bail!("AdamW moment and gradient sizes differ");
        }
        let (b, c) = (self.beta, 1.0 - self.beta);
        let sq = self.square;
        m.par_chunks_mut(1 << 14)
            .zip(g.par_chunks(1 << 14))
            .for_each(|(m, g)| {
                for (m, &g) in m.iter_mut().zip(g) {
                    *m = b * *m + c * if sq { g * g } else { g };
                }
            });
        Ok(())
    }
}

struct Apply {
    h: AdamWStep,
    bc1: f64,
    bc2: f64,
}

impl candle_core::InplaceOp3 for Apply {
    fn name(&self) -> &'static str {
        "xdistill-adamw-apply"
    }
    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        m: &CpuStorage,
        ml: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        let (p, m, v) = (
            f32_slice_mut(dst, dl)?,
            f32_slice(m, ml)?,
            f32_slice(v, vl)?,
        );
        if p.len() != m.len() || p.len() != v.len() {
            candle_core::bail!("AdamW parameter and moment sizes differ");
        }
        let decay = (1.0 - self.h.lr * self.h.weight_decay) as f32;
        let (lr, eps) = (self.h.lr as f32, self.h.eps as f32);
        let (ibc1, ibc2) = ((1.0 / self.bc1) as f32, (1.0 / self.bc2) as f32);
        let chunk = 1 << 14;
        p.par_chunks_mut(chunk)
            .zip(m.par_chunks(chunk).zip(v.par_chunks(chunk)))
            .for_each(|(p, (m, v))| {
                for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                    *p = *p * decay - lr * (m * ibc1) / ((v * ibc2).sqrt() + eps);
                }
            });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn adamw_update_matches_f64_reference_for_three_steps() {
        let p0: Vec<f64> = (0..37).map(|i| (i as f64 * 0.37).sin()).collect();
        let grads: Vec<Vec<f64>> = (0..3)
            .map(|s| {
                (0..37)
                    .map(|i| ((i * (s + 2)) as f64 * 0.11).cos() * 0.3)
                    .collect()
            })
            .collect();
        let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.95, 1e-8, 0.1);
        // f64 reference of the textbook update.
        let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; 37], vec![0.0; 37]);
        for (s, g) in grads.iter().enumerate() {
            let t = (s + 1) as i32;
            for i in 0..37 {
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
                p[i] = p[i] - lr * wd * p[i] - lr * mh / (vh.sqrt() + eps);
            }
        }
        // f32 runs the fused in-place kernels; f64 runs the tensor-op path other devices use.
        for dtype in [DType::F32, DType::F64] {
            let mk = |v: &[f64]| {
                Var::from_tensor(
                    &Tensor::from_vec(v.to_vec(), 37, &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap(),
                )
                .unwrap()
            };
            let (param, mt, vt) = (mk(&p0), mk(&[0.0; 37]), mk(&[0.0; 37]));
            for (s, g) in grads.iter().enumerate() {
                let h = AdamWStep {
                    lr,
                    beta1: b1,
                    beta2: b2,
                    eps,
                    weight_decay: wd,
                    step: s as u64 + 1,
                };
                adamw_update(&param, mk(g).as_tensor(), &mt, &vt, h).unwrap();
            }
            let got: Vec<f64> = param
                .as_tensor()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            for i in 0..37 {
                assert!(
                    (got[i] - p[i]).abs() < 1e-5,
                    "{dtype:?} {i}: {} vs {}",
                    got[i],
                    p[i]
                );
            }
            let vm: Vec<f64> = vt
                .as_tensor()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!((vm[5] - v[5]).abs() < 1e-7, "{dtype:?}");
        }
    }
}
