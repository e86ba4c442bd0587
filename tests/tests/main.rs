//! The cross-process tests: `teacher` and `trainer` processes together (distillation runs, the
//! demo, data parallel, many teachers, replicas behind HAProxy, hardening, the Docker images,
//! the binaries' SIMD kernels compiled at their instruction sets),
//! one binary (one link). Each file is a module; `cargo nextest run -E 'test(/^balancer::/)'` runs one.

// Trainer code runs in this process too: allocate with jemalloc as the `trainer` binary does
// (xdistill_shared::alloc), not through glibc, which unmaps and page-faults back every large
// buffer on each step; freed pages are kept for the next step (on 2026-11-29 a fifth less time
// in the kernel's page zeroing for these tests).
xdistill_shared::global_allocator!(xdistill_shared::alloc::RETAINING_MALLOC_CONF);

mod allocator;
mod balancer;
mod checkpoint_state;
mod data_parallel;
mod demo;
mod full_vocab;
mod gpu_tools;
mod hardening;
mod images;
mod off_policy;
mod on_policy;
mod simd_build;
mod teachers;
mod tokenizers;
