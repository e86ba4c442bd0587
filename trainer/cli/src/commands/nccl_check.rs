//! `trainer nccl-check` (builds with `--features nccl`): forms the NCCL group of this job (one
//! process per GPU, launched by torchrun or srun; a plain run is a world of one) and checks
//! every collective of [`NcclGroup`] against the sums computed locally: the exact all-reduce
//! and reduce-scatter give the pairwise tree's bits (and the TCP backend's, with more than one
//! rank), on host buffers and on a tensor kept on the GPU (the step's gradients: gathered there
//! and summed by the tree kernel), all-gather (ranks of different lengths), broadcast and
//! barrier work, and the fast all-reduce agrees to f32 rounding. Prints the times of the exact
//! and the fast all-reduce, on the host and on the device.

use anyhow::{bail, ensure, Context, Result};
use std::time::{Duration, Instant};
use xdistill_trainer::dist::nccl::NcclGroup;
use xdistill_trainer::dist::tree::tree_sum_in_place;
use xdistill_trainer::dist::{even_shares, Collective, GroupOptions, Solo, TcpGroup, World};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Elements of each rank's buffer (the default crosses the exact mode's 16 Mi chunk).
    #[arg(long, default_value_t = (1 << 24) + 1001)]
    pub len: usize,
    /// Seconds the TCP rendezvous waits for every rank.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

/// Rank `rank`'s test buffer: values spanning magnitudes, so the order of additions shows.
fn leaf(rank: usize, len: usize) -> Vec<f32> {
    let mut s = (rank as u32 + 1).wrapping_mul(2654435761) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let m = (s % 2001) as f32 / 1000.0 - 1.0;
            m * 10f32.powi((s % 9) as i32 - 4)
        })
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

pub fn run(a: Args) -> Result<()> {
    let world = World::from_env()?;
    let (rank, size, local) = world
        .as_ref()
        .map_or((0, 1, 0), |w| (w.rank, w.world_size, w.local_rank));
    let device = candle_core::Device::new_cuda(local)
        .with_context(|| format!("rank {rank}: cannot open cuda:{local}"))?;
    let mut tcp = match &world {
        Some(w) if w.world_size > 1 => {
            let opts = GroupOptions {
                timeout: Duration::from_secs(a.timeout),
                config_hash: [7; 32],
            };
            Some(TcpGroup::connect(
                w.rank,
                w.world_size,
                &format!("{}:{}", w.master_addr, w.port),
                &opts,
            )?)
        }
        _ => None,
    };
    let mut solo = Solo;
    let bootstrap: &mut dyn Collective = match tcp.as_mut() {
        Some(t) => t,
        None => &mut solo,
    };
    let t = Instant::now();
    let mut group = NcclGroup::new(&device, rank, size, bootstrap)?;
    println!(
        "nccl-check rank={rank} world={size} gpu={local} nccl={} init_ms={:.0}",
        NcclGroup::nccl_version()?,
        t.elapsed().as_secs_f64() * 1e3
    );

    // The exact sum, computed locally from every rank's leaf.
    let mut leaves: Vec<Vec<f32>> = (0..size).map(|r| leaf(r, a.len)).collect();
    let mine = leaves[rank].clone();
    tree_sum_in_place(&mut leaves);
    let want = std::mem::take(&mut leaves[0]);
    drop(leaves);

    let mut exact = mine.clone();
    let t = Instant::now();
    group.all_reduce_sum(&mut exact)?;
    let exact_ms = t.elapsed().as_secs_f64() * 1e3;
    ensure!(
        same_bits(&exact, &want),
        "exact all-reduce differs from the pairwise tree"
    );
    if let Some(tcp) = tcp.as_mut() {
        let mut over_tcp = mine.clone();
        tcp.all_reduce_sum(&mut over_tcp)?;
        ensure!(
            same_bits(&exact, &over_tcp),
            "exact all-reduce differs from the TCP backend's"
        );
    }

    // The step's form: a flat tensor on the GPU, summed there.
    let on_gpu = candle_core::Tensor::from_slice(&mine, a.len, &device)?;
    let t = Instant::now();
    let summed = group.all_reduce_sum_tensor(&on_gpu, false)?;
    let device_exact: Vec<f32> = summed.to_vec1()?;
    let device_exact_ms = t.elapsed().as_secs_f64() * 1e3;
    ensure!(
        same_bits(&device_exact, &want),
        "exact all-reduce of a GPU tensor differs from the pairwise tree"
    );
    let t = Instant::now();
    let device_fast: Vec<f32> = group.all_reduce_sum_tensor(&on_gpu, true)?.to_vec1()?;
    let device_fast_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(on_gpu);

    let shares = even_shares(a.len, size);
    let part = group.reduce_scatter_sum(&mine, &shares)?;
    ensure!(
        same_bits(&part, &want[shares[rank].clone()]),
        "reduce-scatter differs from the exact sum's share"
    );

    let mut fast = mine.clone();
    let t = Instant::now();
    group.all_reduce_sum_fast(&mut fast)?;
    let fast_ms = t.elapsed().as_secs_f64() * 1e3;
    let worst = fast
        .iter()
        .zip(&want)
        .map(|(f, w)| (f - w).abs() / (1.0 + w.abs()))
        .fold(0f32, f32::max);
    ensure!(worst <= 1e-5, "fast all-reduce is off by {worst:e}");
    let worst_device = device_fast
        .iter()
        .zip(&want)
        .map(|(f, w)| (f - w).abs() / (1.0 + w.abs()))
        .fold(0f32, f32::max);
    ensure!(
        device_fast.len() == want.len() && worst_device <= 1e-5,
        "fast all-reduce of a GPU tensor is off by {worst_device:e}"
    );

    let gathered = group.all_gather(&leaf(rank, rank + 3))?;
    for (r, g) in gathered.iter().enumerate() {
        ensure!(
            same_bits(g, &leaf(r, r + 3)),
            "all-gather: rank {r}'s part differs"
        );
    }
    let message = format!("xdistill nccl-check from rank 0 of {size}").into_bytes();
    let mut got = if rank == 0 {
        message.clone()
    } else {
        Vec::new()
    };
    group.broadcast(&mut got)?;
    if got != message {
        bail!("broadcast: got {:?}", String::from_utf8_lossy(&got));
    }
    group.barrier()?;
    println!(
        "nccl-check rank={rank} ok len={} exact_all_reduce_ms={exact_ms:.1} fast_all_reduce_ms={fast_ms:.1} device_exact_ms={device_exact_ms:.1} device_fast_ms={device_fast_ms:.1} fast_bits_equal={} fast_max_rel_err={worst:e}",
        a.len,
        same_bits(&fast, &want)
    );
    Ok(())
}
