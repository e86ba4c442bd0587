//! Student training-step benchmark on the CPU, next to PyTorch eager on the same model and batch.
//!
//! Makes a random student with a real vocabulary (`init-model`), a deterministic batch with
//! plausible teacher top-k log-probs, and times our full step — forward, forward KL over the
//! top-k with a tail bucket + 0.1·CE, backward, gradient-norm clipping at 1.0, AdamW — then runs
//! `bench/torch_step.py` on the same model directory and batch (written as safetensors) with the
//! same thread count, and prints both medians, the ratio and the first step's loss of each.
//!
//! ```text
//! cargo run --release -p xdistill-trainer --example step_bench -- \
//!     --tokenizer qwen3 --hidden 256 --layers 4 --batch 4 --len 128 --threads 2 \
//!     --python .venv/bin/python
//! ```
//! Set `RAYON_NUM_THREADS` to `--threads` (the example checks it). `--python ''` skips PyTorch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xdistill_shared::protocol::SequenceScores;
use xdistill_trainer::collate::Encoded;
use xdistill_trainer::init_model;
use xdistill_trainer::loss::{CeConfig, KdConfig, LossConfig, TailMode};
use xdistill_trainer::optim::ScheduleConfig;
use xdistill_trainer::optim::{clip_grad_norm, AdamWConfig, GradAccumulator, OptimConfig};
use xdistill_trainer::student::Student;
use xdistill_trainer::train::prepare::Item;
use xdistill_trainer::train::runner::Runner;
use xdistill_trainer::train::step::{micro_loss, units, LossCtx, Pairing};

#[derive(Parser)]
struct Args {
    /// Tokenizer name under the shared tokenizers directory (qwen3, llama2, ...) or a path.
    #[arg(long, default_value = "qwen3")]
    tokenizer: String,
    #[arg(long, default_value = "qwen3", value_parser = ["qwen3", "qwen2", "llama"])]
    arch: String,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Default 3 × hidden.
    #[arg(long)]
    intermediate: Option<usize>,
    #[arg(long)]
    tie_embeddings: bool,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    len: usize,
    /// Teacher top-k.
    #[arg(long, default_value_t = 64)]
    k: usize,
    /// Timed steps per round (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rounds, ours and PyTorch alternating (medians over all timed steps).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Threads for both sides (RAYON_NUM_THREADS must say the same; torch.set_num_threads).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Python with torch + transformers + safetensors; empty: skip the PyTorch side.
    #[arg(long, default_value = ".venv/bin/python")]
    python: String,
    /// Init std of the weight matrices: large enough that the logits are far from uniform, so
    /// the loss comparison exercises the whole model (the timing does not depend on it).
    #[arg(long, default_value_t = 0.1)]
    init_std: f64,
    /// Where the model directory and the batch are written.
    #[arg(long, default_value = "target/step-bench")]
    work_dir: PathBuf,
}

/// The batch both implementations train on.
struct Batch {
    items: Vec<Item>,
    scores: Vec<SequenceScores>,
}

/// `n` sequences of `len` random ids (all positions after the first trained), and teacher top-k
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
    candle_core::safetensors::save(&t, path)?;
    Ok(())
}

/// Seconds of each phase of one step.
#[derive(Default, Clone, Copy)]
struct Phases {
    forward: f64,
    backward: f64,
    accumulate: f64,
    clip: f64,
    adamw: f64,
}

impl Phases {
    fn total(&self) -> f64 {
        self.forward + self.backward + self.accumulate + self.clip + self.adamw
    }
}

/// One full training step as the off-policy loop runs it; returns the loss and phase times.
fn step(runner: &mut Runner, batch: &Batch, k: usize, cfg: &LossConfig) -> Result<(f64, Phases)> {
    let mut ph = Phases::default();
    let scores: Vec<&SequenceScores> = batch.scores.iter().collect();
    let norm = units(&batch.items);
    let t = Instant::now();
    let ctx = LossCtx {
        model: runner.student.model(),
        k,
        loss: cfg,
        pairing: Pairing::Same,
        device: &Device::Cpu,
        micro_batch: batch.items.len(),
    };
    let (loss, _) = micro_loss(&ctx, &batch.items, &scores, norm)?;
    let loss_v = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    ph.forward = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let grads = loss.backward()?;
    ph.backward = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut acc = GradAccumulator::new(runner.vars().to_vec());
    acc.add(&grads)?;
    drop(grads);
    let mut grads = acc.take();
    ph.accumulate = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let vars = runner.vars().to_vec();
    clip_grad_norm(&mut grads, &vars, runner.optim.max_grad_norm)?;
    ph.clip = t.elapsed().as_secs_f64();
    let t = Instant::now();
    runner.opt.step(&grads)?;
    runner.student.refresh()?;
    runner.step += 1;
    ph.adamw = t.elapsed().as_secs_f64();
    Ok((loss_v, ph))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
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

fn main() -> Result<()> {
    let a = Args::parse();
    match std::env::var("RAYON_NUM_THREADS") {
        Ok(v) if v == a.threads.to_string() => {}
        _ => eprintln!(
            "warning: RAYON_NUM_THREADS is not {} (the matmuls may use another thread count)",
            a.threads
        ),
    }
    let tok = {
        let p = PathBuf::from(&a.tokenizer);
        if p.exists() {
            p
        } else {
            xdistill_shared::paths::tokenizer_json(&a.tokenizer)
        }
    };
    // 1. Model directory.
    std::fs::create_dir_all(&a.work_dir)?;
    let model_dir = a.work_dir.join(format!(
        "{}-{}-h{}-l{}",
        a.arch, a.tokenizer, a.hidden, a.layers
    ));
    let margs = init_model::Args {
        arch: a.arch.clone(),
        tokenizer: tok,
        hidden_size: a.hidden,
        layers: a.layers,
        heads: a.heads,
        kv_heads: a.kv_heads,
        intermediate_size: a.intermediate.unwrap_or(3 * a.hidden),
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: a.len.max(2048),
        tie_embeddings: a.tie_embeddings,
        init_std: a.init_std,
        seed: 0,
        out: model_dir.clone(),
        features: Default::default(),
    };
    init_model::run(margs)?;
    let student = Student::load(&model_dir, &Device::Cpu, DType::F32)?;
    let vocab = student.config.vocab_size;
    let params = student.num_parameters();
    // 2. Batch (also for the Python side).
    let batch = make_batch(a.batch, a.len, a.k, vocab, 1);
    let batch_path = a.work_dir.join("batch.safetensors");
    write_batch(&batch, a.len, a.k, &batch_path)?;
    let cfg = LossConfig {
        kd: KdConfig::ForwardKl {},
        tail: Some(TailMode::Bucket),
        temperature: 1.0,
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
    let tokens = a.batch * a.len;
    println!(
        "student {} {}: hidden {}, {} layers, vocab {vocab}, {:.1}M parameters; batch {}x{} \
         ({} trained positions), k {}, {} threads",
        a.arch,
        a.tokenizer,
        a.hidden,
        a.layers,
        params as f64 / 1e6,
        a.batch,
        a.len,
        units(&batch.items).kd,
        a.k,
        a.threads
    );
    // 3. Rounds: ours (a fresh student each round, one warm-up step), then PyTorch.
    let mut ours: Vec<Phases> = vec![];
    let mut torch: Vec<f64> = vec![];
    let mut first_loss = None;
    let mut torch_first = None;
    // Loss of the last step of the first round: after `steps` updates on both sides it checks
    // the gradients, the clipping and AdamW too.
    let mut last_loss = None;
    let mut torch_last = None;
    for round in 0..a.rounds {
        let student = Student::load(&model_dir, &Device::Cpu, DType::F32)?;
        let mut runner = Runner::new(student, optim.clone(), 1_000_000)?;
        let (l0, _) = step(&mut runner, &batch, a.k, &cfg)?;
        first_loss.get_or_insert(l0);
        let mut times = vec![];
        for _ in 0..a.steps {
            let (l, ph) = step(&mut runner, &batch, a.k, &cfg)?;
            times.push(ph.total());
            ours.push(ph);
            if round == 0 {
                last_loss = Some(l);
            }
        }
        println!("round {round}: ours median {:.3} s", median(times.clone()));
        drop(runner);
        if !a.python.is_empty() {
            let out = Command::new(&a.python)
                .arg(xdistill_shared::paths::repo_root().join("bench/torch_step.py"))
                .arg(&model_dir)
                .arg(&batch_path)
                .arg(a.steps.to_string())
                .arg(a.threads.to_string())
                .output()
                .with_context(|| format!("running {}", a.python))?;
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
            let ts: Vec<f64> = v["step_s"]
                .as_array()
                .context("torch_step.py: no step_s")?
                .iter()
                .filter_map(|x| x.as_f64())
                .collect();
            println!("round {round}: pytorch median {:.3} s", median(ts.clone()));
            torch.extend(ts);
            torch_first.get_or_insert(v["first_loss"].as_f64().unwrap_or(f64::NAN));
            torch_last.get_or_insert(v["last_loss"].as_f64().unwrap_or(f64::NAN));
        }
    }
    // 4. Report.
    let med = |f: fn(&Phases) -> f64| median(ours.iter().map(f).collect());
    let ours_med = med(Phases::total);
    println!(
        "\nours (median of {} steps): {:.3} s/step, {:.0} tokens/s",
        ours.len(),
        ours_med,
        tokens as f64 / ours_med
    );
    println!(
        "  forward+loss {:.3}  backward {:.3}  accumulate {:.3}  clip {:.3}  adamw {:.3}",
        med(|p| p.forward),
        med(|p| p.backward),
        med(|p| p.accumulate),
        med(|p| p.clip),
        med(|p| p.adamw)
    );
    let (l0, l1) = (
        first_loss.unwrap_or(f64::NAN),
        last_loss.unwrap_or(f64::NAN),
    );
    println!("  loss: first step {l0:.9}, step {} {l1:.9}", a.steps + 1);
    if !torch.is_empty() {
        let t = median(torch.clone());
        println!(
            "pytorch eager (median of {} steps): {:.3} s/step, {:.0} tokens/s",
            torch.len(),
            t,
            tokens as f64 / t
        );
        let (t0, t1) = (
            torch_first.unwrap_or(f64::NAN),
            torch_last.unwrap_or(f64::NAN),
        );
        println!("  loss: first step {t0:.9}, step {} {t1:.9}", a.steps + 1);
        println!(
            "ratio ours/pytorch: {:.2} (goal <= 1.5); loss differences: first step {:.2e}, \
             step {} {:.2e}",
            ours_med / t,
            (l0 - t0).abs(),
            a.steps + 1,
            (l1 - t1).abs()
        );
    }
    Ok(())
}
