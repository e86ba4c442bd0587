//! The `trainer` binary's tests, one binary (one link): how a failed run ends, eval, GGUF
//! students and the resume guard, each a module.

#[path = "../../tests/common/mod.rs"]
mod common;

mod errors;
mod eval;
mod gguf;
mod resume_guard;
