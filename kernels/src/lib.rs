//! Fused, differentiable ops the training losses and the optimiser lean on (a crate of its own so
//! that it is optimised in dev builds and the teacher does not compile it).
//!
//! `log_softmax` over a 150k-column vocabulary is the hottest op of a distillation step after the
//! LM-head matmul. candle's composed version materialises ~6 full `[N, V]` intermediates forward and
//! more backward; the fused CPU kernel below makes one pass to read and one to write, and its
//! backward (`g − softmax · Σg`) is fused too. Other devices use the composed ops. In f32 the row
//! passes (max, Σexp, the softmax of the backward) are vectorised ([`vmath`]) and run at the
//! CPU's widest instruction set ([`xdistill_cpu_kernels::simd::Simd`]), chosen once.
//!
//! One op per module: [`log_softmax`], [`gather_log_softmax`], [`sum_squares`], the AdamW update
//! ([`adamw_update`], [`adamw_update_in_place`]), gradient accumulation in place
//! ([`grad_accumulate`](fn@grad_accumulate): one launch for every parameter on CUDA), the fused
//! top-k distillation loss and cross-entropy per row ([`topk_kd()`], the CUDA kernel
//! `topk_kd.cu` with an f64 CPU reference), and the vectorised row passes [`vmath`], and the sparse product [`sparse_matmul`] of the
//! cross-tokenizer projections.

mod adamw;
mod gather;
pub mod grad_accumulate;
mod log_softmax;
mod num_like;
mod sparse_matmul;
mod sum_squares;
#[cfg(test)]
mod testutil;
pub mod topk_kd;
pub mod vmath;

pub use adamw::{adamw_update, adamw_update_in_place, AdamWStep};
pub use gather::gather_log_softmax;
pub use grad_accumulate::{grad_accumulate, GradSum};
pub use log_softmax::log_softmax;
pub use sparse_matmul::{sparse_matmul, SparseColumns};
pub use sum_squares::sum_squares;
pub use topk_kd::{topk_kd, KdDivergence, KdTail, TopkKd, TopkKdTrain, TRAIN_MAX_K};
