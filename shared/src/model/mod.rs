//! The Llama-family decoder and the list of its parameters.
//!
//! One implementation serves Llama, Qwen2 and Qwen3 (they differ only in q/k/v biases and the
//! Qwen3 per-head q/k RMSNorm). It runs in two modes ([`Ops`]): fused candle kernels for serving,
//! and ops that all have a backward pass for training.

mod decoder;
mod params;

pub use decoder::{Decoder, KvCache, Ops};
pub use params::{param_specs, Init, ParamSpec};
