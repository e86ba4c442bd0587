//! The launch of `sum_squares.cu`: `Σ g²` of many tensors in one kernel and one copy back.

use crate::address::{address, device_of, float_kind};
use crate::ptx;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{Result, Tensor};

/// Elements per chunk (a block's share); a length takes 24 bits of the table.
const CHUNK: usize = 1 << 16;
const _: () = assert!(CHUNK < 1 << 24);

/// `Σ x²` of each tensor (contiguous f32, bf16 or f16, one CUDA device), in f64: per chunk of
/// 64 Ki elements in f64 on the device, the chunks of a tensor added in order on the host. A
/// bf16 or f16 tensor gives the bits of its f32 widening; a tensor the same bits whatever else
/// is in `tensors`.
pub fn sum_squares(tensors: &[&Tensor]) -> Result<Vec<f64>> {
    let Some(first) = tensors.first() else {
        return Ok(Vec::new());
    };
    let dev = device_of(first)?;
    let stream = dev.cuda_stream();
    let mut table: Vec<u64> = Vec::new();
    let mut owner: Vec<usize> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let (kind, width) = float_kind(t.dtype())?;
        let x = address(t, t.dtype(), &stream)?;
        let n = t.elem_count();
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start) as u64;
            table.extend([x + width * start as u64, len | (kind << 24)]);
            owner.push(i);
        }
    }
    let mut sums = vec![0.0f64; tensors.len()];
    let n_chunks = owner.len() as u32;
    if n_chunks == 0 {
        return Ok(sums);
    }
    let table = dev.clone_htod(&table)?;
    let mut out = dev.alloc_zeros::<f64>(owner.len())?;
    let func = ptx::function(&dev, &ptx::SUM_SQUARES, "sum_squares")?;
    let cfg = LaunchConfig {
        grid_dim: (n_chunks.min(1 << 16), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&table).arg(&n_chunks).arg(&mut out);
    // SAFETY: the arguments are the kernel's signature; every address points into a live
    // contiguous tensor of the dtype its chunk names, of at least the chunk's length, queued on
    // candle's stream.
    unsafe { b.launch(cfg) }.w()?;
    let partial = dev.clone_dtoh(&out)?;
    for (i, s) in owner.iter().zip(partial) {
        sums[*i] += s;
    }
    Ok(sums)
}
