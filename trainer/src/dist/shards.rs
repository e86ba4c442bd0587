//! A step's virtual shards: the step's gradient is the pairwise-tree sum of `S` shards, each a
//! contiguous slice of the step's records, whatever the number of processes; rank `r` of `N`
//! computes the contiguous share `r·S/N .. (r+1)·S/N`. Shard contents, their micro-batches and
//! (on-policy) their samples are the same for every `N`, so with `S/N` a power of two every `N`
//! adds the same numbers in the same order.

use super::even_shares;
use crate::data::{Batch, DataPosition, Record};
use std::ops::Range;

/// How a step's records are cut into virtual shards, and which of them this rank trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPlan {
    /// `S`: virtual shards per step.
    pub shards: usize,
    pub world_size: usize,
    pub rank: usize,
}

impl ShardPlan {
    /// `virtual_shards = 0` means one shard per process. `N` must divide `S`.
    pub fn new(virtual_shards: usize, world_size: usize, rank: usize) -> Result<ShardPlan, String> {
        let shards = if virtual_shards == 0 {
            world_size
        } else {
            virtual_shards
        };
        if world_size == 0 || rank >= world_size {
            return Err(format!("rank {rank} of a world of {world_size}"));
        }
        if !shards.is_multiple_of(world_size) {
            return Err(format!(
                "policy.data_parallel.virtual_shards = {shards} is not a multiple of the {world_size} \
                 processes: each process trains the same number of shards (use a power of two such \
                 as {} for the same weights at 1, 2, 4, … processes)",
                (world_size.next_power_of_two()).max(8)
            ));
        }
        Ok(ShardPlan {
            shards,
            world_size,
            rank,
        })
    }

    /// The single process's plan with one shard: the step's micro-batches summed in order.
    pub fn solo() -> ShardPlan {
        ShardPlan {
            shards: 1,
            world_size: 1,
            rank: 0,
        }
    }

    /// Whether `S/N` is a power of two: then this run's weights equal those of any other
    /// process count with the same property, bit for bit.
    pub fn exact_across_world_sizes(&self) -> bool {
        (self.shards / self.world_size).is_power_of_two()
    }

    /// The shard indices this rank trains.
    pub fn mine(&self) -> Range<usize> {
        let per = self.shards / self.world_size;
        self.rank * per..(self.rank + 1) * per
    }

    /// This rank's shards of a global batch (a short last batch leaves some shards empty).
    pub fn split(&self, batch: Batch) -> StepShards {
        let len = batch.records.len();
        let bounds = even_shares(len, self.shards);
        let mine = self.mine();
        let mut records = batch.records;
        // Keep this rank's contiguous span, then cut it at the shard bounds.
        let (lo, hi) = (bounds[mine.start].start, bounds[mine.end - 1].end);
        records.truncate(hi);
        let mut span: Vec<Record> = records.split_off(lo);
        let mut shards = Vec::with_capacity(mine.len());
        for k in mine.rev() {
            let b = &bounds[k];
            let tail = span.split_off(b.start - lo);
            shards.push(Shard {
                records: tail,
                offset: b.start,
            });
        }
        shards.reverse();
        StepShards {
            start: batch.start,
            next: batch.next,
            len,
            shards,
        }
    }
}

/// One virtual shard of a step: its records and where they start in the global batch.
#[derive(Debug, Clone)]
pub struct Shard {
    pub records: Vec<Record>,
    /// Index of the shard's first record in the step's global batch (on-policy seeds its
    /// samples from it, so they do not depend on the number of processes).
    pub offset: usize,
}

/// This rank's virtual shards of one step, in order, with the global batch's position.
#[derive(Debug, Clone)]
pub struct StepShards {
    /// Position of the global batch's first record.
    pub start: DataPosition,
    /// The data position after the global batch (saved in the step's checkpoint).
    pub next: DataPosition,
    /// Records in the global batch (every rank's shards together).
    pub len: usize,
    pub shards: Vec<Shard>,
}

impl StepShards {
    /// Epoch of the global batch's first record.
    pub fn epoch(&self) -> u64 {
        self.start.epoch
    }

    /// Every record of this rank's shards, in order.
    pub fn records(&self) -> impl Iterator<Item = &Record> {
        self.shards.iter().flat_map(|s| &s.records)
    }

    /// The shards as batches (each with the global batch's positions), for objectives that
    /// prepare each shard as a batch.
    pub fn batches(&self) -> Vec<Batch> {
        self.shards
            .iter()
            .map(|s| Batch {
                records: s.records.clone(),
                start: DataPosition {
                    epoch: self.start.epoch,
                    index: self.start.index + s.offset,
                },
                next: self.next,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Content;

    fn batch(n: usize) -> Batch {
        Batch {
            records: (0..n)
                .map(|i| Record {
                    line: i + 1,
                    content: Content::Text {
                        text: format!("r{i}"),
                    },
                    completion_only_loss: false,
                    teacher: None,
                })
                .collect(),
            start: DataPosition::default(),
            next: DataPosition::default(),
        }
    }

    fn lines(s: &StepShards) -> Vec<Vec<usize>> {
        s.shards
            .iter()
            .map(|x| x.records.iter().map(|r| r.line).collect())
            .collect()
    }

    #[test]
    fn ranks_take_contiguous_shares_of_the_same_shards() {
        for n in [8, 7, 3, 0] {
            let one = ShardPlan::new(4, 1, 0).unwrap().split(batch(n));
            let all = lines(&one);
            assert_eq!(all.len(), 4);
            assert_eq!(all.concat(), (1..=n).collect::<Vec<_>>());
            for world in [2, 4] {
                let mut joined = vec![];
                for rank in 0..world {
                    let p = ShardPlan::new(4, world, rank).unwrap();
                    let s = p.split(batch(n));
                    assert_eq!(s.shards.len(), 4 / world);
                    for (sh, k) in s.shards.iter().zip(p.mine()) {
                        assert_eq!(sh.offset, one.shards[k].offset);
                    }
                    joined.extend(lines(&s));
                }
                assert_eq!(joined, all, "{n} records over {world} ranks");
            }
        }
    }

    #[test]
    fn world_must_divide_the_shards() {
        assert!(ShardPlan::new(4, 3, 0)
            .unwrap_err()
            .contains("virtual_shards = 4"));
        assert_eq!(ShardPlan::new(0, 3, 2).unwrap().shards, 3);
        assert!(ShardPlan::new(8, 2, 0).unwrap().exact_across_world_sizes());
        assert!(!ShardPlan::new(6, 2, 0).unwrap().exact_across_world_sizes());
    }
}
