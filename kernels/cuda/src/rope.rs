//! The launch of `rope.cu`: rotary embedding of `[B, T, H, D]` positions read and written
//! through strides (rotating and rearranging the heads in one pass), and with the rotation
//! inverted, its backward; for the fused RoPE of `xdistill_shared::model::device_ops`.

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

const THREADS: u32 = 256;

/// The positions' shape, where each `(b, t, h)` row of `d` values starts in the input and the
/// output (element strides of the three outer axes; the `d` values themselves are contiguous),
/// and the rotation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeArgs {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
    /// Rotated pairs per head: the first `2·half` dims rotate, the rest pass through.
    pub half: usize,
    /// Input strides of `(b, t, h)`.
    pub input: [usize; 3],
    /// Output strides of `(b, t, h)`; the output holds `b·t·h·d` elements.
    pub output: [usize; 3],
    /// Stride of `b` in the cos/sin tables: 0 for `[T, half]` tables, `t·half` for
    /// `[B, T, half]` ones.
    pub table_b: usize,
    /// The inverse rotation (the backward).
    pub inverse: bool,
}

/// `x` rotated into a new buffer of `b·t·h·d` elements laid out by `a.output`.
pub fn rope(
    x: &CudaStorage,
    lx: &Layout,
    cos: &CudaStorage,
    lc: &Layout,
    sin: &CudaStorage,
    ls: &Layout,
    a: RopeArgs,
) -> Result<CudaStorage> {
    if 2 * a.half > a.d || a.b * a.t * a.h > u32::MAX as usize || a.d > u32::MAX as usize {
        bail!("rope: {a:?} is out of range");
    }
    let rows = if a.table_b == 0 { a.t } else { a.b * a.t };
    for l in [lc, ls] {
        if !l.is_contiguous() || l.shape().elem_count() != rows * a.half {
            bail!("rope: table {:?} for {rows} rows of {}", l.shape(), a.half);
        }
    }
    let dev = x.device().clone();
    let n = a.b * a.t * a.h * a.d;
    let work = a.b * a.t * a.h * (a.d - a.half);
    let i64s = |s: [usize; 3]| s.map(|v| v as i64);
    let (xs, ys) = (i64s(a.input), i64s(a.output));
    let table_b = a.table_b as i64;
    let dims = [a.b, a.t, a.h, a.d, a.half].map(|v| v as u32);
    let sign: f32 = if a.inverse { -1.0 } else { 1.0 };
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            let xv = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let cv = cos.as_cuda_slice::<$t>()?.slice(lc.start_offset()..);
            let sv = sin.as_cuda_slice::<$t>()?.slice(ls.start_offset()..);
            // SAFETY: the kernel writes every element of every (b, t, h) row of the output.
            let mut y = unsafe { dev.alloc::<$t>(n.max(1))? };
            if work > 0 {
                let func = ptx::function(&dev, &ptx::ROPE, concat!("rope_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&func);
                b.arg(&xv).arg(&xs[0]).arg(&xs[1]).arg(&xs[2]);
                b.arg(&cv).arg(&sv).arg(&table_b);
                b.arg(&mut y).arg(&ys[0]).arg(&ys[1]).arg(&ys[2]);
                for v in &dims {
                    b.arg(v);
                }
                b.arg(&sign);
                let cfg = LaunchConfig {
                    grid_dim: (work.div_ceil(THREADS as usize) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the kernel's signature; the caller's strides address the input's
                // storage and the output's `n` elements (checked in device_ops).
                unsafe { b.launch(cfg) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(y, dev.clone())
        }};
    }
    Ok(crate::typed!(x.dtype(), "rope", run))
}
