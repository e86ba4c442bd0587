//! Times the teacher's forward pass alone — `Decoder::forward_hidden` of one `[1, T]`
//! sequence, no LM head — on a model directory, called as the worker calls it (from a thread of
//! rayon's pool) and from outside the pool (where each parallel op is injected into the pool
//! and waited for), in alternating rounds.
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p xdistill-server --example forward_speed -- MODEL_DIR [T]`
use anyhow::Context;
use candle_core::Tensor;
use std::time::Instant;
use xdistill_shared::model::{Decoder, KvCache};

/// Forwards per round.
const REPS: usize = 20;
const ROUNDS: usize = 5;

/// Milliseconds per forward of `ids` over a fresh cache, `REPS` times.
fn round(dec: &Decoder, ids: &Tensor, t: usize) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    for _ in 0..REPS {
        let mut cache = KvCache::for_sequence(t + 1);
        dec.forward_hidden(ids, Some(&mut cache), None, None)?;
    }
    Ok(t0.elapsed().as_secs_f64() * 1e3 / REPS as f64)
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().context("usage: forward_speed MODEL_DIR [T]")?;
    let t: usize = args.next().map_or(Ok(127), |s| s.parse())?;
    let (dec, facts) = xdistill_server::model::load(std::path::Path::new(&dir), "cpu", "f32")?;
    let vocab = facts.vocab_size as u32;
    let ids: Vec<u32> = (0..t as u32)
        .map(|i| i.wrapping_mul(7919) % vocab)
        .collect();
    let ids = Tensor::new(ids.as_slice(), dec.device())?.unsqueeze(0)?;
    round(&dec, &ids, t)?; // warm-up
    let (mut inside, mut outside) = (vec![], vec![]);
    for _ in 0..ROUNDS {
        inside.push(rayon::scope(|_| round(&dec, &ids, t))?);
        outside.push(round(&dec, &ids, t)?);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "forward [1, {t}] on {} rayon threads: {:.3} ms from a pool thread, {:.3} ms from outside \
         (medians of {ROUNDS} rounds of {REPS})",
        rayon::current_num_threads(),
        median(&mut inside),
        median(&mut outside)
    );
    Ok(())
}
