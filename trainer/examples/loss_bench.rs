//! Prints the time of one forward + backward of each loss on synthetic inputs of a realistic
//! shape (CPU unless built with `--features cuda` and `--device cuda`).
//!
//! `cargo run -p xdistill-trainer --example loss_bench -- --batch 2 --len 256 --vocab 32768`

use std::time::Instant;

use anyhow::Result;
use candle_core::{Tensor, Var};
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xdistill_trainer::loss::{
    alm_loss, cross_entropy, gold_loss, pkl_loss, topk_divergence, Anchor, Divergence, Projection,
    TailMode, Temperature, TopkTargets, XTokenBatch,
};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 256)]
    len: usize,
    #[arg(long, default_value_t = 32768)]
    vocab: usize,
    #[arg(long, default_value_t = 64)]
    k: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Only the losses whose name contains this (e.g. `pkl`), for one loss's time and peak
    /// memory under `/usr/bin/time`.
    #[arg(long)]
    only: Option<String>,
}

fn time(name: &str, a: &Args, mut f: impl FnMut() -> Result<Tensor>) -> Result<()> {
    if a.only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
        return Ok(());
    }
    let repeats = a.repeats;
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let t0 = Instant::now();
        let loss = f()?;
        let grads = loss.backward()?;
        drop(grads);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    println!(
        "{name:<28} {:>9.1} ms (best of {repeats}, forward + backward)",
        best * 1e3
    );
    Ok(())
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> Result<()> {
    let a = Args::parse();
    let dev = xdistill_shared::device::parse_device(&a.device)?;
    let (b, t, v, k) = (a.batch, a.len, a.vocab, a.k);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let logits = Var::from_tensor(&Tensor::randn(0f32, 2.0, (b, t, v), &dev)?)?;
    let z = logits.as_tensor();
    println!("B={b} T={t} V={v} k={k} on {dev:?}");

    // Same tokenizer.
    let ids: Vec<u32> = (0..b * t * k)
        .map(|_| rng.random_range(0..v as u32))
        .collect();
    let lps: Vec<f32> = (0..b * t * k)
        .map(|i| -1.0 - (i % k) as f32 * 0.1)
        .collect();
    let mask = vec![1f32; b * t];
    let tg = TopkTargets::from_host(b, t, k, &ids, &lps, &mask, v, &dev)?;
    for tail in [TailMode::Renormalize, TailMode::Bucket] {
        time(&format!("forward_kl {tail:?}"), &a, || {
            Ok(topk_divergence(z, &tg, Divergence::Forward, tail, Temperature::ONE, None)?.0)
        })?;
    }
    time("jsd(0.5) Bucket", &a, || {
        Ok(topk_divergence(
            z,
            &tg,
            Divergence::Jsd { beta: 0.5 },
            TailMode::Bucket,
            Temperature::ONE,
            None,
        )?
        .0)
    })?;
    let y = Tensor::from_vec(
        (0..b * t)
            .map(|_| rng.random_range(0..v as u32))
            .collect::<Vec<_>>(),
        (b, t),
        &dev,
    )?;
    time("cross_entropy", &a, || {
        Ok(cross_entropy(z, &y, &tg.mask, None)?.0)
    })?;

    // Cross tokenizer: same vocabulary size, 1–4 entries per projection row, chunks of 1–2
    // positions per side.
    let (mut indptr, mut indices, mut weights) = (vec![0], vec![], vec![]);
    for s in 0..v {
        let n = if s % 3 == 0 {
            1
        } else {
            1 + rng.random_range(0..4usize)
        };
        let raw: Vec<f32> = (0..n).map(|i| 0.9 * 0.1f32.powi(i as i32)).collect();
        let sum: f32 = raw.iter().sum();
        for (i, w) in raw.iter().enumerate() {
            indices.push(if i == 0 {
                s as u32
            } else {
                rng.random_range(0..v as u32)
            });
            weights.push(w / sum);
        }
        indptr.push(indices.len());
    }
    let proj = Projection::from_csr(v, v, &indptr, &indices, &weights)?;
    let (mut sc, mut tc, mut nc) = (vec![], vec![], vec![]);
    for _ in 0..b {
        let (mut c, mut pos_s, mut pos_t) = (0i64, 0, 0);
        let mut row_s = vec![-1i64; t];
        let mut row_t = vec![-1i64; t];
        while pos_s < t && pos_t < t {
            let (ns, nt) = (rng.random_range(1..=2usize), rng.random_range(1..=2usize));
            row_s[pos_s..(pos_s + ns).min(t)].fill(c);
            row_t[pos_t..(pos_t + nt).min(t)].fill(c);
            pos_s += ns;
            pos_t += nt;
            c += 1;
        }
        sc.extend(row_s);
        tc.extend(row_t);
        nc.push(c as usize);
    }
    let x = XTokenBatch {
        batch: b,
        student_len: t,
        teacher_len: t,
        k,
        student_chunk: sc,
        teacher_chunk: tc,
        num_chunks: nc,
        student_targets: y.flatten_all()?.to_vec1()?,
        teacher_targets: y.flatten_all()?.to_vec1()?,
        teacher_topk_ids: ids.clone(),
        teacher_topk_logprobs: lps.clone(),
        teacher_target_logprobs: (0..b * t).map(|_| -rng.random_range(0.0..3.0f32)).collect(),
    };
    time("pkl (anchor first, tail bucket)", &a, || {
        Ok(pkl_loss(
            z,
            &x,
            &proj,
            Anchor::First,
            TailMode::Bucket,
            Temperature::ONE,
            None,
        )?
        .0)
    })?;
    time("gold", &a, || {
        Ok(gold_loss(z, &x, &proj, 1.0, 1.0, Temperature::ONE, None)?.0)
    })?;
    time("alm (tau 100)", &a, || {
        Ok(alm_loss(z, &x, 100.0, Temperature::ONE, None)?.0)
    })?;
    Ok(())
}
