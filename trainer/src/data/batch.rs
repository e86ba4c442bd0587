//! Batches over epochs, and the [`DataPosition`] a checkpoint stores to resume them exactly.

use super::{epoch_order, DataError, Record};
use serde::{Deserialize, Serialize};

/// Where the next batch starts: the epoch and the index into that epoch's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DataPosition {
    pub epoch: u64,
    pub index: usize,
}

/// One step's records.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub records: Vec<Record>,
    /// Position of this batch's first record.
    pub start: DataPosition,
    /// Position of the batch after this one: save this in the checkpoint of the step that
    /// trained on this batch.
    pub next: DataPosition,
}

/// Batching options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchOptions {
    pub batch_size: usize,
    pub seed: u64,
    pub shuffle: bool,
    pub drop_last: bool,
    /// The iterator ends after this many epochs.
    pub max_epochs: u64,
}

/// Yields batches of `batch_size` records, epoch after epoch. Batches never span two epochs:
/// an epoch's last batch may be smaller (or dropped with `drop_last`).
#[derive(Debug, Clone)]
pub struct Batcher {
    records: Vec<Record>,
    opts: BatchOptions,
    pos: DataPosition,
    order: Vec<usize>,
    order_epoch: Option<u64>,
}

impl Batcher {
    pub fn new(records: Vec<Record>, opts: BatchOptions) -> Batcher {
        Batcher {
            records,
            opts: BatchOptions {
                batch_size: opts.batch_size.max(1),
                ..opts
            },
            pos: DataPosition::default(),
            order: Vec::new(),
            order_epoch: None,
        }
    }

    /// Continues from `pos` (from a checkpoint's `Batch::next`).
    pub fn seek(&mut self, pos: DataPosition) -> Result<(), DataError> {
        if pos.index > self.records.len() {
            return Err(DataError::BadPosition {
                position: pos,
                len: self.records.len(),
            });
        }
        self.pos = pos;
        Ok(())
    }

    pub fn position(&self) -> DataPosition {
        self.pos
    }

    pub fn len_records(&self) -> usize {
        self.records.len()
    }

    /// Batches per epoch.
    pub fn steps_per_epoch(&self) -> usize {
        let (n, b) = (self.records.len(), self.opts.batch_size);
        if self.opts.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// Moves to the next epoch when the current one has no (full enough) batch left.
    fn normalize(&mut self) {
        let (n, b) = (self.records.len(), self.opts.batch_size);
        let left = n.saturating_sub(self.pos.index);
        if left == 0 || (self.opts.drop_last && left < b) {
            self.pos = DataPosition {
                // Saturating: a resumed state's epoch is read from its file.
                epoch: self.pos.epoch.saturating_add(1),
                index: 0,
            };
        }
    }
}

impl Iterator for Batcher {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let (n, b) = (self.records.len(), self.opts.batch_size);
        if n == 0 || (self.opts.drop_last && n < b) {
            return None;
        }
        self.normalize();
        if self.pos.epoch >= self.opts.max_epochs {
            return None;
        }
        if self.order_epoch != Some(self.pos.epoch) {
            self.order = epoch_order(n, self.opts.seed, self.pos.epoch, self.opts.shuffle);
            self.order_epoch = Some(self.pos.epoch);
        }
        let start = self.pos;
        let end = (start.index + b).min(n);
        let records = self.order[start.index..end]
            .iter()
            .map(|&i| self.records[i].clone())
            .collect();
        self.pos.index = end;
        self.normalize();
        Some(Batch {
            records,
            start,
            next: self.pos,
        })
    }
}

impl BatchOptions {
    /// Training batches as the config describes them.
    pub fn from_config(c: &crate::config::Config) -> BatchOptions {
        BatchOptions {
            batch_size: c.distillation.num_prompts_per_step,
            seed: c.distillation.seed,
            shuffle: c.data.shuffle,
            drop_last: c.data.drop_last,
            max_epochs: c.distillation.max_num_epochs,
        }
    }
}
