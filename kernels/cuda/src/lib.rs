//! xdistill's own CUDA kernels: one `.cu` file per op (`src/*.cu`, compiled to PTX by nvcc in
//! `build.rs` and embedded), its Rust launch beside it, loaded through candle's CUDA device
//! (cudarc) on first use. Each op has a parity test against an f64 reference on the GPU
//! (`shared/tests/cuda_kernels.rs`, run by `scripts/gpu-check.sh`). Without the `cuda` feature
//! this crate is empty.
//!
//! - [`topk_rows`]: per row of logits, the log-softmax statistics and the top k (the teacher's
//!   device scoring path), one block per row, no host round trip.

#[cfg(feature = "cuda")]
mod ptx;
#[cfg(feature = "cuda")]
mod topk_rows;

#[cfg(feature = "cuda")]
pub use topk_rows::{topk_rows, RowScores, TopkArgs, MAX_K};
