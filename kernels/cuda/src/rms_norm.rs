//! The launches of `rms_norm.cu`: RMSNorm over the last dimension of contiguous rows (f32, bf16
//! or f16) and its backward (the input's and the weight's gradients in one buffer), for the
//! fused norm of `xdistill_shared::model::device_ops`.

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

/// Threads per block (`THREADS` in rms_norm.cu): eight rows per block, a warp each.
const THREADS: u32 = 256;
/// The weight's gradient is summed per group of rows (row r in group r mod groups), then over
/// the groups in order: at most this many groups.
const DW_GROUPS: usize = 256;

/// One norm's shape and kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RmsNormArgs {
    /// Rows of `dim` values.
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
    /// Gemma's scaling by `1 + w` (in f32) instead of `w` (in the element type).
    pub plus_one: bool,
}

fn checked(a: &RmsNormArgs, layouts: &[&Layout], w: &Layout) -> Result<(u32, u32)> {
    for l in layouts {
        if !l.is_contiguous() || l.shape().elem_count() != a.rows * a.dim {
            bail!(
                "rms_norm: {:?} is not {} contiguous rows of {}",
                l.shape(),
                a.rows,
                a.dim
            );
        }
    }
    if !w.is_contiguous() || w.shape().elem_count() != a.dim {
        bail!("rms_norm: weight {:?} for rows of {}", w.shape(), a.dim);
    }
    if a.dim == 0 || a.rows > u32::MAX as usize || a.dim > u32::MAX as usize {
        bail!("rms_norm: {} rows of {} are out of range", a.rows, a.dim);
    }
    Ok((a.rows as u32, a.dim as u32))
}

fn grid(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `y` `[rows, dim]` (the input's dtype): `round(x·r)·w`, or `round(x·r·(1 + w))` with
/// `plus_one`, `r = 1/sqrt(mean(x²) + eps)` per row.
pub fn rms_norm_fwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    a: RmsNormArgs,
) -> Result<CudaStorage> {
    let (rows, dim) = checked(&a, &[lx], lw)?;
    let dev = x.device().clone();
    let n = a.rows * a.dim;
    let plus_one = a.plus_one as i32;
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let ws = w.as_cuda_slice::<$t>()?.slice(lw.start_offset()..);
            // SAFETY: the kernel writes every element of every row.
            let mut y = unsafe { dev.alloc::<$t>(n.max(1))? };
            if n > 0 {
                let func = ptx::function(&dev, &ptx::RMS_NORM, concat!("rms_norm_fwd_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&func);
                b.arg(&xs)
                    .arg(&ws)
                    .arg(&mut y)
                    .arg(&rows)
                    .arg(&dim)
                    .arg(&a.eps)
                    .arg(&plus_one);
                // SAFETY: the kernel's signature; `rows × dim` elements in and out, `dim` weights.
                unsafe { b.launch(grid(a.rows.div_ceil(8))) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(y, dev.clone())
        }};
    }
    Ok(crate::typed!(x.dtype(), "rms_norm", run))
}

/// The backward of [`rms_norm_fwd`] from the output's gradient `g`: one buffer of
/// `rows·dim + dim` elements, the input's gradient `[rows, dim]` then the weight's `[dim]`.
pub fn rms_norm_bwd(
    g: &CudaStorage,
    lg: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    a: RmsNormArgs,
) -> Result<CudaStorage> {
    let (rows, dim) = checked(&a, &[lg, lx], lw)?;
    let dev = x.device().clone();
    let n = a.rows * a.dim;
    let plus_one = a.plus_one as i32;
    let groups = a.rows.clamp(1, DW_GROUPS);
    let groups32 = groups as u32;
    let tiles = a.dim.div_ceil(THREADS as usize);
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            let gs = g.as_cuda_slice::<$t>()?.slice(lg.start_offset()..);
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let ws = w.as_cuda_slice::<$t>()?.slice(lw.start_offset()..);
            // SAFETY: the kernels write every element: dx per row, dw per column.
            let mut out = unsafe { dev.alloc::<$t>(n + a.dim)? };
            let mut rstd = unsafe { dev.alloc::<f32>(a.rows.max(1))? };
            let mut part = unsafe { dev.alloc::<f32>(groups * a.dim)? };
            let stream = dev.cuda_stream();
            if n > 0 {
                let dx = ptx::function(&dev, &ptx::RMS_NORM, concat!("rms_norm_bwd_dx_", $sfx))?;
                let mut dxv = out.slice_mut(0..n);
                let mut b = stream.launch_builder(&dx);
                b.arg(&gs).arg(&xs).arg(&ws).arg(&mut dxv).arg(&mut rstd);
                b.arg(&rows).arg(&dim).arg(&a.eps).arg(&plus_one);
                // SAFETY: the kernel's signature; `rows × dim` in and out, `rows` statistics.
                unsafe { b.launch(grid(a.rows.div_ceil(8))) }.w()?;
                let f = ptx::function(&dev, &ptx::RMS_NORM, concat!("rms_norm_dw_part_", $sfx))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&gs).arg(&xs).arg(&rstd).arg(&mut part);
                b.arg(&rows).arg(&dim).arg(&groups32).arg(&plus_one);
                // SAFETY: the kernel's signature; `groups × dim` partial sums written.
                unsafe { b.launch(grid(tiles * groups)) }.w()?;
            } else {
                stream.memset_zeros(&mut part).w()?;
            }
            let f = ptx::function(&dev, &ptx::RMS_NORM, concat!("rms_norm_dw_sum_", $sfx))?;
            let mut dwv = out.slice_mut(n..);
            let mut b = stream.launch_builder(&f);
            b.arg(&part).arg(&mut dwv).arg(&dim).arg(&groups32);
            // SAFETY: the kernel's signature; `dim` sums of `groups` partials.
            unsafe { b.launch(grid(tiles)) }.w()?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    Ok(crate::typed!(x.dtype(), "rms_norm", run))
}
