//! `trainer sft`: plain next-token training on prompt + completion data (loss on the completion
//! and the EOS that ends it), used to build a teacher and as the baseline distillation is
//! compared with.
//!
//! Same configuration file as `trainer off-policy` (`[teacher]` and `[loss]` are ignored: the
//! loss is the student's cross-entropy). Per step: `num_prompts_per_step` records are encoded
//! exactly as evaluation and the distillation trainers encode them (one joint encoding with the
//! tokenizer's special tokens, the completion boundary found from byte offsets), the model
//! config's EOS is appended as the last target, and micro-batches of `train_micro_batch_size`
//! accumulate gradients normalised by the whole step's target count. Validation reports held-out
//! cross-entropy (`[distillation] val_*`) and, with `--eval-prompts`, greedy task accuracy.
//! Checkpoints record the data position after the last trained batch, so `--resume` is exact.

use super::runner::{optim_config, Runner};
use crate::checkpoint::{self, Ranking, TrainerState};
use crate::collate::{encode, pad_batch, Encoded};
use crate::config::{Config, OffPolicyArgs};
use crate::data::{self, BatchOptions, Batcher, Record};
use crate::eval::{self, EvalConfig, EvalRecord};
use crate::loss::cross_entropy;
use crate::metrics_log::{unix_time, MetricsLog, Progress, StepMetrics, ValMetrics};
use crate::optim::GradAccumulator;
use crate::student::Student;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use tokenizers::Tokenizer;
use xdistill_shared::model::Decoder;

/// Placeholder teacher URL: the shared config validation asks for one, SFT never calls it.
const UNUSED_TEACHER_URL: &str = "http://sft-uses-no-teacher.invalid";

/// `trainer sft`: flags override the config file.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SftArgs {
    /// TOML configuration file (the off-policy format; `[teacher]` and `[loss]` are ignored).
    #[arg(long)]
    pub config: PathBuf,
    /// Model directory to train (replaces `policy.model_name`).
    #[arg(long)]
    pub student: Option<PathBuf>,
    /// Training data file (replaces `data.train_path`).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Output directory (replaces `checkpointing.checkpoint_dir`).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Replaces `distillation.max_num_steps`.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Continue from the newest checkpoint in the output directory.
    #[arg(long)]
    pub resume: bool,
    /// Set any key: `--set policy.optimizer.lr=3e-3` (TOML value syntax).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Prompts file (JSONL with `prompt` and `answer`) for periodic greedy task accuracy.
    #[arg(long)]
    pub eval_prompts: Option<PathBuf>,
    /// Task accuracy every this many steps (0: only at the start and the end).
    #[arg(long, default_value_t = 0)]
    pub eval_period: u64,
    /// Evaluate on the first N prompts only.
    #[arg(long)]
    pub eval_limit: Option<usize>,
    #[arg(long, default_value_t = 64)]
    pub eval_max_new_tokens: usize,
}

impl SftArgs {
    /// The shared loader's arguments (with a placeholder teacher URL, which SFT never uses).
    fn as_off_policy(&self) -> OffPolicyArgs {
        OffPolicyArgs {
            config: self.config.clone(),
            teacher_url: vec![UNUSED_TEACHER_URL.into()],
            student: self.student.clone(),
            data: self.data.clone(),
            output: self.output.clone(),
            max_steps: self.max_steps,
            resume: self.resume,
            set: self.set.clone(),
        }
    }

    /// Reads and validates the configuration.
    pub fn load_config(&self) -> Result<Config> {
        Ok(Config::load(&self.as_off_policy())?)
    }

    /// The task-accuracy settings, when `--eval-prompts` is given.
    pub fn task_eval(&self) -> Result<Option<TaskEval>> {
        let Some(path) = &self.eval_prompts else {
            return Ok(None);
        };
        Ok(Some(TaskEval {
            records: eval::load_records(path, self.eval_limit)?,
            period: self.eval_period,
            config: EvalConfig {
                max_new_tokens: self.eval_max_new_tokens,
                samples: 0,
                progress: false,
                ..Default::default()
            },
        }))
    }
}

/// Periodic greedy task accuracy during training.
#[derive(Debug, Clone)]
pub struct TaskEval {
    pub records: Vec<EvalRecord>,
    /// Every this many steps (0: start and end only).
    pub period: u64,
    pub config: EvalConfig,
}

/// A task-accuracy line in `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AccuracyMetrics {
    /// `"eval"`.
    pub split: String,
    pub step: u64,
    pub accuracy: f64,
    pub marker_rate: f64,
    pub eos_rate: f64,
    pub records: u64,
    pub time: f64,
}

/// What a finished run reports (printed as one JSON line).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub seconds: f64,
    pub val_ce_start: Option<f64>,
    pub val_ce_end: Option<f64>,
    pub accuracy_start: Option<f64>,
    pub accuracy_end: Option<f64>,
    pub skipped_records: u64,
    pub final_dir: String,
}

/// Encodes one record for SFT: the joint encoding of prompt + completion, completion-only
/// targets when the record asks for it, and `eos` appended (unless the tokenizer already ended
/// the sequence with it). Errors when the result is longer than `max_len`.
pub fn encode_record(
    tok: &Tokenizer,
    r: &Record,
    eos: Option<u32>,
    max_len: usize,
) -> Result<Encoded> {
    let mut e = encode(tok, &r.text(), r.loss_start_byte(), usize::MAX)?;
    if let Some(eos) = eos {
        if e.ids.last() != Some(&eos) {
            e.ids.push(eos);
        }
    }
    if e.ids.len() > max_len {
        bail!(
            "{} tokens exceed policy.max_total_sequence_length = {max_len}",
            e.ids.len()
        );
    }
    Ok(e)
}

/// The SFT loss of one micro-batch: cross-entropy over the masked (completion) targets, divided
/// by `normalizer` (the step's target count). Returns the loss and the micro-batch's target count.
///
/// Only the trained positions go through the LM head (hidden states gathered first): with a
/// large vocabulary the head dominates the step, and prompt and padding positions need none.
pub fn sft_loss(
    model: &Decoder,
    examples: &[Encoded],
    normalizer: f64,
    device: &Device,
) -> Result<(Tensor, f64)> {
    let tb = pad_batch(examples, 0, device)?;
    let (b, t) = tb.ids.dims2()?;
    // Flat indices of trained positions and their targets, as pad_batch masks them.
    let (mut rows, mut targets) = (Vec::new(), Vec::new());
    for (r, e) in examples.iter().enumerate() {
        for p in e.loss_from.max(1) - 1..e.ids.len().saturating_sub(1) {
            rows.push((r * t + p) as u32);
            targets.push(e.ids[p + 1]);
        }
    }
    if rows.is_empty() {
        bail!("a micro-batch has no completion tokens to train on");
    }
    let n = rows.len();
    let hidden = model.forward_hidden(&tb.ids, None, None, None)?; // [B, T, H]
    let h = hidden.dim(2)?;
    let picked = hidden
        .reshape((b * t, h))?
        .index_select(&Tensor::from_vec(rows, n, device)?, 0)?; // [N, H]
    let logits = model.logits(&picked)?.unsqueeze(0)?; // [1, N, V]
    let targets = Tensor::from_vec(targets, (1, n), device)?;
    let mask = Tensor::ones((1, n), DType::F32, device)?;
    let (loss, count) = cross_entropy(&logits, &targets, &mask, Some(normalizer))?;
    Ok((loss, count))
}

/// Number of trained targets of an encoded example (as [`pad_batch`] masks them).
fn targets_of(e: &Encoded) -> usize {
    e.ids.len().saturating_sub(e.loss_from.max(1))
}

/// Held-out mean cross-entropy over `val` (already encoded), no gradients kept.
fn validation_ce(model: &Decoder, val: &[Encoded], mb: usize, device: &Device) -> Result<f64> {
    let (mut sum, mut n) = (0.0, 0.0);
    for chunk in val.chunks(mb.max(1)) {
        let (loss, k) = sft_loss(model, chunk, 1.0, device)?;
        // With normalizer 1 the loss is the sum of the chunk's NLL.
        sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        n += k;
    }
    Ok(sum / n.max(1.0))
}

/// `trainer sft`.
pub fn run(args: SftArgs) -> Result<()> {
    let cfg = args.load_config()?;
    let task = args.task_eval()?;
    let summary = train(&cfg, task.as_ref(), args.resume, None)?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

/// Encodes records, skipping (and counting) the ones that cannot be used.
fn encode_all(
    tok: &Tokenizer,
    records: &[Record],
    eos: Option<u32>,
    max_len: usize,
) -> (Vec<Encoded>, u64) {
    let mut out = Vec::with_capacity(records.len());
    let mut skipped = 0;
    for r in records {
        match encode_record(tok, r, eos, max_len) {
            Ok(e) if targets_of(&e) > 0 => out.push(e),
            Ok(_) => {
                tracing::warn!("record at line {} skipped: no completion tokens", r.line);
                skipped += 1;
            }
            Err(e) => {
                tracing::warn!("record at line {} skipped: {e}", r.line);
                skipped += 1;
            }
        }
    }
    (out, skipped)
}

/// The SFT loop (also used by tests and the demo). `stop_after`: end after that step as an
/// interruption would (no final model), for resume tests.
pub fn train(
    cfg: &Config,
    task: Option<&TaskEval>,
    resume: bool,
    stop_after: Option<u64>,
) -> Result<Summary> {
    let out = &cfg.checkpointing.checkpoint_dir;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let t_start = Instant::now();
    let device = xdistill_shared::device::parse_device(&cfg.policy.device)?;
    let dtype = xdistill_shared::device::parse_dtype(&cfg.policy.precision)?;
    // 1. Data and the student.
    let (mut train_set, val_set) = data::load_train_val(&cfg.data, cfg.distillation.seed)?;
    let mut val_records = val_set.records;
    if let Some(n) = cfg.distillation.max_val_samples {
        val_records.truncate(n);
    }
    let student = Student::load(&cfg.policy.model_name, &device, dtype)?;
    let tok = xdistill_shared::hf::load_tokenizer(&cfg.student_tokenizer())?;
    let eos = student.config.eos_ids().first().copied();
    if eos.is_none() {
        tracing::warn!("the model config names no eos_token_id: the model will not learn to stop");
    }
    let max_len = cfg.policy.max_total_sequence_length;
    // Over-long records are skipped and counted before the first step; none left is an error.
    let before = train_set.records.len();
    train_set.drop_where(&|r: &Record| {
        encode_record(&tok, r, eos, usize::MAX).is_ok_and(|e| e.ids.len() > max_len)
    });
    if train_set.records.is_empty() {
        bail!(
            "{}: nothing to train on: all {before} training records are longer than \
             policy.max_total_sequence_length = {max_len} tokens and were skipped ({})",
            cfg.data.train_path.display(),
            train_set.skipped
        );
    }
    let mut skipped = train_set.skipped.total();
    let (val, _) = encode_all(&tok, &val_records, eos, max_len);
    let steps_per_epoch = {
        let n = train_set.records.len();
        let b = cfg.distillation.num_prompts_per_step;
        if cfg.data.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    } as u64;
    if steps_per_epoch == 0 {
        bail!(
            "no training batch: {} records for num_prompts_per_step = {}",
            train_set.records.len(),
            cfg.distillation.num_prompts_per_step
        );
    }
    let total_steps = cfg
        .distillation
        .max_num_steps
        .min(steps_per_epoch * cfg.distillation.max_num_epochs);
    let mut runner = Runner::new(student, optim_config(&cfg.policy.optimizer), total_steps)?;
    runner.max_nonfinite_steps = cfg.policy.max_nonfinite_steps;
    let mut batcher = Batcher::new(train_set.records, BatchOptions::from_config(cfg));
    let rng = ChaCha8Rng::seed_from_u64(cfg.distillation.seed);
    let hash = cfg.training_hash();
    let mut tokens_seen = 0u64;
    // 2. Resume from the newest complete checkpoint.
    let mut resumed_from = None;
    if resume {
        checkpoint::remove_temp_dirs(out)?;
        if let Some((step, path)) = checkpoint::latest(out)? {
            let ck = checkpoint::load(&path, &device)?;
            if ck.state.config_hash != hash {
                tracing::warn!("resuming {} with a changed config: the result will differ from an uninterrupted run", path.display());
            }
            runner.restore(&ck)?;
            batcher.seek(ck.state.data)?;
            tokens_seen = ck.state.tokens_seen;
            tracing::info!("resumed from {} (step {step})", path.display());
            resumed_from = Some(step);
        } else {
            tracing::info!(
                "--resume: no checkpoint in {}, starting fresh",
                out.display()
            );
        }
    }
    let mut log = MetricsLog::open(out, resumed_from)?;
    let progress = Progress::new(
        total_steps,
        runner.step,
        cfg.logger.progress_bar,
        cfg.logger.log_every,
    );
    let mb = cfg.policy.train_micro_batch_size.max(1);
    // Validation: held-out CE, and task accuracy when asked for.
    let validate = |runner: &Runner, log: &mut MetricsLog, step: u64| -> Result<Option<f64>> {
        if val.is_empty() {
            return Ok(None);
        }
        let t0 = Instant::now();
        let ce = validation_ce(runner.student.model(), &val, mb, &device)?;
        let mut parts = BTreeMap::new();
        parts.insert("ce".to_string(), ce);
        log.append(&ValMetrics {
            split: "val".into(),
            step,
            loss: ce,
            loss_parts: parts,
            kl: None,
            records: val.len() as u64,
            loss_tokens: val.iter().map(|e| targets_of(e) as u64).sum(),
            time: t0.elapsed().as_secs_f64(),
        })?;
        progress.println(&format!(
            "validation at step {step}: ce {ce:.4} ({:.1}s)",
            t0.elapsed().as_secs_f64()
        ));
        Ok(Some(ce))
    };
    let accuracy = |runner: &Runner, log: &mut MetricsLog, step: u64| -> Result<Option<f64>> {
        let Some(task) = task else {
            return Ok(None);
        };
        let t0 = Instant::now();
        let r = eval::evaluate(runner.student.model(), &tok, &task.records, &task.config)?;
        log.append(&AccuracyMetrics {
            split: "eval".into(),
            step,
            accuracy: r.greedy_accuracy,
            marker_rate: r.greedy_marker_rate,
            eos_rate: r.greedy_eos_rate,
            records: r.n as u64,
            time: t0.elapsed().as_secs_f64(),
        })?;
        progress.println(&format!(
            "task accuracy at step {step}: {:.4} on {} prompts ({:.1}s)",
            r.greedy_accuracy,
            r.n,
            t0.elapsed().as_secs_f64()
        ));
        Ok(Some(r.greedy_accuracy))
    };
    let (mut val_ce_start, mut accuracy_start) = (None, None);
    if resumed_from.is_none() {
        if cfg.distillation.val_at_start {
            val_ce_start = validate(&runner, &mut log, 0)?;
        }
        if task.is_some() {
            accuracy_start = accuracy(&runner, &mut log, 0)?;
        }
    }
    let (mut last_ce, mut last_acc) = (None, None);
    let steps_left = total_steps.saturating_sub(runner.step) as usize;
    let mut batches = batcher.take(steps_left);
    while runner.step < total_steps {
        let t_step = Instant::now();
        let Some(batch) = batches.next() else {
            break;
        };
        let (enc, sk) = encode_all(&tok, &batch.records, eos, max_len);
        skipped += sk;
        let step_no = runner.step + 1;
        // 3. Micro-batches, gradients accumulated and normalised by the step's target count.
        let n_targets: usize = enc.iter().map(targets_of).sum();
        let mut acc = GradAccumulator::new(runner.vars().to_vec());
        let mut loss_sum = 0.0;
        if n_targets == 0 {
            tracing::warn!("step {step_no}: every record of the batch was skipped");
        }
        for chunk in enc.chunks(mb) {
            let (loss, _) = sft_loss(runner.student.model(), chunk, n_targets as f64, &device)?;
            acc.add(&loss.backward()?)?;
            loss_sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        }
        let update = runner.apply(acc.take())?;
        let tokens: u64 = enc.iter().map(|e| e.ids.len() as u64).sum();
        tokens_seen += tokens;
        let dt = t_step.elapsed().as_secs_f64();
        let mut parts = BTreeMap::new();
        parts.insert("ce".to_string(), loss_sum);
        let m = StepMetrics {
            split: "train".into(),
            step: runner.step,
            epoch: batch.start.epoch,
            loss: loss_sum,
            loss_parts: parts,
            kl: None,
            grad_norm: Some(update.grad_norm),
            lr: update.lr,
            tokens,
            loss_tokens: n_targets as u64,
            tokens_per_s: tokens as f64 / dt.max(1e-9),
            step_time_s: dt,
            teacher_latency_s: 0.0,
            teacher_wait_s: 0.0,
            skipped_records: skipped,
            time: unix_time(),
        };
        log.append(&m)?;
        progress.step(&m);
        // 4. Validation and checkpoints.
        let step = runner.step;
        let at_end = step == total_steps;
        let val_due = cfg.distillation.val_period > 0 && step % cfg.distillation.val_period == 0;
        if val_due || (at_end && cfg.distillation.val_at_end) {
            last_ce = validate(&runner, &mut log, step)?;
        }
        if let Some(t) = task {
            if (t.period > 0 && step % t.period == 0) || at_end {
                last_acc = accuracy(&runner, &mut log, step)?;
            }
        }
        let mut state = TrainerState::new(step, batch.next, &rng, hash.clone());
        state.tokens_seen = tokens_seen;
        if let Some(ce) = last_ce {
            state.metrics.insert("val_ce".into(), ce);
        }
        if let Some(a) = last_acc {
            state.metrics.insert("accuracy".into(), a);
        }
        if cfg.checkpointing.enabled && step % cfg.checkpointing.save_period == 0 && !at_end {
            let path = runner.save_checkpoint(out, &state)?;
            progress.println(&format!("checkpoint {}", path.display()));
            if let Some(keep) = cfg.checkpointing.keep_top_k {
                let ranking = match &cfg.checkpointing.metric_name {
                    Some(name) => Ranking::Metric {
                        name: name.clone(),
                        higher_is_better: cfg.checkpointing.higher_is_better,
                    },
                    None => Ranking::Newest,
                };
                checkpoint::retain(out, keep, &ranking)?;
            }
        }
        if stop_after == Some(step) && !at_end {
            progress.finish();
            return Ok(Summary {
                steps: step,
                seconds: t_start.elapsed().as_secs_f64(),
                val_ce_start,
                val_ce_end: last_ce,
                accuracy_start,
                accuracy_end: last_acc,
                skipped_records: skipped,
                final_dir: String::new(),
            });
        }
        if at_end {
            let path = runner.save_final(out, &state)?;
            progress.println(&format!("final model {}", path.display()));
        }
    }
    progress.finish();
    let final_dir = out.join("final");
    if !final_dir.is_dir() {
        let state = TrainerState::new(runner.step, Default::default(), &rng, hash);
        runner.save_final(out, &state)?;
    }
    Ok(Summary {
        steps: runner.step,
        seconds: t_start.elapsed().as_secs_f64(),
        val_ce_start,
        val_ce_end: last_ce,
        accuracy_start,
        accuracy_end: last_acc,
        skipped_records: skipped,
        final_dir: final_dir.display().to_string(),
    })
}
