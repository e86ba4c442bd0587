//! The integration tests of `xdistill-shared`, one binary (one link): GGUF files, model loading
//! and decoders against references, model files and decoders fuzzed, the training pass, and (CUDA builds)
//! cuDNN's fused attention. Each file is a module; `cargo nextest run -E 'test(/^gguf::/)'` runs
//! one.

#[cfg(feature = "cuda")]
mod cuda_kernels;
#[cfg(feature = "cuda")]
mod cudnn_attention;
mod decode_fuzz;
mod gguf;
mod model;
mod model_files;
mod train_pass;
