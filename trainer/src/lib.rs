//! xdistill trainer library: everything the `trainer` binary does, importable by tests and benches.

pub mod init_model;
pub mod answer;
pub mod task;
pub mod generate;
pub mod eval;
