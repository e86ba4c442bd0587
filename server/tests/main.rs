//! The server's cross-process tests, one binary (one link): each file is a module testing one
//! side of a running `teacher` (scores, admission, errors, the compatible routes, lifecycle, …);
//! `common` is their shared facade over `xdistill_testkit`. The Docker images' tests live with
//! the other cross-process tests, `tests/tests/images.rs`. `cargo nextest run -E
//! 'test(/^scores::/)'` runs one module.

mod common;

mod admission;
mod compat;
mod deploy;
mod device_topk;
mod errors;
mod full_vocab;
mod gguf;
mod invariance;
mod lifecycle;
mod replica_probe;
mod scores;
mod starvation;
mod strictness;
