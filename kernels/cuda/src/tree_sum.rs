//! The launch of `tree_sum.cu`: the ranks' gathered buffers summed on the device by the exact
//! mode's pairwise tree (the bits `trainer/src/dist/tree.rs` gives on the host).

use crate::ptx;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, Result};

/// `out[i] = tree(parts[0·n + i], parts[1·n + i], …)` over `world` buffers of `n = out.len()`
/// elements laid side by side in `parts` (`[world, n]`, rank order, as an all-gather leaves
/// them), queued on `dev`'s stream.
pub fn tree_sum_f32(
    dev: &CudaDevice,
    parts: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, f32>,
    world: usize,
) -> Result<()> {
    let n = out.len();
    if world == 0 || parts.len() != world * n {
        bail!(
            "tree sum: {} gathered elements for {world} ranks of {n}",
            parts.len()
        );
    }
    if n == 0 {
        return Ok(());
    }
    let func = ptx::function(dev, &ptx::TREE_SUM, "tree_sum_f32")?;
    let threads = 256u32;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(threads as usize).min(1 << 16) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n64, world32) = (n as u64, world as u32);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(parts).arg(out).arg(&n64).arg(&world32);
    // SAFETY: the arguments are the kernel's signature; `parts` holds `world · n` f32 and `out`
    // `n`, both live views queued on the device's stream.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
