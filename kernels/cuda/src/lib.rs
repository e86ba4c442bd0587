//! xdistill's own CUDA kernels: one `.cu` file per op (`src/*.cu`, compiled to PTX by nvcc in
//! `build.rs` and embedded), its Rust launch beside it, loaded through candle's CUDA device
//! (cudarc) on first use. Each op has a parity test against an f64 reference on the GPU
//! (`shared/tests/cuda_kernels.rs`, run by `scripts/gpu-check.sh`). Without the `cuda` feature
//! this crate is empty.
//!
//! - [`topk_rows`]: per row of logits, the log-softmax statistics and the top k (the teacher's
//!   device scoring path), one block per row, no host round trip;
//! - [`adamw_f32`]: one AdamW step over every parameter in one launch, in place, the CPU
//!   kernel's arithmetic (the same bits);
//! - [`sum_squares_f32`]: `Σ g²` of every gradient in one launch and one copy back (the global
//!   norm for clipping);
//! - [`log_softmax_f32`] and [`log_softmax_bwd_f32`]: the row-wise log-softmax and its backward,
//!   one block per row (the losses' `[n, V]` rows).
//!
//! `emulate/` runs each kernel's code on the host (a block as threads with real barriers)
//! against its reference, in the default test suite: the logic is tested where no GPU is.

#[cfg(feature = "cuda")]
mod adamw;
#[cfg(feature = "cuda")]
mod address;
#[cfg(feature = "cuda")]
mod log_softmax;
#[cfg(feature = "cuda")]
mod ptx;
#[cfg(feature = "cuda")]
mod sum_squares;
#[cfg(feature = "cuda")]
mod topk_rows;

#[cfg(feature = "cuda")]
pub use adamw::{adamw_f32, AdamWHyper, AdamWTensor};
#[cfg(feature = "cuda")]
pub use log_softmax::{log_softmax_bwd_f32, log_softmax_f32};
#[cfg(feature = "cuda")]
pub use sum_squares::sum_squares_f32;
#[cfg(feature = "cuda")]
pub use topk_rows::{topk_rows, RowScores, TopkArgs, MAX_K};
