//! xdistill training core: the student, its data, the losses and the SFT, off-policy and
//! on-policy training loops against teacher servers. The `trainer` binary's command-line fronts
//! live in `trainer/cli` (package `xdistill-trainer-cli`); the synthetic task and the demo in
//! `trainer/demo` (package `xdistill-demo`).

pub mod align;
pub mod chat;
pub mod checkpoint;
pub mod client;
pub mod collate;
pub mod config;
pub mod data;
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
pub mod train;
