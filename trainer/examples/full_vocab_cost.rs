//! The student-side extra work of exact full-vocabulary distillation from the teacher's hidden
//! states (issue 32): the teacher's head + log-softmax (`teacher_log_softmax_chunk`) and the
//! whole forward-KL loss (`full_vocab_divergence`, forward + backward), per position, on a random
//! head of the given shape. Prints one JSON line (times are medians over `--repeats`; peak RSS
//! from `/proc/self/status`, reset after the inputs are made and between the two measurements).
//! `--device cuda` (a build with the `cuda` feature) times it on the GPU, the device synchronised
//! before each clock read; the RSS figures are then the host's only.
//!
//! `cargo run --release -p xdistill-trainer --example full_vocab_cost -- --hidden 1024 --vocab 151669 --rows 151936`
//!
//! `bench/full_vocab.py` runs it next to the same computation in PyTorch.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use xdistill_trainer::loss::full_vocab::{
    full_vocab_divergence, teacher_log_softmax_chunk, TeacherHead,
};
use xdistill_trainer::loss::{Divergence, Temperature};

#[derive(Parser)]
struct Args {
    /// H, the teacher's hidden size.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Real tokens (columns of the distributions).
    #[arg(long, default_value_t = 151_669)]
    vocab: usize,
    /// Rows of the head (≥ vocab; padding rows are never computed). Default: `vocab`.
    #[arg(long)]
    rows: Option<usize>,
    /// Positions per measurement.
    #[arg(long, default_value_t = 256)]
    positions: usize,
    /// Positions per chunk.
    #[arg(long, default_value_t = 64)]
    chunk: usize,
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Element type of the head and the hidden states: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Skip the whole-loss (forward + backward) measurement.
    #[arg(long)]
    no_loss: bool,
    /// cpu, or cuda (GPU 0; needs a build with the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// Resident set size now and at its peak, in bytes (Linux; 0 elsewhere).
fn rss() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the peak RSS (`VmHWM`) to the current RSS (Linux ≥ 4.0; a no-op elsewhere).
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Wall-clock seconds of each of `repeats` calls of `f` after one warm-up, the device
/// synchronised before the clock starts and before it is read (GPU work is asynchronous).
fn timed(dev: &Device, repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    f()?; // warm-up
    let mut out = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        dev.synchronize()?;
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        out.push(t0.elapsed().as_secs_f64());
    }
    Ok(out)
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> Result<()> {
    let a = Args::parse();
    let dev = match a.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        other => anyhow::bail!("--device cpu or cuda, got {other}"),
    };
    let rows = a.rows.unwrap_or(a.vocab);
    let (h, v, n) = (a.hidden, a.vocab, a.positions);
    let dt = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => anyhow::bail!("--dtype f32 or bf16, got {other}"),
    };
    let (rss0, _) = rss();
    // Scaled like a trained head: logits of standard deviation ≈ 2.
    let w =
        (Tensor::randn(0f32, 1.0, (rows, h), &dev)? * (2.0 / (h as f64).sqrt()))?.to_dtype(dt)?;
    let head = TeacherHead::new(w, None, 1.0, None, v)?;
    let hidden = Tensor::randn(0f32, 1.0, (n, h), &dev)?.to_dtype(dt)?;
    let (rss_inputs, _) = rss();
    reset_peak(); // making the inputs had its own transient peak

    // 1. The teacher's log-probs, chunk by chunk (what the student must add per position).
    let head_times = timed(&dev, a.repeats, || {
        let mut r0 = 0;
        while r0 < n {
            let m = a.chunk.min(n - r0);
            let lp = teacher_log_softmax_chunk(&head, &hidden.narrow(0, r0, m)?, Temperature::ONE)?;
            debug_assert_eq!(lp.dims(), [m, v]);
            r0 += m;
        }
        Ok(())
    })?;
    let (_, peak_head) = rss();
    reset_peak();

    // 2. The whole exact forward-KL loss, forward + backward w.r.t. the student logits.
    let mut loss_times = Vec::new();
    if !a.no_loss {
        let student = Var::from_tensor(&Tensor::randn(0f32, 2.0, (n, v), &dev)?)?;
        let mask = Tensor::ones(n, DType::F32, &dev)?;
        loss_times = timed(&dev, a.repeats, || {
            let (loss, _m) = full_vocab_divergence(
                student.as_tensor(),
                &head,
                &hidden,
                &mask,
                Divergence::Forward,
                Temperature::ONE,
                a.chunk,
                None,
            )?;
            let grads = loss.backward()?;
            let g = grads
                .get(student.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no gradient"))?;
            debug_assert_eq!(g.dims(), [n, v]);
            Ok(())
        })?;
    }
    let (_, peak_loss) = rss();

    let per_pos_ms = |t: &[f64]| median(t.to_vec()) * 1e3 / n as f64;
    let gflop = 2.0 * (h * v) as f64 / 1e9;
    let head_ms = per_pos_ms(&head_times);
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "{}",
        serde_json::json!({
            "impl": "rust-candle",
            "hidden": h, "vocab": v, "rows": rows, "positions": n, "chunk": a.chunk,
            "device": a.device, "dtype": a.dtype, "repeats": a.repeats,
            "threads": std::thread::available_parallelism().map_or(1, |p| p.get()),
            "head_logsoftmax_ms_per_pos": head_ms,
            "head_logsoftmax_ms_samples": head_times.iter().map(|t| t * 1e3).collect::<Vec<_>>(),
            "head_gflop_per_pos": gflop,
            "head_gflops": gflop / (head_ms / 1e3),
            "loss_fwd_bwd_ms_per_pos": if loss_times.is_empty() { None } else { Some(per_pos_ms(&loss_times)) },
            "rss_base_mb": mb(rss0),
            "inputs_mb": mb(rss_inputs.saturating_sub(rss0)),
            "peak_head_over_inputs_mb": mb(peak_head.saturating_sub(rss_inputs)),
            "peak_loss_over_inputs_mb": if loss_times.is_empty() { None } else { Some(mb(peak_loss.saturating_sub(rss_inputs))) },
            "peak_rss_mb": mb(peak_head.max(peak_loss)),
        })
    );
    Ok(())
}
