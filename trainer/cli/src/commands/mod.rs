//! One front per `trainer` subcommand that has no home in the libraries: its flags (clap
//! `Args`) and the glue that calls the library and prints the result. The training commands'
//! flags live with their configuration (`xdistill_trainer::config`, `train::sft::SftArgs`) and
//! the alignment tools' in `xdistill_trainer::align::cli`.

pub mod bench_step;
pub mod demo;
pub mod eval;
pub mod fetch_tokenizers;
pub mod make_task;
#[cfg(feature = "nccl")]
pub mod nccl_check;
pub mod prune;

/// A `--device` value as clap keeps it: `auto` resolved to the device it means here
/// (`xdistill_shared::device::resolve_device`), any other name as given.
pub fn device_arg(s: &str) -> Result<String, std::convert::Infallible> {
    Ok(xdistill_shared::device::resolve_device(s))
}
