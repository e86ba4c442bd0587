//! xdistill trainer library: everything the `trainer` binary does, importable by tests and benches.

pub mod collate;
pub mod init_model;
pub mod student;
