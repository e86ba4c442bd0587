//! Fused, differentiable ops the training losses and the optimiser lean on (a crate of its own so
//! that it is optimised in dev builds and the teacher does not compile it).
//!
//! `log_softmax` over a 150k-column vocabulary is the hottest op of a distillation step after the
//! LM-head matmul. candle's composed version materialises ~6 full `[N, V]` intermediates forward and
//! more backward; the fused CPU kernel below makes one pass to read and one to write, and its
//! backward (`g − softmax · Σg`) is fused too. Other devices use the composed ops. In f32 the row
//! passes (max, Σexp, the softmax of the backward) are vectorised ([`vmath`]) and run at the
//! CPU's widest instruction set ([`xdistill_shared::simd::Simd`]), chosen once.

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
            let m = T::row_max(x);
            let lse = m + T::from_f64(T::sum_exp(x, m).ln());
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
            // o = e^y · s, then g − o.
            T::exp_scaled(y, T::zero(), T::from_f64(s), o);
            for (o, &g) in o.iter_mut().zip(g) {
                *o = g - *o;
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

/// `log_softmax(x)` gathered at `idx` along the last dimension, `x[.., idx] − logsumexp(x)`:
/// `x [.., V]` (f32/f64) × `idx [.., m]` (u32, every id `< V`) `-> [.., m]`, with a backward pass.
///
/// A distillation step needs the student's log-probs only at the teacher's top-k ids and at the
/// target, so on the CPU the `[.., V]` log-softmax is never materialised: forward reads `x` twice
/// (max, then Σexp) and writes `[.., m]`; backward writes the one `[.., V]` gradient
/// `scatter(g) − softmax(x) · Σg`. Other devices use composed ops.
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
    } else {
        let m = x.max_keepdim(D::Minus1)?.detach();
        let lse = (x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
        x.gather(&idx.contiguous()?, D::Minus1)?.broadcast_sub(&lse)
    }
}

struct GatherLogSoftmax;

/// `log Σ exp(x)` of one row, accumulated in f64.
fn row_lse<T: num_like::Float>(x: &[T]) -> f64 {
    let m = T::row_max(x);
    m.to_f64() + T::sum_exp(x, m).ln()
}

fn check_ids(idx: &[u32], dim: usize) -> Result<()> {
    match idx.iter().find(|&&i| i as usize >= dim) {
        Some(i) => candle_core::bail!("gather_log_softmax: id {i} >= vocabulary {dim}"),
        None => Ok(()),
    }
}

fn gather_lsm_fwd<T: num_like::Float>(x: &[T], idx: &[u32], dim: usize, m: usize) -> Vec<T> {
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
fn gather_lsm_bwd<T: num_like::Float>(
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

fn sum_sq<T: num_like::Float>(x: &[T]) -> f64 {
    x.par_chunks(1 << 14)
        .map(|c| {
            // f32 lanes per chunk (vectorisable), chunks added in f64.
            c.iter().fold(T::zero(), |a, &v| a + v * v).to_f64()
        })
        .sum()
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

/// Vectorisable f32 row passes, run at the CPU's widest [`Simd`] level (the same bits at every
/// level: no fused multiply-adds, fixed lane counts).
pub mod vmath {
    use xdistill_shared::simd::{self, exp_nonpos, Simd};
    use xdistill_shared::simd_dispatch;

    /// Values per f32 partial sum of [`sum_exp`] (each lane then adds ≤ 128 terms ≤ 1).
    const BLOCK: usize = 2048;

    /// The largest value of `x` (NaNs ignored; -inf for an empty row).
    pub fn max(x: &[f32]) -> f32 {
        max_at(Simd::current(), x)
    }

    /// `Σ e^{x_i − m}` for `m ≥ max(x)`: f32 lanes within a block of [`BLOCK`], f64 across.
    pub fn sum_exp(x: &[f32], m: f32) -> f64 {
        sum_exp_at(Simd::current(), x, m)
    }

    /// `out_i = scale · e^{x_i − shift}` for `shift ≥ max(x)`.
    pub fn exp_scaled(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
        exp_scaled_at(Simd::current(), x, shift, scale, out)
    }

    simd_dispatch!(pub(crate) fn max_at(x: &[f32]) -> f32 = max_body);
    simd_dispatch!(pub(crate) fn sum_exp_at(x: &[f32], m: f32) -> f64 = sum_exp_body);
    simd_dispatch!(pub(crate) fn exp_scaled_at(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) = exp_scaled_body);

    #[inline(always)]
    fn max_body(x: &[f32]) -> f32 {
        simd::max(x)
    }

    #[inline(always)]
    fn sum_exp_body(x: &[f32], m: f32) -> f64 {
        x.chunks(BLOCK)
            .map(|block| simd::sum_exp2(block, m, std::f32::consts::LOG2_E))
            .sum()
    }

    #[inline(always)]
    fn exp_scaled_body(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = exp_nonpos(v - shift) * scale;
        }
    }
}

/// The little float abstraction the kernels need (f32 and f64): f64 rows use the exact libm
/// exp (the gradient checks run in f64), f32 rows the vectorised passes of [`vmath`].
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
        fn to_f64(self) -> f64;
        fn from_f64(v: f64) -> Self;
        /// The row's largest value.
        fn row_max(x: &[Self]) -> Self;
        /// `Σ e^{x_i − m}` (m ≥ every x_i), accumulated in f64.
        fn sum_exp(x: &[Self], m: Self) -> f64;
        /// `out_i = scale · e^{x_i − shift}` (shift ≥ every x_i).
        fn exp_scaled(x: &[Self], shift: Self, scale: Self, out: &mut [Self]);
    }

    impl Float for f64 {
        fn zero() -> Self {
            0.0
        }
        fn to_f64(self) -> f64 {
            self
        }
        fn from_f64(v: f64) -> Self {
            v
        }
        fn row_max(x: &[Self]) -> Self {
            x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b))
        }
        fn sum_exp(x: &[Self], m: Self) -> f64 {
            x.iter().map(|&v| (v - m).exp()).sum()
        }
        fn exp_scaled(x: &[Self], shift: Self, scale: Self, out: &mut [Self]) {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = (v - shift).exp() * scale;
            }
        }
    }

    impl Float for f32 {
        fn zero() -> Self {
            0.0
        }
        fn to_f64(self) -> f64 {
            self as f64
        }
        fn from_f64(v: f64) -> Self {
            v as f32
        }
        fn row_max(x: &[Self]) -> Self {
            super::vmath::max(x)
        }
        fn sum_exp(x: &[Self], m: Self) -> f64 {
            super::vmath::sum_exp(x, m)
        }
        fn exp_scaled(x: &[Self], shift: Self, scale: Self, out: &mut [Self]) {
            super::vmath::exp_scaled(x, shift, scale, out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Speed figure, not a check: the f32 row passes of the fused log-softmax (forward: max +
    /// Σexp; backward: the softmax write) against the scalar libm loops they replaced, side by
    /// side. `cargo test --release -p xdistill-kernels --lib kernel_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn kernel_speed() {
        let (rows, v) = (64, 151_669);
        let x: Vec<f32> = (0..rows * v)
            .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 500.0) - 12.0)
            .collect();
        let mut out = vec![0f32; x.len()];
        let per = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e9 / (rows * v) as f64;
        println!(
            "SIMD level: {}",
            xdistill_shared::simd::Simd::current().name()
        );
        for round in 0..2 {
            let t = std::time::Instant::now();
            let old: f64 = x
                .par_chunks(v)
                .map(|r| {
                    let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let s: f64 = r.iter().map(|&y| (y - m).exp() as f64).sum();
                    m as f64 + s.ln()
                })
                .sum();
            let old_t = per(t);
            let t = std::time::Instant::now();
            let new: f64 = x.par_chunks(v).map(row_lse::<f32>).sum();
            let new_t = per(t);
            println!(
                "round {round}: logsumexp  libm {old_t:.2} ns/logit, vectorised {new_t:.2} ({:.1e})",
                (old - new).abs() / old.abs()
            );
            let t = std::time::Instant::now();
            out.par_chunks_mut(v)
                .zip(x.par_chunks(v))
                .for_each(|(o, r)| {
                    for (o, &y) in o.iter_mut().zip(r) {
                        *o = (y - 8.0).exp() * -0.5;
                    }
                });
            let old_t = per(t);
            let t = std::time::Instant::now();
            out.par_chunks_mut(v)
                .zip(x.par_chunks(v))
                .for_each(|(o, r)| vmath::exp_scaled(r, 8.0, -0.5, o));
            println!(
                "round {round}: softmax write  libm {old_t:.2} ns/logit, vectorised {:.2}",
                per(t)
            );
        }
    }

    /// The vectorised f32 passes against f64 sums, and the same bits at every SIMD level.
    #[test]
    fn vmath_matches_f64_at_every_level() {
        use xdistill_shared::simd::Simd;
        // A vocabulary-sized row with a remainder past the lanes and blocks.
        let x: Vec<f32> = (0..151_669)
            .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 500.0) - 12.0)
            .collect();
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: f64 = x.iter().map(|&v| (v as f64 - m as f64).exp()).sum();
        let mut out = vec![0f32; x.len()];
        let mut outs = Vec::new();
        for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
            assert_eq!(vmath::max_at(level, &x), m);
            let got = vmath::sum_exp_at(level, &x, m);
            assert!(
                (got / want - 1.0).abs() < 1e-6,
                "{level:?}: {got} vs {want}"
            );
            assert_eq!(
                got.to_bits(),
                vmath::sum_exp_at(Simd::Baseline, &x, m).to_bits()
            );
            vmath::exp_scaled_at(level, &x, m + 0.5, -3.0, &mut out);
            for (&o, &v) in out.iter().zip(&x).step_by(97) {
                let w = -3.0 * (v as f64 - (m + 0.5) as f64).exp();
                assert!((o as f64 / w - 1.0).abs() < 2e-6, "{level:?}: {o} vs {w}");
            }
            outs.push(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        assert!(outs.windows(2).all(|w| w[0] == w[1]), "levels differ");
        assert_eq!(vmath::max(&[]), f32::NEG_INFINITY);
    }

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

    /// Composed reference: full log-softmax, then gather.
    fn composed_gather(x: &Tensor, idx: &Tensor) -> Tensor {
        candle_nn::ops::log_softmax(x, D::Minus1)
            .unwrap()
            .gather(idx, D::Minus1)
            .unwrap()
    }

    fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
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
