//! xdistill trainer library: everything the `trainer` binary does, importable by tests and benches.

pub mod checkpoint;
pub mod client;
pub mod config;
pub mod data;
pub mod init_model;
pub mod metrics_log;
