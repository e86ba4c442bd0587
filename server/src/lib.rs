//! xdistill teacher server: batched, cached top-k log-probs of a Llama/Qwen model over HTTP.
//!
//! Request path: [`app`] (HTTP, auth, the native route) or [`compat`] (the vLLM- and
//! SGLang-compatible routes) → [`validation`] → [`engine`]: [`cache`] → [`batcher`] (admission,
//! coalescing) → [`worker`] (the model, on its own thread) → [`scoring`] → the route's encoder.

pub mod app;
pub mod args;
pub mod batcher;
pub mod cache;
pub mod compat;
pub mod encode;
pub mod engine;
pub mod error;
pub mod head;
pub mod head_errors;
pub mod metrics;
pub mod model;
pub mod probe;
pub mod scoring;
pub mod serve;
pub mod server;
pub mod shutdown;
pub mod validation;
pub mod vocab;
pub mod worker;

pub use args::Args;
