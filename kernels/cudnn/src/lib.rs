//! cuDNN's fused scaled-dot-product attention (the kernels PyTorch's cuDNN backend and llm.c
//! use) as a candle op on CUDA devices.
//!
//! The C++ side (`sdpa.cpp`) is a small shim over cuDNN's header-only graph frontend; it loads
//! cuDNN at run time, so binaries start where cuDNN is absent (`load` says why not, and
//! callers keep their own attention). Without the `cuda` feature this crate is empty.

#[cfg(feature = "cuda")]
mod sdpa;
#[cfg(feature = "cuda")]
pub use sdpa::{
    graphs_built, load, prepare_train, sdpa, sdpa_backward, sdpa_train, Causal, Params,
};
