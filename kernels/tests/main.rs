//! The integration tests of `xdistill-kernels`, one binary (one link): (CUDA builds) the fused
//! top-k distillation loss on the GPU against its CPU reference. Each file is a module.

#[cfg(feature = "cuda")]
mod topk_kd_gpu;
