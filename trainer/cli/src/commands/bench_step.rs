//! `trainer bench-step`: the time of one full student training step as the training loop runs
//! it — `micro_grads` (decoder training forward, kept or checkpointed as
//! `--activation-checkpointing` says; LM head in row chunks on the trained rows, forward KL over
//! the teacher's top-k with a tail bucket + 0.1 × cross-entropy, each chunk's backward; the
//! decoder's backward), gradient accumulation, then the training loop's own update
//! (`Runner::apply`: global gradient-norm clipping at 1.0, AdamW on the f32 masters, lr 1e-4,
//! weight decay 0.01 on every tensor as `torch.optim.AdamW` does, and the compute copies
//! written) — on a synthetic batch. Prints figures; not a test.
//!
//! `--write-batch` saves the batch so `bench/torch_step.py` runs the same step in PyTorch;
//! `--python` runs it in the same invocation (rounds alternating with ours, so that both see the
//! same load) and compares the times and the losses.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use xdistill_shared::protocol::SequenceScores;
use xdistill_trainer::collate::Encoded;
use xdistill_trainer::config::ActivationCheckpointing;
use xdistill_trainer::loss::{CeConfig, KdConfig, LossConfig, TailMode, Temperature};
use xdistill_trainer::optim::{AdamWConfig, GradAccumulator, OptimConfig, ScheduleConfig};
use xdistill_trainer::student::Student;
use xdistill_trainer::train::head_chunks::HeadOpts;
use xdistill_trainer::train::pairing::{units, Item, LossCtx, Pairing};
use xdistill_trainer::train::phases::{self, StepPhases};
use xdistill_trainer::train::runner::Runner;
use xdistill_trainer::train::step::micro_grads;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Student model directory (Hugging Face layout; `trainer init-model` makes random ones).
    #[arg(long)]
    pub model: PathBuf,
    /// auto (the first GPU where this binary has CUDA and the machine a GPU, else the CPU;
    /// resolved when parsed), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = crate::commands::device_arg)]
    pub device: String,
    /// Compute dtype: auto (bf16 on a GPU, f32 on the CPU), f32, bf16 or f16 (master weights
    /// stay f32).
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 512)]
    pub seq_len: usize,
    /// Teacher top-k per position.
    #[arg(long, default_value_t = 64)]
    pub k: usize,
    /// Timed steps per round (after one warm-up step).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Rounds, each from the initial weights (ours and PyTorch alternating with `--python`);
    /// the medians are over every timed step of every round.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the batch (ids, targets, mask, teacher_ids, teacher_logprobs) as safetensors.
    #[arg(long)]
    pub write_batch: Option<PathBuf>,
    /// Python with torch + transformers + safetensors: also run `bench/torch_step.py` on the
    /// same model and batch each round, and compare.
    #[arg(long)]
    pub python: Option<String>,
    /// PyTorch's thread count with `--python` (default: $RAYON_NUM_THREADS, else every core).
    /// Set RAYON_NUM_THREADS to the same for ours.
    #[arg(long)]
    pub threads: Option<usize>,
    /// auto, on, selective or off: keep only each layer's input and recompute layers in the
    /// backward, or keep all but the attention core (`policy.activation_checkpointing`).
    #[arg(long, default_value = "auto", value_parser = ActivationCheckpointing::parse)]
    pub activation_checkpointing: ActivationCheckpointing,
    /// Rows per LM-head chunk; 0: as many as fit 256 MiB of f32 logits.
    #[arg(long, default_value_t = 0)]
    pub head_chunk_rows: usize,
    /// First check one micro-batch's loss and gradients on the device against the CPU's in f32
    /// (the composed ops), the same weights, a batch of at most 2 × 128 tokens and LM-head
    /// chunks of 97 rows (several per batch): fails where the two disagree by more than the
    /// compute dtype explains.
    #[arg(long)]
    pub check_cpu: bool,
    /// CUDA: keep the dims and strides candle uploads for each non-contiguous operand on the
    /// device after their first use, instead of a copy from pageable host memory per launch
    /// (an experiment on what those copies cost; the cache only grows).
    #[arg(long)]
    pub param_cache: bool,
    /// CUDA: mark the timed steps as the CUDA profiler's range (cuProfilerStart/Stop): what
    /// `ncu --profile-from-start off` profiles and bench/cuda_calls.c counts driver calls in.
    /// Off by default: under a profiler that starts with the process, the stop would end its
    /// collection before the steps timed phase by phase.
    #[arg(long)]
    pub profiler_range: bool,
}

/// The batch both implementations train on.
struct Batch {
    items: Vec<Item>,
    scores: Vec<SequenceScores>,
}

/// `b` sequences of `len` random ids (all positions after the first trained), and teacher top-k
/// rows: k distinct ids (the true next token among them half the time) with Zipf-like
/// log-probs whose mass in K is 0.80–0.97.
fn make_batch(b: usize, len: usize, k: usize, vocab: usize, seed: u64) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut items = Vec::with_capacity(b);
    let mut scores = Vec::with_capacity(b);
    for _ in 0..b {
        let ids: Vec<u32> = (0..len)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let rows = len - 1;
        let mut topk_ids = Vec::with_capacity(rows * k);
        let mut topk_values = Vec::with_capacity(rows * k);
        for p in 0..rows {
            let mut row: Vec<u32> = Vec::with_capacity(k);
            if rng.random::<f64>() < 0.5 {
                row.push(ids[p + 1]);
            }
            while row.len() < k {
                let c = rng.random_range(0..vocab as u32);
                if !row.contains(&c) {
                    row.push(c);
                }
            }
            let alpha = 0.8 + rng.random::<f64>();
            let w: Vec<f64> = (0..k).map(|i| 1.0 / ((i + 1) as f64).powf(alpha)).collect();
            let mass = 0.80 + 0.17 * rng.random::<f64>();
            let s: f64 = w.iter().sum();
            topk_ids.extend_from_slice(&row);
            topk_values.extend(w.iter().map(|x| (x / s * mass).ln() as f32));
        }
        items.push(Item::Same(Encoded { ids, loss_from: 1 }));
        scores.push(SequenceScores {
            rows,
            k,
            topk_ids,
            topk_values,
            target_logprobs: vec![0.0; rows],
            logsumexp: vec![0.0; rows],
            ..Default::default()
        });
    }
    Batch { items, scores }
}

/// Writes the batch as `[B, T]` / `[B, T, k]` tensors for `bench/torch_step.py` (the last
/// position of each row is masked and gets uniform teacher rows).
fn write_batch(batch: &Batch, len: usize, k: usize, path: &Path) -> Result<()> {
    let b = batch.items.len();
    let (mut ids, mut targets, mut mask) = (vec![], vec![], vec![]);
    let (mut tids, mut tlps) = (vec![0i64; b * len * k], vec![-(k as f32).ln(); b * len * k]);
    for (r, (it, s)) in batch.items.iter().zip(&batch.scores).enumerate() {
        let Item::Same(e) = it else {
            bail!("same-tokenizer items only")
        };
        for p in 0..len {
            ids.push(e.ids[p] as i64);
            targets.push(if p + 1 < len { e.ids[p + 1] as i64 } else { 0 });
            mask.push(if p + 1 < len { 1f32 } else { 0.0 });
        }
        for p in 0..s.rows {
            let dst = (r * len + p) * k;
            for j in 0..k {
                tids[dst + j] = s.ids_row(p)[j] as i64;
                tlps[dst + j] = s.values_row(p)[j];
            }
        }
    }
    let dev = Device::Cpu;
    let t: HashMap<String, Tensor> = [
        ("ids", Tensor::from_vec(ids, (b, len), &dev)?),
        ("targets", Tensor::from_vec(targets, (b, len), &dev)?),
        ("mask", Tensor::from_vec(mask, (b, len), &dev)?),
        ("teacher_ids", Tensor::from_vec(tids, (b, len, k), &dev)?),
        (
            "teacher_logprobs",
            Tensor::from_vec(tlps, (b, len, k), &dev)?,
        ),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    candle_core::safetensors::save(&t, path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One micro-batch's loss terms and each parameter's gradient (f32, by name) on `device`.
struct Grads {
    kd: f64,
    ce: f64,
    by_name: HashMap<String, Vec<f32>>,
}

/// [`Grads`] of `batch` for the student in `a.model`, loaded on `device` in `dtype`.
fn grads_on(
    a: &Args,
    cfg: &LossConfig,
    batch: &Batch,
    device: &Device,
    dtype: candle_core::DType,
) -> Result<Grads> {
    let student = Student::load(&a.model, device, dtype)?;
    let ctx = LossCtx {
        model: student.model(),
        k: a.k,
        loss: cfg,
        pairing: Pairing::Same,
        device,
        micro_batch: batch.items.len(),
        head: HeadOpts {
            activations: a.activation_checkpointing,
            chunk_rows: CHECK_CHUNK_ROWS,
        },
    };
    let scores: Vec<&SequenceScores> = batch.scores.iter().collect();
    let (grads, m) = micro_grads(&ctx, &batch.items, &scores, units(&batch.items), None)?;
    let named = student.named_vars();
    let masters: Vec<_> = named.iter().map(|(_, v)| v.clone()).collect();
    let mut by_name = HashMap::new();
    for ((name, _), key) in named.iter().zip(student.grad_keys(&masters)) {
        if let Some(g) = grads.get(&key) {
            let g = g
                .to_dtype(candle_core::DType::F32)?
                .to_device(&Device::Cpu)?;
            by_name.insert(name.clone(), g.flatten_all()?.to_vec1()?);
        }
    }
    Ok(Grads {
        kd: m.kd.loss * m.kd_scale,
        ce: m.ce.unwrap_or(f64::NAN),
        by_name,
    })
}

/// Rows per LM-head chunk in [`check_cpu`]: several chunks in its batch.
const CHECK_CHUNK_ROWS: usize = 97;

/// `--check-cpu`: one micro-batch's loss terms and gradients on `device` in `dtype` against the
/// CPU's in f32, the same weights and batch. Passes where the loss terms agree to 2 % and every
/// gradient points the same way (cosine ≥ 0.99 over all parameters, ≥ 0.95 for each tensor:
/// the bounds of the CPU's bf16-against-f32 test, `bf16_compute_trains_the_f32_masters`).
fn check_cpu(
    a: &Args,
    cfg: &LossConfig,
    vocab: usize,
    device: &Device,
    dtype: candle_core::DType,
) -> Result<()> {
    let (b, t) = (a.batch.min(2), a.seq_len.min(128));
    let batch = make_batch(b, t, a.k, vocab, a.seed ^ 0x5eed);
    let here = grads_on(a, cfg, &batch, device, dtype)?;
    let cpu = grads_on(a, cfg, &batch, &Device::Cpu, candle_core::DType::F32)?;
    let rel = |x: f64, y: f64| (x - y).abs() / y.abs().max(1e-12);
    let (e_kd, e_ce) = (rel(here.kd, cpu.kd), rel(here.ce, cpu.ce));
    let (mut dot, mut n_here, mut n_cpu) = (0f64, 0f64, 0f64);
    let mut worst: Vec<(f64, f64, &str)> = Vec::new(); // (cosine, relative error, name)
    for (name, want) in &cpu.by_name {
        let got = here
            .by_name
            .get(name)
            .with_context(|| format!("no gradient for {name} on {}", a.device))?;
        let (mut d, mut ng, mut nw, mut diff) = (0f64, 0f64, 0f64, 0f64);
        for (&g, &w) in got.iter().zip(want) {
            let (g, w) = (g as f64, w as f64);
            d += g * w;
            ng += g * g;
            nw += w * w;
            diff += (g - w) * (g - w);
        }
        dot += d;
        n_here += ng;
        n_cpu += nw;
        let cos = d / (ng.sqrt() * nw.sqrt()).max(1e-300);
        worst.push((cos, (diff / nw.max(1e-300)).sqrt(), name));
    }
    worst.sort_by(|x, y| x.0.total_cmp(&y.0));
    let overall = dot / (n_here.sqrt() * n_cpu.sqrt()).max(1e-300);
    println!(
        "check-cpu ({b} x {t} tokens, head chunks of {CHECK_CHUNK_ROWS} rows, {} tensors): \
         kd {:.6} vs {:.6} (rel {e_kd:.2e}), ce {:.6} vs {:.6} (rel {e_ce:.2e}), \
         gradient cosine {overall:.5} overall",
        cpu.by_name.len(),
        here.kd,
        cpu.kd,
        here.ce,
        cpu.ce
    );
    for (cos, e, name) in worst.iter().take(3) {
        println!("  worst: {name} cosine {cos:.5}, relative error {e:.2e}");
    }
    let worst_cos = worst.first().map_or(1.0, |w| w.0);
    if !(e_kd < 0.02 && e_ce < 0.02 && overall >= 0.99 && worst_cos >= 0.95) {
        bail!(
            "{} {dtype:?} disagrees with the CPU in f32: kd {e_kd:.2e}, ce {e_ce:.2e}, cosine \
             {overall:.5} overall, {worst_cos:.5} at worst",
            a.device
        );
    }
    Ok(())
}

/// What one step runs on.
struct StepSetup<'a> {
    batch: &'a Batch,
    k: usize,
    cfg: &'a LossConfig,
    device: &'a Device,
    head: HeadOpts,
}

/// One full training step as the training loop runs it (its micro-batch's gradients, then
/// `Runner::apply`: the global norm, the update with the clipping factor inside it); returns the
/// loss, the step's seconds (the device synchronised once, at its end) and, when `phased`, each
/// phase's seconds (the device synchronised after each phase, which the step's seconds then
/// include: a training step never waits between its phases, so the headline figure comes from
/// unphased steps).
fn step(runner: &mut Runner, s: &StepSetup, phased: bool) -> Result<(f64, f64, StepPhases)> {
    let (batch, device) = (s.batch, s.device);
    let start = Instant::now();
    let scores: Vec<&SequenceScores> = batch.scores.iter().collect();
    let norm = units(&batch.items);
    if phased {
        phases::start();
    }
    let ctx = LossCtx {
        model: runner.student.model(),
        k: s.k,
        loss: s.cfg,
        pairing: Pairing::Same,
        device,
        micro_batch: batch.items.len(),
        head: s.head,
    };
    // As the training loop: each layer's gradients taken by the accumulator as the backward
    // leaves it (inside the backward phase), the rest (embedding, head) after it.
    let vars = runner.vars().to_vec();
    let keys = runner.student.grad_keys(&vars);
    let mut acc = GradAccumulator::with_keys(vars, keys);
    let (grads, m) = micro_grads(&ctx, &batch.items, &scores, norm, Some(&mut acc))?;
    // The whole micro-batch is the step: the loss is kd_scale·KD + 0.1·CE (its mean).
    let loss_v = m.kd.loss * m.kd_scale + 0.1 * m.ce.unwrap_or(0.0);
    let grads = phases::time(phases::Phase::Accumulate, device, || {
        acc.add(&grads)?;
        drop(grads);
        Ok(acc.finish()?)
    })?;
    let update = runner.apply(grads)?;
    anyhow::ensure!(
        update.applied,
        "the step's gradient norm is {}: no update",
        update.grad_norm
    );
    device.synchronize()?;
    let ph = phases::take();
    Ok((loss_v, start.elapsed().as_secs_f64(), ph))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// What `bench/torch_step.py` reported for one round.
struct TorchRound {
    step_s: Vec<f64>,
    first_loss: f64,
    last_loss: f64,
}

fn torch_round(python: &str, a: &Args, batch_path: &Path, threads: usize) -> Result<TorchRound> {
    let script = xdistill_shared::paths::repo_root().join("bench/torch_step.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(&a.model)
        .arg(batch_path)
        .arg(a.steps.to_string())
        .arg(threads.to_string())
        .arg(&a.device)
        .arg(&a.dtype)
        .output()
        .with_context(|| format!("running {python} {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "bench/torch_step.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON line from bench/torch_step.py")?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let step_s = v["step_s"]
        .as_array()
        .context("torch_step.py: no step_s")?
        .iter()
        .filter_map(|x| x.as_f64())
        .collect();
    Ok(TorchRound {
        step_s,
        first_loss: v["first_loss"].as_f64().unwrap_or(f64::NAN),
        last_loss: v["last_loss"].as_f64().unwrap_or(f64::NAN),
    })
}

/// Runs the benchmark and prints `bench-step device=.. dtype=.. median_ms=..`, the phases, and
/// with `--python` PyTorch's figures and the ratio.
pub fn run(a: Args) -> Result<()> {
    let device = xdistill_shared::device::parse_device(&a.device)?;
    let dtype = xdistill_shared::device::dtype_for(&a.dtype, &device)?;
    anyhow::ensure!(
        a.batch > 0 && a.seq_len > 1 && a.k > 0 && a.rounds > 0,
        "empty batch"
    );
    let student = Student::load(&a.model, &device, dtype)?;
    let vocab = student.config.vocab_size;
    let params = student.num_parameters();
    anyhow::ensure!(a.k <= vocab, "k {} exceeds the vocabulary {vocab}", a.k);
    drop(student);
    let (bs, t, k) = (a.batch, a.seq_len, a.k);
    let batch = make_batch(bs, t, k, vocab, a.seed);
    // PyTorch reads the batch from a file: the one asked for, else a temporary one.
    let tmp_batch = match (&a.write_batch, &a.python) {
        (None, Some(_)) => Some(tempfile_path()?),
        _ => None,
    };
    let batch_path = a.write_batch.clone().or_else(|| tmp_batch.clone());
    if let Some(path) = &batch_path {
        write_batch(&batch, t, k, path)?;
    }
    let cfg = LossConfig {
        kd: KdConfig::ForwardKl {},
        tail: Some(TailMode::Bucket),
        temperature: Temperature::ONE,
        kd_weight: 1.0,
        ce: CeConfig::Weight { weight: 0.1 },
    };
    let optim = OptimConfig {
        adamw: AdamWConfig {
            lr: 1e-4,
            weight_decay: 0.01,
            decay_1d: true, // torch.optim.AdamW decays every parameter
            ..AdamWConfig::default()
        },
        schedule: ScheduleConfig::Constant { warmup_steps: 0 },
        max_grad_norm: 1.0,
    };
    if a.check_cpu {
        check_cpu(&a, &cfg, vocab, &device, dtype)?;
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(rayon::current_num_threads)
    });
    let (mut ours, mut torch) = (Vec::<f64>::new(), Vec::<f64>::new());
    let mut phased = Vec::<StepPhases>::new();
    // The most bytes the timed steps' allocations held at once (a GPU's memory pool).
    let mut peak: Option<u64> = None;
    // The process's resident memory (VmRSS, MiB) after round 0's warm-up step and after its
    // timed steps: whether the host memory grows with the steps (Linux; None elsewhere).
    let mut resident: Option<(f64, f64)> = None;
    let rss = || xdistill_shared::process::status_mib("self", "VmRSS").ok();
    let (mut first_loss, mut last_loss) = (None, None);
    let (mut torch_first, mut torch_last) = (None, None);
    let setup = StepSetup {
        batch: &batch,
        k,
        cfg: &cfg,
        device: &device,
        head: HeadOpts {
            activations: a.activation_checkpointing,
            chunk_rows: a.head_chunk_rows,
        },
    };
    #[cfg(feature = "cuda")]
    let _params = a
        .param_cache
        .then(|| xdistill_shared::device::cache_launch_params(&device))
        .flatten();
    #[cfg(not(feature = "cuda"))]
    anyhow::ensure!(!a.param_cache, "--param-cache needs a CUDA build");
    let (mut activations, mut layers) = (None, "autograd");
    for round in 0..a.rounds {
        let student = Student::load(&a.model, &device, dtype)?;
        let act = a.activation_checkpointing.resolve(student.model(), bs, t);
        activations.get_or_insert(act);
        if student.model().train_plan(act).1 {
            layers = "by-hand";
        }
        let mut runner = Runner::new(student, optim.clone(), 1_000_000)?;
        let (l0, _, _) = step(&mut runner, &setup, false)?; // warm-up
        first_loss.get_or_insert(l0);
        let rss_warm = rss();
        let mut times = vec![];
        xdistill_shared::device::reset_allocated_peak(&device);
        // With --profiler-range the timed steps are the CUDA profiler's range.
        let range = a
            .profiler_range
            .then(|| xdistill_shared::device::profiler_range(&device))
            .flatten();
        for _ in 0..a.steps {
            let (l, seconds, _) = step(&mut runner, &setup, false)?;
            times.push(seconds);
            if round == 0 {
                last_loss = Some(l);
            }
        }
        if range.is_some() {
            drop(range); // each step ends waiting for its work: the range holds it all
            eprintln!(
                "  cuda profiler range: the {} timed steps of round {round}",
                a.steps
            );
        }
        ours.extend(&times);
        if round == 0 {
            resident = rss_warm.zip(rss());
        }
        if let Some(p) = xdistill_shared::device::allocated_peak(&device) {
            peak = Some(peak.unwrap_or(0).max(p));
        }
        // The breakdown from a few more steps, each phase waited for.
        for _ in 0..a.steps.clamp(1, PHASED_STEPS) {
            phased.push(step(&mut runner, &setup, true)?.2);
        }
        drop(runner);
        if let (Some(python), Some(path)) = (&a.python, &batch_path) {
            println!("round {round}: ours median {:.3} s", median(times));
            let r = torch_round(python, &a, path, threads)?;
            println!(
                "round {round}: pytorch median {:.3} s",
                median(r.step_s.clone())
            );
            torch.extend(r.step_s);
            torch_first.get_or_insert(r.first_loss);
            torch_last.get_or_insert(r.last_loss);
        }
    }
    if let Some(p) = &tmp_batch {
        let _ = std::fs::remove_file(p);
    }
    let med = |f: fn(&StepPhases) -> f64| median(phased.iter().map(f).collect());
    let ours_s = median(ours.clone());
    let min_s = ours.iter().copied().fold(f64::INFINITY, f64::min);
    let last = last_loss.unwrap_or(f64::NAN);
    println!(
        "bench-step device={} dtype={} params={params} batch={bs} seq_len={t} k={k} steps={} \
         median_ms={:.2} min_ms={:.2} tokens_per_s={:.0} loss={last:.4} activations={} layers={layers} \
         param_cache={}",
        a.device,
        a.dtype,
        ours.len(),
        ours_s * 1e3,
        min_s * 1e3,
        (bs * t) as f64 / ours_s,
        activations.map_or("none", |x| x.name()),
        if a.param_cache { "on" } else { "off" }
    );
    if let Some(p) = peak {
        println!(
            "  peak allocated: {:.1} MiB (the memory pool's high watermark over the timed steps, \
             as PyTorch's max_memory_allocated)",
            p as f64 / (1u64 << 20) as f64
        );
    }
    if let Some((warm, end)) = resident {
        println!(
            "  host resident: {warm:.0} MiB after the warm-up step, {end:.0} MiB after the {} \
             timed steps (VmRSS, round 0)",
            a.steps
        );
    }
    println!(
        "  phases (median s of {} steps waiting after each phase; sum {:.3}): forward {:.3}  \
         head+loss {:.3}  backward {:.3}  accumulate {:.3}  clip {:.3}  optimizer {:.3}",
        phased.len(),
        med(StepPhases::total),
        med(|p| p.forward),
        med(|p| p.head_loss),
        med(|p| p.backward),
        med(|p| p.accumulate),
        med(|p| p.clip),
        med(|p| p.optimizer)
    );
    let first = first_loss.unwrap_or(f64::NAN);
    println!(
        "  loss: first step {first:.9}, step {} {last:.9}",
        a.steps + 1
    );
    if !torch.is_empty() {
        let ts = median(torch.clone());
        let (t0, t1) = (
            torch_first.unwrap_or(f64::NAN),
            torch_last.unwrap_or(f64::NAN),
        );
        println!(
            "pytorch eager (median of {} steps, {threads} threads): {ts:.3} s/step, {:.0} \
             tokens/s",
            torch.len(),
            (bs * t) as f64 / ts
        );
        println!("  loss: first step {t0:.9}, step {} {t1:.9}", a.steps + 1);
        println!(
            "ratio ours/pytorch: {:.2}; loss differences: first step {:.2e}, step {} {:.2e}",
            ours_s / ts,
            (first - t0).abs(),
            a.steps + 1,
            (last - t1).abs()
        );
    }
    Ok(())
}

/// Steps timed phase by phase after the timed ones (at most).
const PHASED_STEPS: usize = 3;

/// A fresh path for the batch file in the temporary directory.
fn tempfile_path() -> Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    Ok(std::env::temp_dir().join(format!(
        "xdistill-bench-step-{}-{nanos}.safetensors",
        std::process::id()
    )))
}
