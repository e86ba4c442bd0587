//! Data parallelism: who this process is ([`launch`]), the one seam for collectives
//! ([`Collective`]) with its CPU backend over TCP ([`tcp`]), and the exact mode's summation
//! order ([`tree`]).
//!
//! A single process is a world of one ([`Solo`]): every collective is the identity, so the
//! training loop has one code path whatever the number of processes.

pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod tcp;
pub mod tree;

pub use launch::{LaunchError, Launcher, World};
pub use tcp::{GroupOptions, TcpGroup};

use std::ops::Range;

/// A collective failed: a peer died or hung, ranks diverged, or the group never formed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("data-parallel rendezvous failed: {message}")]
    Rendezvous { message: String },
    #[error("rank {peer} is gone ({op}: {source}); every rank stops — resume from the last checkpoint, with any number of processes")]
    PeerGone {
        op: &'static str,
        peer: usize,
        source: std::io::Error,
    },
    #[error("rank {peer} did not answer within the collective timeout ({op}); every rank stops — resume from the last checkpoint")]
    Timeout { op: &'static str, peer: usize },
    #[error("ranks diverged at collective #{seq}: expected {expected} from rank {peer}, got {got} (do all ranks run the same config and data?)")]
    Mismatch {
        peer: usize,
        expected: &'static str,
        got: &'static str,
        seq: u64,
    },
    #[error("{0}")]
    Usage(String),
}

impl CollectiveError {
    fn io(op: &'static str, peer: usize, e: std::io::Error) -> CollectiveError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                CollectiveError::Timeout { op, peer }
            }
            _ => CollectiveError::PeerGone {
                op,
                peer,
                source: e,
            },
        }
    }
}

/// The collectives data-parallel training needs. Sums are exact-mode sums: the pairwise tree
/// of [`tree`] over ranks in rank order, the same bits on every rank.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// `buf` becomes the element-wise sum over ranks (`[n]` on every rank, the same `n`).
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// The element-wise sum over ranks of `buf[shares[r]]`, returned to rank `r` only.
    /// `shares` are contiguous, cover `buf` and have one entry per rank.
    fn reduce_scatter_sum(
        &mut self,
        buf: &[f32],
        shares: &[Range<usize>],
    ) -> Result<Vec<f32>, CollectiveError>;
    /// Every rank's `mine`, in rank order, on every rank.
    fn all_gather(&mut self, mine: &[f32]) -> Result<Vec<Vec<f32>>, CollectiveError>;
    /// Rank 0's `bytes` on every rank.
    fn broadcast(&mut self, bytes: &mut Vec<u8>) -> Result<(), CollectiveError>;
    /// Returns when every rank has reached it.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.all_reduce_sum(&mut [])
    }
}

/// A world of one process: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn reduce_scatter_sum(
        &mut self,
        buf: &[f32],
        shares: &[Range<usize>],
    ) -> Result<Vec<f32>, CollectiveError> {
        match shares {
            [only] if only.start == 0 && only.end == buf.len() => Ok(buf.to_vec()),
            _ => Err(CollectiveError::Usage(format!(
                "a world of one has one share 0..{}, got {shares:?}",
                buf.len()
            ))),
        }
    }
    fn all_gather(&mut self, mine: &[f32]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        Ok(vec![mine.to_vec()])
    }
    fn broadcast(&mut self, _bytes: &mut Vec<u8>) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// `len` elements in `world` contiguous shares, the first `len % world` one longer.
pub fn even_shares(len: usize, world: usize) -> Vec<Range<usize>> {
    let (base, extra) = (len / world.max(1), len % world.max(1));
    let mut start = 0;
    (0..world)
        .map(|r| {
            let n = base + usize::from(r < extra);
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests;
