//! Data parallelism: who this process is ([`launch`]), the one seam for collectives
//! ([`Collective`]) with its CPU backend over TCP ([`tcp`]), the exact mode's summation order
//! ([`tree`]), a step's virtual shards ([`shards`]) and ZeRO-1's split of the optimiser state
//! ([`zero`]).
//!
//! A single process is a world of one ([`Solo`]): every collective is the identity, so the
//! training loop has one code path whatever the number of processes.

pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod shards;
pub mod tcp;
pub mod tree;
pub mod zero;

pub use launch::{LaunchError, Launcher, World};
pub use shards::{Shard, ShardPlan, StepShards};
pub use tcp::{GroupOptions, TcpGroup};
pub use zero::Ownership;

use candle_core::Tensor;
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
    /// The backend's fastest all-reduce, where bit-equality across process counts is not
    /// needed (`policy.data_parallel.all_reduce = "fast"`): NCCL's own; elsewhere the exact sum.
    fn all_reduce_sum_fast(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce_sum(buf)
    }
    /// Returns when every rank has reached it.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.all_reduce_sum(&mut [])
    }
    /// The sum over ranks of `flat` (`[n]` f32 on this rank's device, the same `n` on every
    /// rank) as a tensor on that device: [`Collective::all_reduce_sum`]'s exact bits, or with
    /// `fast` [`Collective::all_reduce_sum_fast`]'s. Staged through the host here; NCCL keeps
    /// it on the GPU.
    fn all_reduce_sum_tensor(
        &mut self,
        flat: &Tensor,
        fast: bool,
    ) -> Result<Tensor, CollectiveError> {
        sum_through_host(self, flat, fast)
    }
}

/// [`Collective::all_reduce_sum_tensor`] through a host buffer: `flat` copied to the host,
/// summed by the host-buffer collectives, copied back to its device.
pub fn sum_through_host<C: Collective + ?Sized>(
    group: &mut C,
    flat: &Tensor,
    fast: bool,
) -> Result<Tensor, CollectiveError> {
    let candle = |e: candle_core::Error| {
        CollectiveError::Usage(format!("staging a gradient buffer through the host: {e}"))
    };
    let mut host: Vec<f32> = flat.to_vec1().map_err(candle)?;
    if fast {
        group.all_reduce_sum_fast(&mut host)?;
    } else {
        group.all_reduce_sum(&mut host)?;
    }
    let n = host.len();
    Tensor::from_vec(host, n, flat.device()).map_err(candle)
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

/// Checks that `shares` are `world` contiguous ranges covering `0..len` (a reduce-scatter's
/// split), for every backend.
pub(crate) fn check_shares(
    shares: &[Range<usize>],
    len: usize,
    world: usize,
) -> Result<(), CollectiveError> {
    let contiguous = shares.len() == world
        && shares.first().is_some_and(|r| r.start == 0)
        && shares.last().is_some_and(|r| r.end == len)
        && shares.windows(2).all(|w| w[0].end == w[1].start)
        && shares.iter().all(|r| r.start <= r.end);
    if contiguous {
        Ok(())
    } else {
        Err(CollectiveError::Usage(format!(
            "reduce-scatter needs {world} contiguous shares covering 0..{len}, got {shares:?}"
        )))
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

/// `v` summed element-wise over ranks, in f64 and rank order (the same value on every rank):
/// the loss sums, token counts and squared norms of a step. Travels as bits through
/// [`Collective::all_gather`].
pub fn sum_f64(c: &mut dyn Collective, v: &mut [f64]) -> Result<(), CollectiveError> {
    if c.world_size() == 1 || v.is_empty() {
        return Ok(());
    }
    let all = c.all_gather(&f64_bits(v))?;
    for x in v.iter_mut() {
        *x = 0.0;
    }
    for rank in &all {
        for (x, y) in v.iter_mut().zip(f64_from_bits(rank)) {
            *x += y;
        }
    }
    Ok(())
}

/// Every rank's `v` (f64, bit for bit), in rank order.
pub fn gather_f64(c: &mut dyn Collective, v: &[f64]) -> Result<Vec<Vec<f64>>, CollectiveError> {
    if c.world_size() == 1 {
        return Ok(vec![v.to_vec()]);
    }
    Ok(c.all_gather(&f64_bits(v))?
        .iter()
        .map(|r| f64_from_bits(r))
        .collect())
}

/// Each f64 as two f32 slots holding its bits (low word first): collectives move f32 buffers.
fn f64_bits(v: &[f64]) -> Vec<f32> {
    v.iter()
        .flat_map(|x| {
            let b = x.to_bits();
            [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
        })
        .collect()
}

fn f64_from_bits(v: &[f32]) -> Vec<f64> {
    v.chunks_exact(2)
        .map(|p| f64::from_bits(p[0].to_bits() as u64 | ((p[1].to_bits() as u64) << 32)))
        .collect()
}

/// Joins the job the launcher's environment describes (`world`; `None`: a world of one) over
/// TCP: rank 0 listens on `MASTER_ADDR:port`, every rank proves it runs the same config
/// (`config_hash`), and every collective waits at most `timeout`. On a CUDA `device` of a
/// build with the `nccl` feature the collectives then run on NCCL, whose id travels over that
/// TCP group.
pub fn join(
    world: Option<&World>,
    config_hash: &str,
    timeout: std::time::Duration,
    device: &candle_core::Device,
) -> Result<Box<dyn Collective + Send>, CollectiveError> {
    let Some(w) = world else {
        return Ok(Box::new(Solo));
    };
    if w.world_size == 1 {
        return Ok(Box::new(Solo));
    }
    use sha2::Digest;
    let opts = GroupOptions {
        timeout,
        config_hash: sha2::Sha256::digest(config_hash.as_bytes()).into(),
    };
    let addr = format!("{}:{}", w.master_addr, w.port);
    tracing::info!(
        rank = w.rank,
        world_size = w.world_size,
        launcher = %w.launcher,
        "joining the data-parallel group at {addr}"
    );
    let tcp = TcpGroup::connect(w.rank, w.world_size, &addr, &opts)?;
    #[cfg(feature = "nccl")]
    if device.is_cuda() {
        let mut bootstrap = tcp;
        let group = nccl::NcclGroup::new(device, w.rank, w.world_size, &mut bootstrap)?;
        tracing::info!(rank = w.rank, "collectives on NCCL");
        return Ok(Box::new(group));
    }
    #[cfg(not(feature = "nccl"))]
    if device.is_cuda() {
        tracing::warn!(
            "a CUDA device in a build without the `nccl` feature: collectives go through the \
             TCP backend and host memory (slow); build with scripts/build-cuda.sh"
        );
    }
    Ok(Box::new(tcp))
}

/// The device of this process: `policy.device` (`auto` resolved first), with `cuda` meaning
/// `cuda:LOCAL_RANK` in a data-parallel job (one process per device).
pub fn device(spec: &str, world: Option<&World>) -> anyhow::Result<candle_core::Device> {
    let spec = xdistill_shared::device::resolve_device(spec);
    let spec = spec.as_str();
    let Some(w) = world.filter(|w| w.world_size > 1) else {
        return Ok(xdistill_shared::device::parse_device(spec)?);
    };
    if spec.eq_ignore_ascii_case("cuda") {
        let ordinal = w.device_ordinal();
        return Ok(xdistill_shared::device::parse_device(&format!(
            "cuda:{ordinal}"
        ))?);
    }
    if spec.to_ascii_lowercase().starts_with("cuda:") {
        anyhow::bail!(
            "policy.device = {spec:?} in a data-parallel job of {} processes: every process \
             would use the same GPU; set policy.device = \"cuda\" (each process takes \
             cuda:LOCAL_RANK)",
            w.world_size
        );
    }
    Ok(xdistill_shared::device::parse_device(spec)?)
}

#[cfg(test)]
mod tests;
