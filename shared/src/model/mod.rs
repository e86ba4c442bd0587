//! The decoders we serve and train, one file per architecture in candle's manner:
//! `llama.rs` (Llama, Mistral, Qwen2, Qwen3), `gemma3.rs`, `phi3.rs`, `qwen3_moe.rs`, each with
//! its facts (names, defaults, window rule, layer shape; the types in `facts.rs`) behind
//! `arch.rs` (the one table every other module asks; it says what adding an architecture
//! touches). What they truly share lives beside them: `config.rs` (reading `config.json`; its
//! errors in `error.rs`), `spec.rs` (one layer as the config resolves it: what an
//! architecture's file builds a block from), `rope.rs` (every RoPE scaling type, from the
//! parameters the config resolves), `layers.rs` (norms, attention, the dense and the sparse MLP,
//! a block), `params.rs` (every parameter's name and shape) and `decoder.rs` (the one forward
//! loop).
//! Each runs in two modes ([`Ops`]): fused kernels for serving (candle's; on the CPU in f32
//! the linear layers through [`xdistill_cpu_kernels::matmul`], and on the CPU the attention's softmax and the
//! MLP's `silu(gate) · up` with the SIMD exp, `xdistill_cpu_kernels::host_ops`; on CUDA, with
//! [`AttnBackend::Cudnn`], the attention through cuDNN, `attn_cudnn.rs`), and ops that all have
//! a backward pass for training. `device_ops.rs` holds the fused RMSNorm, RoPE and gated
//! activation (with their backward) that CUDA runs with the project's kernels; `autograd.rs` the
//! linear layer as one node and gradients seeded at known outputs (candle's backward kept
//! small); `train_layer.rs` a dense layer's training forward and backward by hand, where the
//! fused ops run (no autograd graph), and `embed_grad.rs` the embedding's gradient without a
//! scatter-add; `packed.rs` the
//! packed forward of several sequences (the teacher's batch-invariant mode in fixed matmul
//! blocks), `gemm_blocks.rs` the scope and the cuBLAS op that make its linear layers multiply
//! those blocks. `precision.rs` retraces the forward op by op in f32 and f64 (where an f32 forward
//! loses accuracy).

pub mod arch;
#[cfg(feature = "cuda")]
mod attn_cudnn;
mod attn_rows;
pub mod autograd;
mod blockwise;
pub mod config;
mod decoder;
pub mod device_ops;
mod embed_grad;
mod error;
mod facts;
mod gemm_blocks;
mod gemma3;
mod layers;
mod llama;
mod packed;
mod params;
mod phi3;
pub mod precision;
mod qwen3_moe;
pub mod rope;
mod spec;
#[cfg(test)]
mod test_tensors;
mod train;
mod train_attention;
mod train_layer;

#[cfg(feature = "cuda")]
pub use attn_cudnn::refused_shapes as cudnn_refused_shapes;
pub use attn_rows::{attention_bucket, bucketed, ATTENTION_BUCKET};
#[doc(hidden)]
pub use blockwise::override_block as override_attention_block;
pub(crate) use config::stored_name;
pub use decoder::{Decoder, KvCache};
#[cfg(feature = "cuda")]
pub use gemm_blocks::packed_gemm_mode;
pub use gemm_blocks::packed_gemm_name;
pub use layers::{linear_kernel, AttnBackend, Ops};
pub use packed::{PackedSeq, PACKED_ROWS};
pub use params::{param_specs, Init, ParamSpec};
pub use spec::Activation;
pub use train::{ActivationBytes, Activations, AfterLayer, TrainPass, KEEP_MAX_POSITIONS};
