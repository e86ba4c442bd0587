//! xdistill's own CUDA kernels: one `.cu` file per op (`src/*.cu`, compiled to PTX by nvcc in
//! `build.rs` and embedded), its Rust launch beside it, loaded through candle's CUDA device
//! (cudarc) on first use. Each op has a parity test against an f64 reference on the GPU
//! (`shared/tests/cuda_kernels.rs`, run by `scripts/gpu-check.sh`). Without the `cuda` feature
//! this crate is empty.
//!
//! - `topk_rows`: per row of logits, the log-softmax statistics and the top k (the teacher's
//!   device scoring path), one block per row, no host round trip;
//! - `adamw_f32`: one AdamW step over every f32 parameter in one launch (gradients f32, bf16
//!   or f16), in place, the CPU kernel's arithmetic (the same bits);
//! - `grad_accumulate_f32`: a micro-batch's gradients (f32, bf16 or f16) widened into, or
//!   added to, their f32 sums, every parameter in one launch;
//! - `sum_squares`: `Σ g²` of every gradient (f32, bf16 or f16) in one launch and one copy
//!   back (the global norm for clipping);
//! - `log_softmax_f32` and `log_softmax_bwd_f32`: the row-wise log-softmax and its backward,
//!   one block per row (the losses' `[n, V]` rows);
//! - `rms_norm_fwd` and `rms_norm_bwd`: RMSNorm (both weight conventions) and its
//!   backward, a warp per row, the weight's gradient summed in a fixed order;
//! - `rope`: rotary embedding through strides (rotating and moving the heads in one pass), and
//!   inverted, its backward;
//! - `gated_act_fwd` and `gated_act_bwd`: the gated MLP's `act(gate) · up` and both
//!   gradients, gate and up read through row strides;
//! - `topk_kd_fwd` and `topk_kd_bwd`: each row's top-k distillation divergence (every
//!   divergence and tail mode; the cross-entropy as k = 1, or beside the divergence) over its
//!   logits, and the logits' gradient, one read of the row per pass, the gradient written once,
//!   over the logits with `topk_kd_bwd_in_place` (llm.c's fused classifier for top-k
//!   targets);
//! - `gemm_acc_f32`: `acc += gᵀ · x` into an f32 accumulator by one cuBLAS GEMM (the LM
//!   head's gradient summed over row chunks; cuBLAS's kernel, no `.cu`);
//! - `gemm_nt_blocks`: `x · wᵀ` with each row as a product of a fixed number of rows computes
//!   it: one cuBLASLt matmul by the algorithm fixed for such a block, or a cuBLAS GEMM per
//!   block (the packed teacher forward's batch-invariant linear layers; no `.cu`);
//! - `phase_mark`: an empty kernel named for a phase of the work (`xd_phase_forward`, …),
//!   so that a profiler's list of launches shows where each phase begins;
//! - `tree_sum_f32`: the exact data-parallel sum of the ranks' gathered buffers on the device,
//!   by the trainer's pairwise tree in rank order (the host tree's bits).
//!
//! The element types are f32, bf16 and f16 (`src/dtype.cuh` converts, `typed!` picks the
//! kernel), except where a kernel says otherwise.
//!
//! `emulate/` runs each kernel's code on the host (a block as threads with real barriers)
//! against its reference, in the default test suite: the logic is tested where no GPU is.

/// Runs `$run!(element type, "suffix")` for storage dtype `$dt` (f32, bf16 or f16): each
/// kernel of those types is compiled as `name_f32`, `name_bf16`, `name_f16`.
#[cfg(feature = "cuda")]
macro_rules! typed {
    ($dt:expr, $op:literal, $run:ident) => {
        match $dt {
            candle_core::DType::F32 => $run!(f32, "f32"),
            candle_core::DType::BF16 => $run!(half::bf16, "bf16"),
            candle_core::DType::F16 => $run!(half::f16, "f16"),
            dt => candle_core::bail!("{} takes f32, bf16 or f16, not {dt:?}", $op),
        }
    };
}
#[cfg(feature = "cuda")]
pub(crate) use typed;

#[cfg(feature = "cuda")]
mod adamw;
#[cfg(feature = "cuda")]
mod address;
#[cfg(feature = "cuda")]
mod gated_act;
#[cfg(feature = "cuda")]
mod gemm_acc;
#[cfg(feature = "cuda")]
mod gemm_blocks;
#[cfg(feature = "cuda")]
mod grad_accumulate;
#[cfg(feature = "cuda")]
mod log_softmax;
#[cfg(feature = "cuda")]
mod phase_mark;
#[cfg(feature = "cuda")]
mod ptx;
#[cfg(feature = "cuda")]
mod rms_norm;
#[cfg(feature = "cuda")]
mod rope;
#[cfg(feature = "cuda")]
mod sum_squares;
#[cfg(feature = "cuda")]
mod topk_kd;
#[cfg(feature = "cuda")]
mod topk_rows;
#[cfg(feature = "cuda")]
mod tree_sum;

#[cfg(feature = "cuda")]
pub use adamw::{adamw_f32, AdamWHyper, AdamWTensor};
#[cfg(feature = "cuda")]
pub use gated_act::{gated_act_bwd, gated_act_fwd, GatedAct, GatedArgs};
#[cfg(feature = "cuda")]
pub use gemm_acc::{gemm_acc_f32, GemmAccArgs};
#[cfg(feature = "cuda")]
pub use gemm_blocks::{gemm_nt_blocks, GemmBlocksArgs, GemmBlocksMode};
#[cfg(feature = "cuda")]
pub use grad_accumulate::{grad_accumulate_f32, GradSum};
#[cfg(feature = "cuda")]
pub use log_softmax::{log_softmax_bwd_f32, log_softmax_f32};
#[cfg(feature = "cuda")]
pub use phase_mark::phase_mark;
#[cfg(feature = "cuda")]
pub use rms_norm::{rms_norm_bwd, rms_norm_fwd, RmsNormArgs};
#[cfg(feature = "cuda")]
pub use rope::{rope, RopeArgs};
#[cfg(feature = "cuda")]
pub use sum_squares::sum_squares;
#[cfg(feature = "cuda")]
pub use topk_kd::{
    topk_kd_bwd, topk_kd_bwd_in_place, topk_kd_fwd, TopkKdArgs, TopkKdGrad, TopkKdTargets,
    TOPK_KD_STAGED_K,
};
#[cfg(feature = "cuda")]
pub use topk_rows::{topk_rows, RowScores, TopkArgs, MAX_K};
#[cfg(feature = "cuda")]
pub use tree_sum::tree_sum_f32;
