//! xdistill trainer library: everything the `trainer` binary does, importable by tests and benches.

pub mod align;
pub mod answer;
pub mod bench_step;
pub mod chat;
pub mod checkpoint;
pub mod client;
pub mod collate;
pub mod config;
pub mod data;
pub mod demo;
pub mod dist;
pub mod eval;
pub mod generate;
pub mod init_model;
pub mod loss;
pub mod metrics_log;
pub mod model_check;
pub mod optim;
pub mod prune;
pub mod student;
pub mod task;
pub mod train;
