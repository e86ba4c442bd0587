//! The launches of `log_softmax.cu`: the row-wise log-softmax of contiguous f32 rows and its
//! backward, for `xdistill_kernels::log_softmax`'s CUDA side (candle custom ops call these with
//! their storages).

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result, Shape};

/// `(rows, dim)` of a contiguous layout over its last dimension.
fn rows_of(l: &Layout) -> Result<(usize, usize)> {
    if !l.is_contiguous() {
        bail!("the CUDA log-softmax needs contiguous rows");
    }
    let dim = l.dims().last().copied().unwrap_or(1);
    Ok((l.shape().elem_count() / dim.max(1), dim))
}

fn config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `y = x − logsumexp(x)` over the last dimension of `x` (f32, contiguous).
pub fn log_softmax_f32(x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let (rows, dim) = rows_of(l)?;
    let dev = x.device().clone();
    let n = rows * dim;
    // SAFETY: the kernel writes every element of every row.
    let mut y = unsafe { dev.alloc::<f32>(n.max(1))? };
    if n > 0 {
        let xs = x.as_cuda_slice::<f32>()?.slice(l.start_offset()..);
        let func = ptx::function(&dev, &ptx::LOG_SOFTMAX, "log_softmax_f32")?;
        let stream = dev.cuda_stream();
        let (r, d) = (rows as u32, dim as u32);
        let mut b = stream.launch_builder(&func);
        b.arg(&xs).arg(&mut y).arg(&r).arg(&d);
        // SAFETY: the kernel's signature; `rows × dim` elements in and out, on candle's stream.
        unsafe { b.launch(config(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(y, dev), l.shape().clone()))
}

/// The backward of [`log_softmax_f32`]: `g − exp(y)·Σ g` per row, from the output's gradient
/// `g` and the output `y` (f32, contiguous, one shape).
pub fn log_softmax_bwd_f32(
    g: &CudaStorage,
    lg: &Layout,
    y: &CudaStorage,
    ly: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (rows, dim) = rows_of(lg)?;
    if lg.shape() != ly.shape() {
        bail!(
            "log-softmax backward: gradient {:?} and output {:?}",
            lg.shape(),
            ly.shape()
        );
    }
    rows_of(ly)?;
    let dev = g.device().clone();
    let n = rows * dim;
    // SAFETY: the kernel writes every element of every row.
    let mut gx = unsafe { dev.alloc::<f32>(n.max(1))? };
    if n > 0 {
        let gs = g.as_cuda_slice::<f32>()?.slice(lg.start_offset()..);
        let ys = y.as_cuda_slice::<f32>()?.slice(ly.start_offset()..);
        let func = ptx::function(&dev, &ptx::LOG_SOFTMAX, "log_softmax_bwd_f32")?;
        let stream = dev.cuda_stream();
        let (r, d) = (rows as u32, dim as u32);
        let mut b = stream.launch_builder(&func);
        b.arg(&gs).arg(&ys).arg(&mut gx).arg(&r).arg(&d);
        // SAFETY: the kernel's signature; `rows × dim` elements in and out, on candle's stream.
        unsafe { b.launch(config(rows)) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(gx, dev), lg.shape().clone()))
}
