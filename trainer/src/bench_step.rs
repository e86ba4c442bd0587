//! `trainer bench-step`: the time of one full student training step (forward, top-k forward KL
//! with a tail bucket + 0.1 × cross-entropy, backward, gradient clipping, AdamW on the f32 masters,
//! refresh of the compute copy) on a synthetic batch. Prints figures; not a test.
//!
//! `--write-batch` saves the batch so `bench/torch_step.py` runs the same step in PyTorch.

use crate::loss::{cross_entropy, kl::Divergence, topk_divergence, TailMode, TopkTargets};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig};
use crate::student::Student;
use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Student model directory (Hugging Face layout).
    #[arg(long)]
    pub model: PathBuf,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype: f32, bf16 or f16 (master weights stay f32).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    #[arg(long, default_value_t = 512)]
    pub seq_len: usize,
    /// Teacher top-k per position.
    #[arg(long, default_value_t = 64)]
    pub k: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the batch (ids, targets, mask, teacher_ids, teacher_logprobs) as safetensors.
    #[arg(long)]
    pub write_batch: Option<PathBuf>,
}

/// A synthetic batch: random tokens, and per position k distinct teacher ids holding 90 % of the
/// mass in log-probs (the rest is the tail).
struct Batch {
    ids: Vec<u32>,
    targets: Vec<u32>,
    teacher_ids: Vec<u32>,
    teacher_logprobs: Vec<f32>,
}

fn make_batch(a: &Args, vocab: usize) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(a.seed);
    let n = a.batch * a.seq_len;
    let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let (mut teacher_ids, mut teacher_logprobs) = (Vec::with_capacity(n * a.k), Vec::new());
    for _ in 0..n {
        // k ids from a random start with the prime stride 7919: distinct unless 7919 divides
        // the vocabulary size.
        let base = rng.random_range(0..vocab);
        let row: Vec<u32> = (0..a.k)
            .map(|j| ((base + j * 7919) % vocab) as u32)
            .collect();
        let x: Vec<f64> = (0..a.k).map(|_| rng.random_range(-3.0..3.0)).collect();
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        teacher_ids.extend(row);
        teacher_logprobs.extend(x.iter().map(|v| (v - lse + 0.9f64.ln()) as f32));
    }
    Batch {
        ids,
        targets,
        teacher_ids,
        teacher_logprobs,
    }
}

/// Runs the benchmark and prints `bench-step device=.. dtype=.. median_ms=..`.
pub fn run(a: Args) -> Result<()> {
    let device = xdistill_shared::device::parse_device(&a.device)?;
    let dtype = xdistill_shared::device::parse_dtype(&a.dtype)?;
    anyhow::ensure!(a.batch > 0 && a.seq_len > 1 && a.k > 0, "empty batch");
    let mut student = Student::load(&a.model, &device, dtype)?;
    let vocab = student.config.vocab_size;
    anyhow::ensure!(a.k <= vocab, "k {} exceeds the vocabulary {vocab}", a.k);
    let b = make_batch(&a, vocab);
    let (bs, t, k) = (a.batch, a.seq_len, a.k);
    if let Some(path) = &a.write_batch {
        let long = |v: &[u32], shape: &[usize]| -> Result<Tensor> {
            Ok(Tensor::from_vec(
                v.iter().map(|&x| x as i64).collect::<Vec<_>>(),
                shape,
                &candle_core::Device::Cpu,
            )?)
        };
        let mut m = HashMap::new();
        m.insert("ids".to_string(), long(&b.ids, &[bs, t])?);
        m.insert("targets".to_string(), long(&b.targets, &[bs, t])?);
        m.insert(
            "mask".to_string(),
            Tensor::ones((bs, t), DType::F32, &candle_core::Device::Cpu)?,
        );
        m.insert(
            "teacher_ids".to_string(),
            long(&b.teacher_ids, &[bs, t, k])?,
        );
        m.insert(
            "teacher_logprobs".to_string(),
            Tensor::from_vec(
                b.teacher_logprobs.clone(),
                (bs, t, k),
                &candle_core::Device::Cpu,
            )?,
        );
        candle_core::safetensors::save(&m, path)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let mask = vec![1f32; bs * t];
    let tk = TopkTargets::from_host(
        bs,
        t,
        k,
        &b.teacher_ids,
        &b.teacher_logprobs,
        &mask,
        vocab,
        &device,
    )?;
    let ids = Tensor::from_vec(b.ids.clone(), (bs, t), &device)?;
    let targets = Tensor::from_vec(b.targets.clone(), (bs, t), &device)?;
    let mask_t = Tensor::ones((bs, t), DType::F32, &device)?;
    let mut opt = AdamW::from_varmap(
        &student.varmap,
        AdamWConfig {
            lr: 1e-4,
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    let vars = opt.vars();
    let mut times = Vec::with_capacity(a.steps);
    let mut last_loss = f64::NAN;
    for step in 0..=a.steps {
        let t0 = Instant::now();
        let logits = student.model().forward(&ids)?; // [B, T, V]
        let (kd, _) = topk_divergence(
            &logits,
            &tk,
            Divergence::Forward,
            TailMode::Bucket,
            1.0,
            None,
        )?;
        let (ce, _) = cross_entropy(&logits, &targets, &mask_t, None)?;
        let loss = (kd + (ce * 0.1)?)?;
        let mut grads = loss.backward()?;
        clip_grad_norm(&mut grads, &vars, 1.0)?;
        opt.step(&grads)?;
        student.refresh()?;
        // Reading the loss waits for the device.
        last_loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        device.synchronize()?;
        if step > 0 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let min = times.first().copied().unwrap_or(f64::NAN);
    println!(
        "bench-step device={} dtype={} params={} batch={bs} seq_len={t} k={k} steps={} \
         median_ms={median:.2} min_ms={min:.2} tokens_per_s={:.0} loss={last_loss:.4}",
        a.device,
        a.dtype,
        student.num_parameters(),
        a.steps,
        (bs * t) as f64 / (median / 1e3)
    );
    Ok(())
}
