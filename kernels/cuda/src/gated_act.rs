//! The launches of `gated_act.cu`: the gated MLP's `act(gate) · up` and its backward (both
//! gradients in one buffer), gate and up read through row strides; for the fused activation of
//! `xdistill_shared::model::device_ops`.

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

const THREADS: u32 = 256;

/// The activation (`act` in gated_act.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedAct {
    Silu = 0,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh = 1,
    /// GELU with erf.
    GeluErf = 2,
}

/// `rows` rows of `width` values; each operand's rows start `row stride` elements apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GatedArgs {
    pub rows: usize,
    pub width: usize,
    pub gate_stride: usize,
    pub up_stride: usize,
    pub act: GatedAct,
}

fn config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn checked(a: &GatedArgs) -> Result<(u32, u32, i64, i64, i32)> {
    if a.rows > u32::MAX as usize || a.width > u32::MAX as usize {
        bail!("gated activation: {a:?} is out of range");
    }
    Ok((
        a.rows as u32,
        a.width as u32,
        a.gate_stride as i64,
        a.up_stride as i64,
        a.act as i32,
    ))
}

/// `act(gate) · up`, `[rows, width]` contiguous.
pub fn gated_act_fwd(
    gate: &CudaStorage,
    lg: &Layout,
    up: &CudaStorage,
    lu: &Layout,
    a: GatedArgs,
) -> Result<CudaStorage> {
    let (rows, width, gs, us, act) = checked(&a)?;
    let dev = gate.device().clone();
    let n = a.rows * a.width;
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            let gv = gate.as_cuda_slice::<$t>()?.slice(lg.start_offset()..);
            let uv = up.as_cuda_slice::<$t>()?.slice(lu.start_offset()..);
            // SAFETY: the kernel writes every element.
            let mut y = unsafe { dev.alloc::<$t>(n.max(1))? };
            if n > 0 {
                let func = ptx::function(&dev, &ptx::GATED_ACT, concat!("gated_act_fwd_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&func);
                b.arg(&gv).arg(&gs).arg(&uv).arg(&us).arg(&mut y);
                b.arg(&rows).arg(&width).arg(&act);
                // SAFETY: the kernel's signature; rows at the given strides in, `n` out.
                unsafe { b.launch(config(n)) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(y, dev.clone())
        }};
    }
    Ok(crate::typed!(gate.dtype(), "gated activation", run))
}

/// The backward of [`gated_act_fwd`] from the output's gradient `gy` (contiguous): one buffer
/// `[2, rows, width]`, the gate's gradient then the up projection's.
pub fn gated_act_bwd(
    gy: &CudaStorage,
    ly: &Layout,
    gate: &CudaStorage,
    lg: &Layout,
    up: &CudaStorage,
    lu: &Layout,
    a: GatedArgs,
) -> Result<CudaStorage> {
    let (rows, width, gs, us, act) = checked(&a)?;
    if !ly.is_contiguous() {
        bail!("gated activation backward: the gradient must be contiguous");
    }
    let dev = gate.device().clone();
    let n = a.rows * a.width;
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            let yv = gy.as_cuda_slice::<$t>()?.slice(ly.start_offset()..);
            let gv = gate.as_cuda_slice::<$t>()?.slice(lg.start_offset()..);
            let uv = up.as_cuda_slice::<$t>()?.slice(lu.start_offset()..);
            // SAFETY: the kernel writes both halves of every element.
            let mut out = unsafe { dev.alloc::<$t>((2 * n).max(1))? };
            if n > 0 {
                let func = ptx::function(&dev, &ptx::GATED_ACT, concat!("gated_act_bwd_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&func);
                b.arg(&yv).arg(&gv).arg(&gs).arg(&uv).arg(&us).arg(&mut out);
                b.arg(&rows).arg(&width).arg(&act);
                // SAFETY: the kernel's signature; `n` in, `2n` out.
                unsafe { b.launch(config(n)) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    Ok(crate::typed!(gate.dtype(), "gated activation", run))
}
