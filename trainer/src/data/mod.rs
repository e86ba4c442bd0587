//! Training text: reading JSONL or plain-text files into [`Record`]s (skipping and counting bad
//! ones), a deterministic validation split, per-epoch shuffling from a seed, and a [`Batcher`]
//! whose [`DataPosition`] goes into checkpoints so that a resumed run sees the same batches.
//!
//! Data stays text here: tokenization and alignment happen downstream.

mod batch;
mod order;
mod read;
mod record;
mod split;

pub use batch::{Batch, BatchOptions, Batcher, DataPosition};
pub use order::epoch_order;
pub use read::{Dataset, LoadOptions};
pub use record::{Content, Record, SkipCounts, SkipReason};
pub use split::{load_train_val, val_size};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no usable records ({skipped})")]
    NoRecords { path: PathBuf, skipped: SkipCounts },
    #[error("validation split of {val} records leaves no training records (of {total})")]
    SplitTooLarge { val: usize, total: usize },
    #[error("data position {position:?} is past the end of an epoch of {len} records")]
    BadPosition { position: DataPosition, len: usize },
}

#[cfg(test)]
mod tests;
