//! xdistill teacher server: batched, cached top-k log-probs of a Llama/Qwen model over HTTP.
//!
//! Request path: [`accept`] (connections; started by [`launch`]) → [`routes`] (HTTP, auth, the native route) or [`compat`] (the vLLM- and
//! SGLang-compatible routes) → [`validation`] → [`engine`]: [`cache`] → [`batcher`] (admission,
//! coalescing) → [`worker`] (the model, on its own thread) → [`scoring`] → the route's encoder.
//! The routes share [`state`] (configuration, the loaded model's facts) and [`body`] (reading a
//! body, answering an error); every stop shares [`request`] (the validated request). No module
//! imports one that imports it back (`xdistill-testkit`'s `structure` tests check it).

pub mod accept;
pub mod args;
pub mod batcher;
pub mod body;
pub mod cache;
pub mod compat;
pub mod encode;
pub mod engine;
pub mod error;
pub mod head_file;
pub mod hyper_errors;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod probe;
pub mod request;
pub mod routes;
pub mod scoring;
pub mod shutdown;
pub mod state;
pub mod validation;
pub mod vocab;
pub mod worker;

pub use args::Args;
