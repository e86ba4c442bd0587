//! The cross-process tests: `teacher` and `trainer` processes together (distillation runs, the
//! demo, data parallel, many teachers, replicas behind HAProxy, hardening, the Docker images),
//! one binary (one link). Each file is a module; `cargo nextest run -E 'test(/^balancer::/)'` runs one.

// Trainer and teacher code runs in this process too: allocate as the binaries do (jemalloc,
// xdistill_shared::alloc), not through glibc, which unmaps and page-faults back every large
// buffer on each step.
xdistill_shared::global_allocator!();

mod balancer;
mod checkpoint_state;
mod data_parallel;
mod demo;
mod full_vocab;
mod hardening;
mod images;
mod off_policy;
mod on_policy;
mod teachers;
mod tokenizers;
