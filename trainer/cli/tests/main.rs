//! The `trainer` binary's tests, one binary (one link): eval, GGUF students and the resume
//! guard, each a module.

#[path = "../../tests/common/mod.rs"]
mod common;

mod eval;
mod gguf;
mod resume_guard;
