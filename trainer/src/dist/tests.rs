//! The TCP group on loopback, one thread per rank, against the tree sum computed directly.

use super::tree::tree_sum_in_place;
use super::*;
use std::net::TcpListener;
use std::time::{Duration, Instant};

fn opts(timeout_ms: u64) -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_millis(timeout_ms),
        config_hash: [7; 32],
    }
}

/// Runs `f(group)` on `world` ranks, rank 0 on a listener bound to a free port.
fn run_world<R: Send + 'static>(
    world: usize,
    f: impl Fn(&mut TcpGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let f = std::sync::Arc::new(f);
    let mut handles = Vec::new();
    {
        let f = f.clone();
        handles.push(std::thread::spawn(move || {
            let mut g = TcpGroup::accept(listener, world, &opts(10_000)).unwrap();
            f(&mut g)
        }));
    }
    for rank in 1..world {
        let (f, addr) = (f.clone(), addr.clone());
        handles.push(std::thread::spawn(move || {
            let mut g = TcpGroup::connect(rank, world, &addr, &opts(10_000)).unwrap();
            f(&mut g)
        }));
    }
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Rank `r`'s buffer: values of mixed magnitude, so that the order of additions shows.
fn data(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i * 7919 + rank * 104729) % 1000) as f32 / 999.0 - 0.5;
            x * 10f32.powi(((i + rank) % 7) as i32 - 3)
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn all_reduce_is_the_tree_sum_on_every_rank() {
    for world in [2, 3, 4] {
        let n = 1000;
        let got = run_world(world, move |g| {
            let mut b = data(g.rank(), n);
            g.all_reduce_sum(&mut b).unwrap();
            g.barrier().unwrap();
            b
        });
        let mut parts: Vec<Vec<f32>> = (0..world).map(|r| data(r, n)).collect();
        tree_sum_in_place(&mut parts);
        for (rank, b) in got.iter().enumerate() {
            assert_eq!(bits(b), bits(&parts[0]), "world {world}, rank {rank}");
        }
        // f64 reference: it is the sum.
        for (i, y) in parts[0].iter().enumerate() {
            let exact: f64 = (0..world).map(|r| data(r, n)[i] as f64).sum();
            assert!((*y as f64 - exact).abs() <= 1e-6 * (1.0 + exact.abs()));
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_share_of_the_sum() {
    let (world, n) = (4, 103);
    let got = run_world(world, move |g| {
        let shares = even_shares(n, g.world_size());
        let mine = g.reduce_scatter_sum(&data(g.rank(), n), &shares).unwrap();
        // ZeRO-1's last step: every rank gets every share back.
        let all = g.all_gather(&mine).unwrap();
        (mine, all.concat())
    });
    let mut parts: Vec<Vec<f32>> = (0..world).map(|r| data(r, n)).collect();
    tree_sum_in_place(&mut parts);
    let shares = even_shares(n, world);
    assert_eq!(
        shares.iter().map(|r| r.len()).collect::<Vec<_>>(),
        [26, 26, 26, 25]
    );
    for (rank, (mine, all)) in got.iter().enumerate() {
        assert_eq!(
            bits(mine),
            bits(&parts[0][shares[rank].clone()]),
            "rank {rank}"
        );
        assert_eq!(bits(all), bits(&parts[0]), "rank {rank}");
    }
}

#[test]
fn broadcast_and_gather_carry_rank_zeros_bytes_and_every_rank_in_order() {
    let got = run_world(3, |g| {
        let mut b = if g.rank() == 0 {
            b"nccl-id-bytes".to_vec()
        } else {
            Vec::new()
        };
        g.broadcast(&mut b).unwrap();
        let all = g.all_gather(&[g.rank() as f32; 2]).unwrap();
        (b, all)
    });
    for (b, all) in got {
        assert_eq!(b, b"nccl-id-bytes");
        assert_eq!(all, vec![vec![0.0; 2], vec![1.0; 2], vec![2.0; 2]]);
    }
}

#[test]
fn a_rank_with_another_config_is_refused_by_name() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let zero = std::thread::spawn(move || TcpGroup::accept(listener, 2, &opts(5_000)).err());
    let mut other = opts(5_000);
    other.config_hash = [8; 32];
    let one = TcpGroup::connect(1, 2, &addr, &other)
        .err()
        .unwrap()
        .to_string();
    let zero = zero.join().unwrap().unwrap().to_string();
    assert!(zero.contains("rank 1's config differs"), "{zero}");
    assert!(
        one.contains("rank 0 refused rank 1") && one.contains("config differs"),
        "{one}"
    );
}

#[test]
fn a_rank_that_never_arrives_is_named_after_the_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let t = Instant::now();
    let zero = std::thread::spawn(move || TcpGroup::accept(listener, 3, &opts(600)).err());
    let _one = TcpGroup::connect(1, 3, &addr, &opts(600));
    let e = zero.join().unwrap().unwrap().to_string();
    assert!(e.contains("rank(s) 2 of 3 never arrived"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // And a rank whose rank 0 never listens gives up after its timeout, naming the address.
    let free = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let e = TcpGroup::connect(1, 2, &free, &opts(300))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("could not reach rank 0 at") && e.contains(&free),
        "{e}"
    );
}

#[test]
fn a_dead_rank_stops_every_rank_quickly() {
    // Rank 2 leaves after one collective; the others fail at the next one, long before the
    // 10 s collective timeout.
    let t = Instant::now();
    let got = run_world(3, |g| {
        let mut b = vec![1.0f32; 8];
        g.all_reduce_sum(&mut b).unwrap();
        if g.rank() == 2 {
            return None;
        }
        g.all_reduce_sum(&mut b).err().map(|e| e.to_string())
    });
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(
        got[0].as_deref().unwrap().contains("rank 2 is gone"),
        "{got:?}"
    );
    // Rank 1 learns of it from rank 0, which stopped.
    assert!(
        got[1].as_deref().unwrap().contains("rank 0 is gone"),
        "{got:?}"
    );
}

#[test]
fn a_hung_rank_fails_the_others_at_the_collective_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let zero = std::thread::spawn(move || {
        let mut g = TcpGroup::accept(listener, 2, &opts(400)).unwrap();
        let t = Instant::now();
        let e = g.all_reduce_sum(&mut [1.0]).err().unwrap().to_string();
        (e, t.elapsed())
    });
    let g1 = TcpGroup::connect(1, 2, &addr, &opts(400)).unwrap();
    let (e, waited) = zero.join().unwrap();
    drop(g1);
    assert!(
        e.contains("rank 1 did not answer within the collective timeout"),
        "{e}"
    );
    assert!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

#[test]
fn ranks_in_different_collectives_fail_instead_of_mixing_buffers() {
    let got = run_world(2, |g| {
        if g.rank() == 0 {
            g.all_reduce_sum(&mut [1.0, 2.0])
                .err()
                .map(|e| e.to_string())
        } else {
            g.all_gather(&[1.0, 2.0]).err().map(|e| e.to_string())
        }
    });
    assert!(
        got[0].as_deref().unwrap().contains("ranks diverged"),
        "{got:?}"
    );
    assert!(got[1].is_some(), "{got:?}");
}

#[test]
fn solo_is_the_identity() {
    let mut s = Solo;
    let mut b = data(0, 5);
    s.all_reduce_sum(&mut b).unwrap();
    assert_eq!(b, data(0, 5));
    assert_eq!(s.reduce_scatter_sum(&b, &even_shares(5, 1)).unwrap(), b);
    assert!(s.reduce_scatter_sum(&b, &even_shares(5, 2)).is_err());
    assert_eq!(s.all_gather(&b).unwrap(), vec![b.clone()]);
}
