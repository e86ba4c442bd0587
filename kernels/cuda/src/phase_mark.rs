//! The launch of `phase_mark.cu`: an empty kernel named for a phase (`xd_phase_NAME`, one thread),
//! which a profiler listing launches in order shows where the phase begins.

use crate::ptx;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;

/// Queues `xd_phase_{phase}` on `dev`'s stream (a name `phase_mark.cu` has: `none`, `forward`,
/// …; `xdistill_shared::profiling::Phase` names them, and its test reads the file).
pub fn phase_mark(dev: &CudaDevice, phase: &str) -> Result<()> {
    let func = ptx::function(dev, &ptx::PHASE_MARK, &format!("xd_phase_{phase}"))?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    // SAFETY: the kernel takes no arguments and touches no memory.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
