//! xdistill trainer library: everything the `trainer` binary does, importable by tests and benches.

pub mod align;
pub mod init_model;
pub mod projection;
