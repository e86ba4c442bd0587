//! The launch of `grad_accumulate.cu`: a micro-batch's gradients widened into (or added to) their
//! f32 sums, every parameter in one launch.

use crate::address::{address, device_of, f32_address, float_kind};
use crate::ptx;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, Result, Tensor};

/// Elements per chunk of the table (a block's share).
const CHUNK: usize = 1 << 16;

/// One gradient and its f32 sum: both contiguous on one CUDA device with as many elements;
/// `dst` is written in place and must not share storage with any `src` of the launch.
pub struct GradSum<'a> {
    /// The gradient: f32, bf16 or f16.
    pub src: &'a Tensor,
    /// The f32 sum.
    pub dst: &'a Tensor,
    /// `dst ← dst + src` when true, `dst ← src` (widened) otherwise.
    pub add: bool,
}

/// Every entry's `dst ← src` or `dst ← dst + src` (f32, each add rounded on its own: the bits
/// of candle's `dst + src.to_dtype(f32)`), in one launch.
pub fn grad_accumulate_f32(entries: &[GradSum<'_>]) -> Result<()> {
    let Some(first) = entries.first() else {
        return Ok(());
    };
    let dev = device_of(first.dst)?;
    let stream = dev.cuda_stream();
    let mut table: Vec<u64> = Vec::new();
    for e in entries {
        let n = e.src.elem_count();
        if e.dst.elem_count() != n {
            bail!(
                "gradient accumulation: gradient {:?} into a sum {:?}",
                e.src.dims(),
                e.dst.dims()
            );
        }
        let (kind, width) = float_kind(e.src.dtype())?;
        let src = address(e.src, e.src.dtype(), &stream)?;
        let dst = f32_address(e.dst, &stream)?;
        let flags = (kind << 32) | ((e.add as u64) << 40);
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start) as u64;
            table.extend([
                src + width * start as u64,
                dst + 4 * start as u64,
                len | flags,
            ]);
        }
    }
    let n_chunks = (table.len() / 3) as u32;
    if n_chunks == 0 {
        return Ok(());
    }
    let table = dev.clone_htod(&table)?;
    let func = ptx::function(&dev, &ptx::GRAD_ACCUMULATE, "grad_accumulate_f32")?;
    let cfg = LaunchConfig {
        grid_dim: (n_chunks.min(1 << 16), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&table).arg(&n_chunks);
    // SAFETY: the arguments are the kernel's signature; every address in the table points into
    // a live contiguous tensor (the gradient's dtype, or f32 for the sums) of at least the
    // chunk's length, queued on candle's stream.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
