//! Code shared by the xdistill teacher server and student trainer.
//!
//! - [`protocol`]: the `/topk_logits` request/response types and error bodies.
//! - [`codec`]: JSON and MessagePack encodings of those types (content negotiation helpers).
//! - [`hf`]: Hugging Face model directories: `config.json`, safetensors, `tokenizer.json`.
//! - [`tokenizer_json`]: `tokenizer.json` parsed into a tokenizer (a BPE's model without the
//!   `tokenizers` crate's intermediate trees).
//! - [`gguf`]: GGUF files (llama.cpp's format) read as they are, for inference.
//! - [`model`]: the Llama-family decoder (Llama, Qwen2, Qwen3) used by both sides.
//! - [`process`]: a `teacher` server as a child process (the demo, cross-process tests).
//! - [`report`]: errors as one line for people (the binaries' exit, the client's transport errors).
//! - [`init`]: random parameters for a model config, reproducible from a seed.
//! - [`topk`]: the device top-k of logit rows (the teacher's GPU scoring, the trainer's losses).
//!
//! The CPU's hot loops (the SIMD level, the matmul, the teacher's row scoring and fused LM head,
//! the forward's row ops) are `xdistill-cpu-kernels` (`kernels/cpu/`), a leaf crate compiled
//! optimised in every profile; this one builds at a lower level in tests (Cargo.toml).

pub mod alloc;
pub mod codec;
pub mod device;
pub mod gguf;
pub mod hf;
pub mod init;
pub mod model;
pub mod model_check;
pub mod paths;
pub mod process;
pub mod profiling;
pub mod protocol;
pub mod report;
pub mod tokenizer_json;
pub mod topk;

pub use hf::{HfError, ModelConfig, ModelDir};
