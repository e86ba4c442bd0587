//! A step's virtual shards: the step's gradient is the pairwise-tree sum of `S` shards, each a
//! contiguous slice of the step's records, whatever the number of processes; rank `r` of `N`
//! computes the contiguous share `r·S/N .. (r+1)·S/N`. Shard contents, their micro-batches and
//! (on-policy) their samples are the same for every `N`, so with `S/N` a power of two every `N`
//! adds the same numbers in the same order.

use super::even_shares;
use crate::config::VirtualShards;
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
    /// The plan for `virtual_shards` with steps of `records` records (`num_prompts_per_step`).
    /// `Fixed(0)` means one shard per process; `Auto` the largest power of two up to
    /// [`VirtualShards::AUTO_MAX`] dividing `records`. `N` must divide `S`: otherwise a
    /// one-line error naming the keys to set.
    pub fn new(
        virtual_shards: VirtualShards,
        records: usize,
        world_size: usize,
        rank: usize,
    ) -> Result<ShardPlan, String> {
        if world_size == 0 || rank >= world_size {
            return Err(format!("rank {rank} of a world of {world_size}"));
        }
        let shards = match virtual_shards {
            VirtualShards::Fixed(0) => world_size,
            VirtualShards::Fixed(s) => s,
            VirtualShards::Auto => auto_shards(records),
        };
        if !shards.is_multiple_of(world_size) {
            return Err(match virtual_shards {
                VirtualShards::Auto => auto_error(records, shards, world_size),
                _ => format!(
                    "policy.data_parallel.virtual_shards = {shards} is not a multiple of the \
                     {world_size} processes: each process trains the same number of shards (use \
                     a power of two such as {} for the same weights at 1, 2, 4, … processes)",
                    (world_size.next_power_of_two()).max(8)
                ),
            });
        }
        if shards > records.max(world_size) && rank == 0 {
            tracing::warn!(
                "policy.data_parallel.virtual_shards = {shards} for steps of {records} records: \
                 {} shards are empty every step, each a zero gradient computed and summed",
                shards - records
            );
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

/// `"auto"`'s shard count for steps of `records` records: the largest power of two at most
/// [`VirtualShards::AUTO_MAX`] that divides it (equal shards, no empty ones).
pub fn auto_shards(records: usize) -> usize {
    let mut s = VirtualShards::AUTO_MAX;
    while s > 1 && !records.is_multiple_of(s) {
        s /= 2;
    }
    s
}

/// Why `"auto"`'s `shards` equal shards of `records` records cannot be shared by `world`
/// processes, and what to set instead.
fn auto_error(records: usize, shards: usize, world: usize) -> String {
    let head = format!(
        "policy.data_parallel.virtual_shards = \"auto\" cuts a step's {records} records \
         (distillation.num_prompts_per_step) into {shards} equal virtual shards, which {world} \
         processes cannot share"
    );
    if world.is_power_of_two() && world <= VirtualShards::AUTO_MAX {
        format!(
            "{head}: make num_prompts_per_step a multiple of {max}, or set \
             policy.data_parallel.virtual_shards = {max} (unequal shards; either way the same \
             weights at 1, 2, 4 and 8 processes) or 0 (one shard per process: the weights depend \
             on the process count)",
            max = VirtualShards::AUTO_MAX
        )
    } else {
        format!(
            "{head}: \"auto\" serves 1, 2, 4 and 8 processes; set \
             policy.data_parallel.virtual_shards to a multiple of {world} (e.g. {world}: the same \
             weights at every process count N with {world}/N a power of two) or to 0 (one shard \
             per process: the weights depend on the process count)"
        )
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
            let one = ShardPlan::new(VirtualShards::Fixed(4), n, 1, 0)
                .unwrap()
                .split(batch(n));
            let all = lines(&one);
            assert_eq!(all.len(), 4);
            assert_eq!(all.concat(), (1..=n).collect::<Vec<_>>());
            for world in [2, 4] {
                let mut joined = vec![];
                for rank in 0..world {
                    let p = ShardPlan::new(VirtualShards::Fixed(4), n, world, rank).unwrap();
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
        let fixed = VirtualShards::Fixed;
        assert!(ShardPlan::new(fixed(4), 8, 3, 0)
            .unwrap_err()
            .contains("virtual_shards = 4"));
        assert_eq!(ShardPlan::new(fixed(0), 8, 3, 2).unwrap().shards, 3);
        assert!(ShardPlan::new(fixed(8), 8, 2, 0)
            .unwrap()
            .exact_across_world_sizes());
        assert!(!ShardPlan::new(fixed(6), 8, 2, 0)
            .unwrap()
            .exact_across_world_sizes());
    }

    /// `"auto"`: the largest power of two up to 8 dividing the step's records, whatever the
    /// process count, so 1, 2, 4 and 8 processes share one plan (and one set of bits).
    #[test]
    fn auto_picks_equal_power_of_two_shards_for_any_process_count() {
        for (records, want) in [
            (8, 8),
            (16, 8),
            (64, 8),
            (12, 4),
            (4, 4),
            (6, 2),
            (7, 1),
            (1, 1),
        ] {
            assert_eq!(auto_shards(records), want, "{records} records");
        }
        // The shipped configs' 8 records: the same 8 shards at 1, 2, 4 and 8 processes, each a
        // power-of-two share (so the weights match bit for bit), and 8 equal shards of one record.
        for world in [1, 2, 4, 8] {
            for rank in 0..world {
                let p = ShardPlan::new(VirtualShards::Auto, 8, world, rank).unwrap();
                assert_eq!(p.shards, 8, "N = {world}");
                assert!(p.exact_across_world_sizes(), "N = {world}");
                let s = p.split(batch(8));
                assert!(s.shards.iter().all(|x| x.records.len() == 1), "N = {world}");
            }
        }
        // One process of a step with an odd record count keeps the single shard it always had.
        assert_eq!(
            ShardPlan::new(VirtualShards::Auto, 7, 1, 0).unwrap(),
            ShardPlan::solo()
        );
    }

    /// `"auto"` refuses a process count its shards cannot be shared by, in one line naming the
    /// keys to set instead.
    #[test]
    fn auto_names_the_keys_when_the_processes_cannot_share_the_shards() {
        // 12 records make 4 shards: fine for 4 processes, not for 8.
        assert_eq!(
            ShardPlan::new(VirtualShards::Auto, 12, 4, 3)
                .unwrap()
                .shards,
            4
        );
        let e = ShardPlan::new(VirtualShards::Auto, 12, 8, 0).unwrap_err();
        for want in [
            "virtual_shards = \"auto\"",
            "12 records",
            "num_prompts_per_step a multiple of 8",
            "virtual_shards = 8",
            "or 0",
        ] {
            assert!(e.contains(want), "{want:?} not in: {e}");
        }
        // A process count "auto" never serves (3, or more than 8) names a multiple of it.
        for world in [3, 16] {
            let e = ShardPlan::new(VirtualShards::Auto, 48, world, 0).unwrap_err();
            assert!(
                e.contains(&format!("a multiple of {world}")) && e.contains("or to 0"),
                "N = {world}: {e}"
            );
        }
        for e in [e, ShardPlan::new(VirtualShards::Auto, 6, 4, 0).unwrap_err()] {
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }
}
