//! A layer's RMSNorm, RoPE and gated activation as single fused ops with a fused backward
//! (candle custom ops), so that each is one kernel each way instead of a dozen primitive ones:
//! - [`rms_norm`]: both weight conventions, statistics in f32, the weight's gradient summed in
//!   a fixed order;
//! - [`rope`]: rotates the projections' `[B, T, H, D]` heads and writes them heads-first (or
//!   not) in the same pass, partial rotary included; its backward is the inverse rotation, with
//!   no gradient for the tables;
//! - [`gated_act`]: `act(gate) · up` with gate and up read in place (the halves of a fused
//!   gate_up too), both gradients from one pass.
//!
//! On CUDA they run the project's kernels (`kernels/cuda`: rms_norm.cu, rope.cu, gated_act.cu).
//! On the CPU each op has a plain f64 reference of the same arithmetic (one rounding per
//! output): the tests hold it against the composed ops of `layers.rs`, and the GPU tests hold
//! the kernels against it. The decoder uses these ops where [`applies`]: a CUDA device with the
//! project's kernels on ([`crate::device::cuda_kernels`]), in training and at inference; the
//! composed ops run everywhere else, the CPU included. The residual add before a norm stays a
//! separate op (an add has no reduction to fuse into; its backward passes the gradient on).

use super::spec::Activation;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use half::{bf16, f16};

/// Whether the fused ops run for a tensor like `x`: on a CUDA device with the project's
/// kernels on, in f32, bf16 or f16; or as a test chose for its thread ([`force_in_this_thread`]).
pub fn applies(x: &Tensor) -> bool {
    let kernel_dtype = matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16);
    match FORCED.with(|c| c.get()) {
        Some(on) => on && (x.device().is_cpu() || kernel_dtype),
        None => x.device().is_cuda() && crate::device::cuda_kernels() && kernel_dtype,
    }
}

thread_local! {
    static FORCED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// For tests: the decoder uses the fused ops (`Some(true)`; on the CPU their f64 reference)
/// or the composed ones (`Some(false)`) in this thread, whatever the device and the switch;
/// `None` restores the default. Lets whole passes be compared both ways in one process.
#[doc(hidden)]
pub fn force_in_this_thread(on: Option<bool>) {
    FORCED.with(|c| c.set(on));
}

/// RMSNorm of `x` `[..., dim]` over its last dimension with weight `w` `[dim]` (the same
/// dtype): `round(x·r)·w`, or with `plus_one` (Gemma) `round(x·r·(1 + w))`, where
/// `r = 1/sqrt(mean(x²) + eps)` in f32. Gradients for `x` and `w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, plus_one: bool) -> Result<Tensor> {
    let dim = x.dim(D::Minus1)?;
    if w.dims() != [dim] || w.dtype() != x.dtype() {
        bail!(
            "rms_norm: weight {:?} {:?} for rows of {dim} {:?}",
            w.dims(),
            w.dtype(),
            x.dtype()
        );
    }
    let op = RmsNorm {
        rows: x.elem_count() / dim.max(1),
        dim,
        eps,
        plus_one,
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, op)
}

/// RoPE (rotate-half form) on `x` `[B, T, H, D]` (the last dimension dense; any strides
/// otherwise) with tables `cos`, `sin` `[T, R/2]` or `[B, T, R/2]` (x's dtype): the first `R`
/// dims of each head rotate, the rest pass through. The result is contiguous, `[B, H, T, D]`
/// with `heads_first`, else `[B, T, H, D]`. Gradient for `x` only.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, heads_first: bool) -> Result<Tensor> {
    let x = if x.stride().last() == Some(&1) {
        x.clone()
    } else {
        x.contiguous()?
    };
    let op = Rope {
        from_heads_first: false,
        to_heads_first: heads_first,
        inverse: false,
    };
    x.apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// `act(gate) · up` (one shape, one dtype). Rows of gate and up are read through their
/// strides where the layout allows it (the halves of a fused `[.., 2I]` projection do).
pub fn gated_act(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
    if gate.shape() != up.shape() || gate.dtype() != up.dtype() {
        bail!(
            "gated activation: gate {:?} {:?}, up {:?} {:?}",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        );
    }
    let rowwise = |t: &Tensor| -> Result<Tensor> {
        if Rows::of(t.layout()).is_some() {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    rowwise(gate)?.apply_op2(&rowwise(up)?, GatedAct { act })
}

/// [`rms_norm`]'s backward: the gradients at `x` and at `w` given `grad` at the output (both
/// from one kernel; the weight's summed over rows in a fixed order).
pub(crate) fn rms_norm_backward(
    grad: &Tensor,
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    plus_one: bool,
) -> Result<(Tensor, Tensor)> {
    let dim = x.dim(D::Minus1)?;
    let op = RmsNorm {
        rows: x.elem_count() / dim.max(1),
        dim,
        eps,
        plus_one,
    };
    let both =
        grad.contiguous()?
            .apply_op3_no_bwd(&x.contiguous()?, &w.contiguous()?, &RmsNormBwd(op))?;
    let n = x.elem_count();
    Ok((
        both.narrow(0, 0, n)?.reshape(x.shape())?,
        both.narrow(0, n, dim)?.reshape(w.shape())?,
    ))
}

/// [`rope`]'s backward for a heads-first output: the gradient `[B, H, T, D]` (the last
/// dimension dense) rotated back to the input's `[B, T, H, D]`, contiguous.
pub(crate) fn rope_backward(grad: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let back = Rope {
        from_heads_first: true,
        to_heads_first: false,
        inverse: true,
    };
    rope_apply(grad, cos, sin, back)
}

/// `x` through `op` (the last dimension made dense where it is not).
fn rope_apply(x: &Tensor, cos: &Tensor, sin: &Tensor, op: Rope) -> Result<Tensor> {
    let x = if x.stride().last() == Some(&1) {
        x.clone()
    } else {
        x.contiguous()?
    };
    x.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

/// [`gated_act`]'s backward: the gradients at `gate` and `up` (contiguous, their shape) given
/// `grad` at the output, from one pass.
pub(crate) fn gated_act_backward(
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    act: Activation,
) -> Result<(Tensor, Tensor)> {
    let both = grad
        .contiguous()?
        .apply_op3_no_bwd(gate, up, &GatedActBwd(GatedAct { act }))?;
    let n = gate.elem_count();
    Ok((
        both.narrow(0, 0, n)?.reshape(gate.shape())?,
        both.narrow(0, n, n)?.reshape(up.shape())?,
    ))
}

/// A layout as rows of its last dimension, each `stride` elements after the previous one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rows {
    rows: usize,
    width: usize,
    stride: usize,
    start: usize,
}

impl Rows {
    /// `None` where the last dimension is not dense or the outer dimensions do not collapse to
    /// one stride.
    fn of(l: &Layout) -> Option<Rows> {
        let dims = l.dims();
        let strides = l.stride();
        let width = *dims.last().unwrap_or(&1);
        if dims.is_empty() {
            return Some(Rows {
                rows: 1,
                width: 1,
                stride: 1,
                start: l.start_offset(),
            });
        }
        if width > 1 && strides[dims.len() - 1] != 1 {
            return None;
        }
        let rows: usize = dims[..dims.len() - 1].iter().product();
        // The innermost outer dimension of size > 1 sets the row stride; each further one out
        // must step over all rows inside it.
        let mut stride = None;
        let mut inner_rows = 1;
        for k in (0..dims.len() - 1).rev() {
            if dims[k] == 1 {
                continue;
            }
            let s = *stride.get_or_insert(strides[k]);
            if strides[k] != s * inner_rows {
                return None;
            }
            inner_rows *= dims[k];
        }
        let stride = stride.unwrap_or(width);
        if rows > 1 && stride < width {
            return None;
        }
        Some(Rows {
            rows,
            width,
            stride,
            start: l.start_offset(),
        })
    }
}

/// Every element of a host storage as f64 (the whole buffer: layouts index into it). With
/// [`dense`] and [`storage`], what the fused ops' f64 CPU references read and write (here and
/// in `xdistill_kernels::topk_kd`).
pub fn f64s(s: &CpuStorage) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F64(v) => v.clone(),
        CpuStorage::F32(v) => v.iter().map(|&x| x as f64).collect(),
        CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        _ => bail!("fused ops take f64, f32, bf16 or f16"),
    })
}

/// `v` rounded to `dt` (as a kernel's cast), still as f64.
fn round(v: f64, dt: DType) -> f64 {
    match dt {
        DType::F32 => v as f32 as f64,
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::F16 => f16::from_f64(v).to_f64(),
        _ => v,
    }
}

/// Values in a host storage of `dt`.
pub fn storage(v: Vec<f64>, dt: DType) -> Result<CpuStorage> {
    Ok(match dt {
        DType::F64 => CpuStorage::F64(v),
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f64).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f64).collect()),
        dt => bail!("fused ops take f64, f32, bf16 or f16, not {dt:?}"),
    })
}

/// The contiguous values a layout covers, as f64.
pub fn dense(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("fused op: a contiguous operand expected");
    };
    Ok(f64s(s)?[a..b].to_vec())
}

struct RmsNorm {
    rows: usize,
    dim: usize,
    eps: f64,
    plus_one: bool,
}

impl RmsNorm {
    /// The factor `w`, or `1 + w`.
    fn scale(&self, w: f64) -> f64 {
        if self.plus_one {
            1.0 + w
        } else {
            w
        }
    }

    fn rstd(&self, row: &[f64]) -> f64 {
        let ss: f64 = row.iter().map(|v| v * v).sum();
        1.0 / (ss / self.dim as f64 + self.eps).sqrt()
    }

    #[cfg(feature = "cuda")]
    fn args(&self) -> xdistill_cuda_kernels::RmsNormArgs {
        xdistill_cuda_kernels::RmsNormArgs {
            rows: self.rows,
            dim: self.dim,
            eps: self.eps as f32,
            plus_one: self.plus_one,
        }
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "xdistill-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dt = x.dtype();
        let (x, w) = (dense(x, lx)?, dense(w, lw)?);
        let mut y = vec![0.0; x.len()];
        for (yr, xr) in y.chunks_mut(self.dim).zip(x.chunks(self.dim)) {
            let r = self.rstd(xr);
            for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(&w) {
                *y = if self.plus_one {
                    x * r * (1.0 + w)
                } else {
                    round(x * r, dt) * w
                };
            }
        }
        Ok((storage(y, dt)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = xdistill_cuda_kernels::rms_norm_fwd(x, lx, w, lw, self.args())?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_backward(grad, x, w, self.eps, self.plus_one)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// The norm's backward: `(g, x, w)` → `[rows·dim + dim]`, the input's gradient then the
/// weight's.
struct RmsNormBwd(RmsNorm);

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "xdistill-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = &self.0;
        let dt = x.dtype();
        let (g, x, w) = (dense(g, lg)?, dense(x, lx)?, dense(w, lw)?);
        let n = op.rows * op.dim;
        let mut out = vec![0.0; n + op.dim];
        let (dx, dw) = out.split_at_mut(n);
        for ((dxr, xr), gr) in dx
            .chunks_mut(op.dim)
            .zip(x.chunks(op.dim))
            .zip(g.chunks(op.dim))
        {
            let r = op.rstd(xr);
            let dot: f64 = gr
                .iter()
                .zip(xr)
                .zip(&w)
                .map(|((g, x), &w)| g * op.scale(w) * x)
                .sum();
            let c = dot * r * r * r / op.dim as f64;
            for (i, d) in dxr.iter_mut().enumerate() {
                *d = r * gr[i] * op.scale(w[i]) - xr[i] * c;
                let normed = if op.plus_one {
                    xr[i] * r
                } else {
                    round(xr[i] * r, dt)
                };
                dw[i] += gr[i] * normed;
            }
        }
        Ok((storage(out, dt)?, Shape::from_dims(&[n + op.dim])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = xdistill_cuda_kernels::rms_norm_bwd(g, lg, x, lx, w, lw, self.0.args())?;
        Ok((
            out,
            Shape::from_dims(&[self.0.rows * self.0.dim + self.0.dim]),
        ))
    }
}

/// RoPE from one arrangement of the heads to another: the input `[B, T, H, D]` or, with
/// `from_heads_first`, `[B, H, T, D]` (any strides, the last dimension dense), the output
/// contiguous in the arrangement `to_heads_first` names; `inverse` rotates backwards.
#[derive(Debug, Clone, Copy)]
struct Rope {
    from_heads_first: bool,
    to_heads_first: bool,
    inverse: bool,
}

/// What one call of [`Rope`] works on.
struct RopeGeometry {
    /// `[B, T, H, D]`.
    dims: [usize; 4],
    half: usize,
    /// Strides of `(b, t, h)` in the input and the output.
    input: [usize; 3],
    output: [usize; 3],
    /// Stride of `b` in the tables: 0 for `[T, half]` ones.
    table_b: usize,
    out_shape: Shape,
}

impl Rope {
    fn geometry(&self, lx: &Layout, lc: &Layout, ls: &Layout) -> Result<RopeGeometry> {
        let (d0, d1, d2, d) = lx.shape().dims4()?;
        let s = lx.stride();
        if d > 1 && s[3] != 1 {
            bail!("rope: the last dimension must be dense");
        }
        let (b, t, h, input) = if self.from_heads_first {
            (d0, d2, d1, [s[0], s[2], s[1]])
        } else {
            (d0, d1, d2, [s[0], s[1], s[2]])
        };
        if lc.shape() != ls.shape() || !lc.is_contiguous() || !ls.is_contiguous() {
            bail!("rope: cos {:?} and sin {:?} tables", lc.dims(), ls.dims());
        }
        let half = *lc.dims().last().unwrap_or(&0);
        let table_b = match lc.dims() {
            [tt, _] if *tt == t => 0,
            [bb, tt, _] if *bb == b && *tt == t => t * half,
            other => bail!("rope: tables {other:?} for {b} rows of {t} positions"),
        };
        if 2 * half > d {
            bail!("rope: {} rotary dims in heads of {d}", 2 * half);
        }
        let (output, out_shape) = if self.to_heads_first {
            ([h * t * d, d, t * d], Shape::from_dims(&[b, h, t, d]))
        } else {
            ([t * h * d, h * d, d], Shape::from_dims(&[b, t, h, d]))
        };
        Ok(RopeGeometry {
            dims: [b, t, h, d],
            half,
            input,
            output,
            table_b,
            out_shape,
        })
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "xdistill-rope"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lc: &Layout,
        sin: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = self.geometry(lx, lc, ls)?;
        let dt = x.dtype();
        let (x, cos, sin) = (f64s(x)?, dense(cos, lc)?, dense(sin, ls)?);
        let [nb, nt, nh, d] = g.dims;
        let half = g.half;
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut y = vec![0.0; nb * nt * nh * d];
        for b in 0..nb {
            for t in 0..nt {
                for h in 0..nh {
                    let i = lx.start_offset() + b * g.input[0] + t * g.input[1] + h * g.input[2];
                    let o = b * g.output[0] + t * g.output[1] + h * g.output[2];
                    for j in 0..half {
                        let at = b * g.table_b + t * half + j;
                        let (c, s) = (cos[at], sign * sin[at]);
                        let (x1, x2) = (x[i + j], x[i + j + half]);
                        y[o + j] = x1 * c - x2 * s;
                        y[o + j + half] = x2 * c + x1 * s;
                    }
                    y[o + 2 * half..o + d].copy_from_slice(&x[i + 2 * half..i + d]);
                }
            }
        }
        Ok((storage(y, dt)?, g.out_shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        cos: &candle_core::CudaStorage,
        lc: &Layout,
        sin: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = self.geometry(lx, lc, ls)?;
        let [b, t, h, d] = g.dims;
        let args = xdistill_cuda_kernels::RopeArgs {
            b,
            t,
            h,
            d,
            half: g.half,
            input: g.input,
            output: g.output,
            table_b: g.table_b,
            inverse: self.inverse,
        };
        let y = xdistill_cuda_kernels::rope(x, lx, cos, lc, sin, ls, args)?;
        Ok((y, g.out_shape))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = Rope {
            from_heads_first: self.to_heads_first,
            to_heads_first: self.from_heads_first,
            inverse: !self.inverse,
        };
        Ok((Some(rope_apply(grad, cos, sin, back)?), None, None))
    }
}

/// `act(gate) · up` ([`gated_act`]).
struct GatedAct {
    act: Activation,
}

impl GatedAct {
    /// `(act(g), act'(g))` in f64.
    fn activate(&self, g: f64) -> (f64, f64) {
        match self.act {
            Activation::Silu => {
                let s = 1.0 / (1.0 + (-g).exp());
                (g * s, s * (1.0 + g * (1.0 - s)))
            }
            Activation::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                let t = (k * (g + 0.044715 * g * g * g)).tanh();
                let da =
                    0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g);
                (0.5 * g * (1.0 + t), da)
            }
            Activation::GeluErf => {
                let e = candle_core::cpu::erf::erf_f64(g / std::f64::consts::SQRT_2);
                let density = (-0.5 * g * g).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (0.5 * g * (1.0 + e), 0.5 * (1.0 + e) + g * density)
            }
        }
    }

    /// Gate and up as rows (checked to match), or why not.
    fn rows(lg: &Layout, lu: &Layout) -> Result<(Rows, Rows)> {
        match (Rows::of(lg), Rows::of(lu)) {
            (Some(g), Some(u)) if g.rows == u.rows && g.width == u.width => Ok((g, u)),
            _ => bail!("gated activation: gate and up must be rows of one shape"),
        }
    }

    #[cfg(feature = "cuda")]
    fn args(&self, g: Rows, u: Rows) -> xdistill_cuda_kernels::GatedArgs {
        use xdistill_cuda_kernels::GatedAct as K;
        xdistill_cuda_kernels::GatedArgs {
            rows: g.rows,
            width: g.width,
            gate_stride: g.stride,
            up_stride: u.stride,
            act: match self.act {
                Activation::Silu => K::Silu,
                Activation::GeluTanh => K::GeluTanh,
                Activation::GeluErf => K::GeluErf,
            },
        }
    }

    /// `f(r, i, gate, up)` for every element, from the whole storages.
    fn each(g: &[f64], gr: Rows, u: &[f64], ur: Rows, mut f: impl FnMut(usize, f64, f64)) {
        for r in 0..gr.rows {
            for i in 0..gr.width {
                f(
                    r * gr.width + i,
                    g[gr.start + r * gr.stride + i],
                    u[ur.start + r * ur.stride + i],
                );
            }
        }
    }
}

impl CustomOp2 for GatedAct {
    fn name(&self) -> &'static str {
        "xdistill-gated-act"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gr, ur) = Self::rows(lg, lu)?;
        let dt = g.dtype();
        let mut y = vec![0.0; gr.rows * gr.width];
        Self::each(&f64s(g)?, gr, &f64s(u)?, ur, |j, g, u| {
            y[j] = self.activate(g).0 * u
        });
        Ok((storage(y, dt)?, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        u: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (gr, ur) = Self::rows(lg, lu)?;
        let y = xdistill_cuda_kernels::gated_act_fwd(g, lg, u, lu, self.args(gr, ur))?;
        Ok((y, lg.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = gated_act_backward(grad, gate, up, self.act)?;
        Ok((Some(dg), Some(du)))
    }
}

/// The activation's backward: `(gy, gate, up)` → `[2·n]`, the gate's gradient then up's.
struct GatedActBwd(GatedAct);

impl CustomOp3 for GatedActBwd {
    fn name(&self) -> &'static str {
        "xdistill-gated-act-bwd"
    }

    fn cpu_fwd(
        &self,
        gy: &CpuStorage,
        ly: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gr, ur) = GatedAct::rows(lg, lu)?;
        let dt = g.dtype();
        let gy = dense(gy, ly)?;
        let n = gr.rows * gr.width;
        let mut out = vec![0.0; 2 * n];
        GatedAct::each(&f64s(g)?, gr, &f64s(u)?, ur, |j, g, u| {
            let (a, da) = self.0.activate(g);
            out[j] = gy[j] * u * da;
            out[n + j] = gy[j] * a;
        });
        Ok((storage(out, dt)?, Shape::from_dims(&[2 * n])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gy: &candle_core::CudaStorage,
        ly: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        u: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (gr, ur) = GatedAct::rows(lg, lu)?;
        let out = xdistill_cuda_kernels::gated_act_bwd(gy, ly, g, lg, u, lu, self.0.args(gr, ur))?;
        Ok((out, Shape::from_dims(&[2 * gr.rows * gr.width])))
    }
}

#[cfg(test)]
mod tests {
    //! Each fused op (its CPU reference) against the composed ops of `layers.rs` in f64:
    //! values and the gradients candle's autograd takes through the primitives, on layouts the
    //! decoder hands them (strided views included); and in bf16, one rounding from f64.
    use super::*;
    use crate::model::layers::{activate, rope as composed_rope, Norm, Ops};
    use crate::model::test_tensors::{data, values, worst};
    use candle_core::{Device, Var};

    /// `y` and the gradients at `vars` of `Σ y ∘ r` (r fixed noise), for `f` fused and composed.
    fn compare(vars: &[&Var], f: impl Fn(bool) -> Tensor) -> (f64, f64) {
        let run = |fused: bool| {
            let y = f(fused);
            let r = data(99, y.dims(), 1.0);
            let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let g: Vec<Tensor> = vars
                .iter()
                .map(|v| grads.get(v.as_tensor()).expect("a gradient").clone())
                .collect();
            (y, g)
        };
        let ((y1, g1), (y2, g2)) = (run(true), run(false));
        let gw = g1
            .iter()
            .zip(&g2)
            .fold(0.0f64, |m, (a, b)| m.max(worst(a, b)));
        (worst(&y1, &y2), gw)
    }

    #[test]
    fn rms_norm_and_its_gradients_equal_the_composed_ops() {
        for plus_one in [false, true] {
            for shape in [[2usize, 5, 37], [3, 4, 8]] {
                let x = Var::from_tensor(&data(1, &shape, 3.0)).unwrap();
                let w = Var::from_tensor(&(data(2, &[shape[2]], 1.0) + 0.5).unwrap()).unwrap();
                let norm = Norm {
                    weight: w.as_tensor().clone(),
                    eps: 1e-6,
                    plus_one,
                };
                let (y, g) = compare(&[&x, &w], |fused| {
                    if fused {
                        rms_norm(x.as_tensor(), w.as_tensor(), 1e-6, plus_one).unwrap()
                    } else {
                        norm.forward(x.as_tensor(), Ops::Differentiable).unwrap()
                    }
                });
                assert!(y < 1e-14 && g < 1e-13, "{plus_one} {shape:?}: {y:e} {g:e}");
            }
        }
    }

    #[test]
    fn rms_norm_in_bf16_is_one_rounding_from_f64() {
        for plus_one in [false, true] {
            let x = data(3, &[6, 40], 3.0);
            let w = (data(4, &[40], 1.0) + 0.5).unwrap();
            let want = rms_norm(&x, &w, 1e-6, plus_one).unwrap();
            let (xb, wb) = (
                x.to_dtype(DType::BF16).unwrap(),
                w.to_dtype(DType::BF16).unwrap(),
            );
            let got = rms_norm(&xb, &wb, 1e-6, plus_one).unwrap();
            assert_eq!(got.dtype(), DType::BF16);
            // From bf16 inputs (2^-9 each) and up to two roundings of 2^-9: within 2^-6.
            let want_b = rms_norm(
                &xb.to_dtype(DType::F64).unwrap(),
                &wb.to_dtype(DType::F64).unwrap(),
                1e-6,
                plus_one,
            )
            .unwrap();
            assert!(worst(&got, &want_b) < 1.0 / 128.0, "{plus_one}");
            assert!(worst(&got, &want) < 1.0 / 64.0, "{plus_one}");
        }
    }

    /// `[T, half]` and `[B, T, half]` tables of angles.
    fn tables(b: Option<usize>, t: usize, half: usize) -> (Tensor, Tensor) {
        let shape: Vec<usize> = match b {
            Some(b) => vec![b, t, half],
            None => vec![t, half],
        };
        let a = data(5, &shape, 6.0);
        (a.cos().unwrap(), a.sin().unwrap())
    }

    #[test]
    fn rope_and_its_gradient_equal_the_composed_ops() {
        let (b, t, h) = (2, 6, 3);
        // (head size, rotated pairs, per-row tables, input as a view of a wider tensor)
        for (d, half, per_row, view) in [
            (8, 4, false, false),
            (8, 4, true, true),
            (12, 3, false, true), // partial: 6 of 12 dims rotate
            (12, 3, true, false),
        ] {
            let (cos, sin) = tables(per_row.then_some(b), t, half);
            let wide = Var::from_tensor(&data(6, &[b, t, h, d + 5], 1.0)).unwrap();
            let plain = Var::from_tensor(&data(7, &[b, t, h, d], 1.0)).unwrap();
            let (var, x) = if view {
                (&wide, wide.as_tensor().narrow(3, 2, d).unwrap())
            } else {
                (&plain, plain.as_tensor().clone())
            };
            for heads_first in [true, false] {
                let (y, g) = compare(&[var], |fused| {
                    if fused {
                        return rope(&x, &cos, &sin, heads_first).unwrap();
                    }
                    let bhtd = x.transpose(1, 2).unwrap().contiguous().unwrap();
                    let y = composed_rope(&bhtd, &cos, &sin, Ops::Differentiable).unwrap();
                    if heads_first {
                        y
                    } else {
                        y.transpose(1, 2).unwrap().contiguous().unwrap()
                    }
                });
                let case = format!(
                    "d {d} half {half} per-row {per_row} view {view} heads-first {heads_first}"
                );
                assert!(y < 1e-14 && g < 1e-14, "{case}: {y:e} {g:e}");
            }
        }
    }

    /// Values against the composed ops; gradients against them for SiLU, and against central
    /// differences for the GELUs (candle's GELU backward uses 6-digit constants: 2e-7 off).
    #[test]
    fn gated_activations_and_their_gradients_equal_the_composed_ops() {
        for act in [Activation::Silu, Activation::GeluTanh, Activation::GeluErf] {
            // The halves of a fused gate_up projection (row stride 2·width).
            let both = Var::from_tensor(&data(8, &[3, 4, 2 * 21], 4.0)).unwrap();
            let halves = |t: &Tensor| (t.narrow(2, 0, 21).unwrap(), t.narrow(2, 21, 21).unwrap());
            let (gate, up) = halves(both.as_tensor());
            let (y, g) = compare(&[&both], |fused| {
                if fused {
                    gated_act(&gate, &up, act).unwrap()
                } else {
                    (activate(&gate, act).unwrap() * &up).unwrap()
                }
            });
            assert!(y < 1e-14, "{act:?}: {y:e}");
            if act == Activation::Silu {
                assert!(g < 1e-13, "{act:?}: {g:e}");
                continue;
            }
            let r = data(99, &[3, 4, 21], 1.0);
            let loss = |t: &Tensor| -> f64 {
                let (g, u) = halves(t);
                let y = gated_act(&g, &u, act).unwrap();
                (y * &r).unwrap().sum_all().unwrap().to_scalar().unwrap()
            };
            let grads = (gated_act(&gate, &up, act).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let analytic = values(grads.get(both.as_tensor()).unwrap());
            let base = values(both.as_tensor());
            let h = 1e-6;
            for (i, &a) in analytic.iter().enumerate() {
                let at = |dx: f64| {
                    let mut v = base.clone();
                    v[i] += dx;
                    loss(&Tensor::from_vec(v, both.dims(), &Device::Cpu).unwrap())
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                assert!(
                    (a - numeric).abs() < 1e-8 * (1.0 + a.abs()),
                    "{act:?} [{i}]: {a} vs {numeric}"
                );
            }
        }
    }

    #[test]
    fn rows_of_a_layout() {
        let t = Tensor::zeros((3, 4, 10), DType::F32, &Device::Cpu).unwrap();
        let rows = |t: &Tensor| Rows::of(t.layout()).map(|r| (r.rows, r.width, r.stride, r.start));
        assert_eq!(rows(&t), Some((12, 10, 10, 0)));
        assert_eq!(rows(&t.narrow(2, 5, 5).unwrap()), Some((12, 5, 10, 5)));
        assert_eq!(rows(&t.narrow(1, 1, 2).unwrap()), None); // rows 1-2 of each 4: two strides
        assert_eq!(rows(&t.transpose(0, 1).unwrap()), None);
        assert_eq!(rows(&t.transpose(1, 2).unwrap()), None); // last dimension not dense
        assert_eq!(rows(&t.narrow(0, 1, 1).unwrap()), Some((4, 10, 10, 40)));
    }
}
