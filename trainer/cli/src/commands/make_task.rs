//! `trainer make-task`: flags for [`xdistill_demo::task`], which writes the splits.

use std::path::PathBuf;
use xdistill_demo::task::{make_splits, write_splits, Op, TaskConfig, TaskError};

/// `trainer make-task`: write a synthetic arithmetic task with disjoint train/test splits.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Output directory (gets train.jsonl, test.jsonl, task.json).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 2000)]
    pub train: usize,
    #[arg(long, default_value_t = 200)]
    pub test: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Digits of each operand.
    #[arg(long, default_value_t = 2)]
    pub digits: u32,
    /// Operations, comma separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "add")]
    pub ops: Vec<Op>,
}

/// Runs `trainer make-task`: draws the splits and writes them under `--out`.
pub fn run(a: Args) -> Result<(), TaskError> {
    let cfg = TaskConfig {
        digits: a.digits,
        ops: a.ops,
        train: a.train,
        test: a.test,
        seed: a.seed,
    };
    let splits = make_splits(&cfg)?;
    write_splits(&a.out, &cfg, &splits)?;
    tracing::info!(
        "wrote {} train and {} test problems to {}",
        splits.train.len(),
        splits.test.len(),
        a.out.display()
    );
    Ok(())
}
