//! The cross-process tests: `teacher` and `trainer` processes together (distillation runs, the
//! demo, data parallel, many teachers, replicas behind HAProxy, hardening, the Docker images,
//! the binaries' SIMD kernels compiled at their instruction sets),
//! one binary (one link). Each file is a module; `cargo nextest run -E 'test(/^balancer::/)'` runs one.

// Trainer and teacher code runs in this process too: allocate with jemalloc as the binaries do
// (xdistill_shared::alloc), not through glibc, which unmaps and page-faults back every large
// buffer on each step; and, the process being short-lived, never return freed pages
// (TEST_MALLOC_CONF: a fifth less time in the kernel's page zeroing for these tests).
xdistill_shared::global_allocator!(xdistill_shared::alloc::TEST_MALLOC_CONF);

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
