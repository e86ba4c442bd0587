//! The CPU's compute kernels, a leaf crate (no workspace crate below it) that every profile
//! compiles optimised, in one codegen unit (the workspace's `[profile.dev.package]`): the hot
//! loops of the teacher's scoring and of the inference forward, so that the teachers and
//! trainers the tests start run them at full speed while the rest of the workspace builds at a
//! lower level.
//!
//! - [`simd`]: the host's instruction-set level, chosen once, [`simd_dispatch!`] and the
//!   vectorisable `exp` both sides use.
//! - [`matmul`]: `x · Wᵀ` on AVX-512 and AVX2 (the inference linear layers, the fused LM head).
//! - [`row_scores`]: the teacher's host scoring: top-k, target log-prob, logsumexp, candidates
//!   and ranks folded a vocabulary tile at a time, and the fused LM head (AVX-512 and AVX2).
//! - [`host_ops`]: the inference forward's row ops on f32 host tensors (softmax, RMSNorm,
//!   `silu(gate) · up`).
//!
//! The training kernels (candle custom ops with their backward) are `xdistill-kernels`
//! (`kernels/`), the CUDA ones `xdistill-cuda-kernels` (`kernels/cuda/`), cuDNN's attention
//! `xdistill-cudnn` (`kernels/cudnn/`).

pub mod host_ops;
pub mod matmul;
pub mod row_scores;
pub mod simd;

/// `n` values uniform in `[-scale/2, scale/2)` from a 64-bit LCG seeded by `seed`: kernel
/// tests' inputs on both sides, cheap to make in the millions and the same on every platform.
#[doc(hidden)]
pub fn lcg_noise(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}
