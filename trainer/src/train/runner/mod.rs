//! The one training loop and what plugs into it.
//!
//! [`run`] is the one training loop: it joins the data-parallel group (a world of one without a
//! launcher), opens (or resumes) the [`Session`], validates at the start, asks the
//! [`Objective`] for each step's gradients over this rank's virtual shards, applies them
//! ([`Runner::apply`]: reduce, clip, AdamW), logs [`StepMetrics`], validates on the configured
//! cadence, checkpoints with the full [`TrainerState`], stops where asked, and writes the final
//! model. What differs between SFT, off-policy and on-policy distillation lives behind the
//! trait, one file per objective.
//!
//! Files: `update` (the [`Runner`]: student, optimiser, schedule, the group's reductions and
//! checkpoint writes), `session` (what a run opens before its first step).

mod session;
mod update;

pub use session::{RecordFilter, Session};
pub use update::{optim_config, Comm, Runner, Update};

use crate::checkpoint::{self, TrainerState};
use crate::config::Config;
use crate::data::{Batcher, DataPosition, Record};
use crate::dist::{self, Collective, ShardPlan, StepShards};
use crate::metrics_log::{unix_time, MetricsLog, Progress, StepMetrics, ValMetrics};
use crate::optim::GradAccumulator;
use crate::student::Student;
use anyhow::{Context, Result};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::time::Instant;

/// What differs between training objectives; [`run`] does the rest.
pub trait Objective {
    /// One step's input as [`Objective::feed`] yields it (a batch, possibly already scored).
    type Input;

    /// Called once the student is loaded; returns the test of records over this objective's
    /// token limits, dropped before the first step (`None`: keep every record, e.g. when
    /// `data.truncate` cuts them instead).
    fn open(&mut self, student: &Student) -> Result<Option<RecordFilter<'_>>>;

    /// Checks the loaded records (`what`: "training" or "validation") before anything trains:
    /// the distillation objectives fail here on a record that names no teacher.
    fn check_records(&self, _records: &[Record], _what: &str) -> Result<()> {
        Ok(())
    }

    /// Turns the run's remaining steps (this rank's virtual shards of each global batch) into
    /// step inputs (off-policy: tokenized and scored by the teacher on a prefetch thread while
    /// the previous step trains).
    fn feed(&mut self, steps: Steps) -> Box<dyn Iterator<Item = Result<Self::Input>>>;

    /// Runs one step's forward and backward passes over this rank's shards, in order: each
    /// shard's micro-batch gradients go to `ctx.acc`, closed by `ctx.acc.end_shard()`. Losses
    /// are normalised by the step's global counts ([`StepCtx::sum`]), and the report's figures
    /// are the global ones.
    fn step(&mut self, ctx: &mut StepCtx, input: Self::Input) -> Result<StepReport>;

    /// One validation pass over the held-out records; `None` when there are none.
    fn validation(&mut self, student: &Student, val: &[Record]) -> Result<Option<ValReport>>;

    /// Evaluation besides validation (SFT's task accuracy), called at the start and after every
    /// step; returns metrics to keep in checkpoints.
    fn evaluate(&mut self, _ctx: EvalCtx) -> Result<BTreeMap<String, f64>> {
        Ok(BTreeMap::new())
    }
}

/// The steps a run has left to train on: this rank's virtual shards of each global batch.
pub type Steps = Box<dyn Iterator<Item = StepShards> + Send>;

/// The batches of `batcher` as this rank's shards (`plan`), `steps` of them at most.
pub fn steps(batcher: Batcher, steps: usize, plan: ShardPlan) -> Steps {
    Box::new(batcher.take(steps).map(move |b| plan.split(b)))
}

/// What an objective's step works with.
pub struct StepCtx<'a> {
    pub student: &'a Student,
    /// Where the step's gradients go, shard by shard (the runner reduces, clips and applies
    /// them).
    pub acc: &'a mut GradAccumulator,
    /// The run's RNG, saved in checkpoints (sampling, λ draws): the same on every rank.
    pub rng: &'a mut ChaCha8Rng,
    /// The step being trained (1-based).
    pub step: u64,
    /// The data-parallel group ([`dist::Solo`] for one process).
    pub group: &'a mut dyn Collective,
}

impl StepCtx<'_> {
    /// `v` summed over the ranks (in rank order, the same on every rank): a step's unit
    /// counts before the losses are normalised, its figures after.
    pub fn sum(&mut self, v: &mut [f64]) -> Result<()> {
        Ok(dist::sum_f64(self.group, v)?)
    }
}

/// What an objective's evaluation works with.
pub struct EvalCtx<'a> {
    pub student: &'a Student,
    pub log: &'a mut MetricsLog,
    pub progress: &'a Progress,
    /// Steps done (0: before the first).
    pub step: u64,
    /// Whether this is the run's last step.
    pub at_end: bool,
}

/// What one step measured (the runner adds the update's figures and timings).
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    /// Epoch of the batch's first record.
    pub epoch: u64,
    /// The data position after this batch (saved in the step's checkpoint).
    pub next: DataPosition,
    pub loss: f64,
    pub loss_parts: BTreeMap<String, f64>,
    pub kl: Option<f64>,
    /// Tokens of the step's sequences (counted into `tokens_seen`).
    pub tokens: u64,
    pub loss_tokens: u64,
    pub teacher_latency_s: f64,
    pub teacher_wait_s: f64,
    /// Records skipped by this step.
    pub skipped: u64,
}

/// What one validation pass measured.
#[derive(Debug, Clone, Default)]
pub struct ValReport {
    /// The headline value (KL to the teacher, or SFT's cross-entropy).
    pub loss: f64,
    pub kl: Option<f64>,
    pub parts: BTreeMap<String, f64>,
    pub records: u64,
    pub loss_tokens: u64,
    /// Name of the headline value in checkpoints' metrics (`val_kl`, `val_ce`).
    pub metric: &'static str,
    /// The figures of the progress line, e.g. `kl 0.1234 ce 2.3456`.
    pub summary: String,
}

/// How [`run`] is asked to run.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Continue from the newest valid checkpoint.
    pub resume: bool,
    /// End after that step as an interruption would (no final model): tests use it to check
    /// that `--resume` continues exactly.
    pub stop_after: Option<u64>,
}

/// What a finished (or stopped) run did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub steps: u64,
    pub seconds: f64,
    pub skipped_records: u64,
    /// `OUTPUT/final`, or empty when the run was stopped early.
    pub final_dir: String,
    pub val_start: Option<ValReport>,
    /// The last validation.
    pub val_end: Option<ValReport>,
}

/// The training loop, for any objective.
pub fn run<O: Objective>(
    cfg: &Config,
    device: &candle_core::Device,
    objective: &mut O,
    opts: RunOptions,
) -> Result<Outcome> {
    let out = &cfg.checkpointing.checkpoint_dir;
    let t_start = Instant::now();
    // Data parallel: join the job the launcher describes (a world of one without one).
    let world = dist::World::from_env()?;
    let dp = &cfg.policy.data_parallel;
    // Every rank must run the same config (the whole of it, run length included).
    let whole = cfg.to_toml_string().context("serialising the config")?;
    let group = dist::join(world.as_ref(), &whole, dp.timeout(), device)?;
    let plan = ShardPlan::new(
        dp.virtual_shards,
        cfg.distillation.num_prompts_per_step,
        group.world_size(),
        group.rank(),
    )
    .map_err(anyhow::Error::msg)?;
    if group.world_size() > 1 {
        tracing::info!(
            rank = group.rank(),
            world_size = group.world_size(),
            virtual_shards = plan.shards,
            zero = dp.zero,
            "data-parallel training{}",
            if plan.exact_across_world_sizes() {
                ""
            } else {
                " (virtual_shards / processes is not a power of two: other process counts \
                 give other bits)"
            }
        );
    }
    if group.rank() == 0 {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    }
    let Session {
        mut runner,
        batcher,
        val,
        mut rng,
        hash,
        mut tokens_seen,
        mut skipped,
        resumed_from,
        mut log,
        progress,
    } = Session::open_in(cfg, device, opts.resume, objective, group)?;
    let main = runner.is_main();
    let total_steps = runner.total_steps;
    let dist = &cfg.distillation;
    let validation = |o: &mut O, runner: &Runner, log: &mut MetricsLog, step: u64| {
        let t0 = Instant::now();
        let Some(v) = o.validation(&runner.student, &val)? else {
            return Ok::<_, anyhow::Error>(None);
        };
        log.append(&ValMetrics {
            split: "val".into(),
            step,
            loss: v.loss,
            loss_parts: v.parts.clone(),
            kl: v.kl,
            records: v.records,
            loss_tokens: v.loss_tokens,
            time: t0.elapsed().as_secs_f64(),
        })?;
        progress.println(&format!(
            "validation at step {step}: {} ({:.1}s)",
            v.summary,
            t0.elapsed().as_secs_f64()
        ));
        Ok(Some(v))
    };
    let (mut val_start, mut last_val) = (None, None);
    let mut evals = BTreeMap::new();
    // Validation and evaluation run on rank 0 (the others wait at the next collective).
    if resumed_from.is_none() && main {
        if dist.val_at_start {
            val_start = validation(objective, &runner, &mut log, 0)?;
        }
        evals = objective.evaluate(EvalCtx {
            student: &runner.student,
            log: &mut log,
            progress: &progress,
            step: 0,
            at_end: false,
        })?;
    }
    let steps_left = total_steps.saturating_sub(runner.step) as usize;
    let mut inputs = objective.feed(steps(batcher, steps_left, plan));
    let mut stopped = false;
    while runner.step < total_steps {
        let t_step = Instant::now();
        let Some(input) = inputs.next() else {
            break;
        };
        let vars = runner.vars().to_vec();
        let keys = runner.student.grad_keys(&vars);
        let mut acc = GradAccumulator::with_keys(vars, keys);
        let mut ctx = StepCtx {
            student: &runner.student,
            acc: &mut acc,
            rng: &mut rng,
            step: runner.step + 1,
            group: &mut *runner.group,
        };
        let mut r = objective.step(&mut ctx, input?)?;
        if acc.shards() != plan.mine().len() {
            anyhow::bail!(
                "step {}: the objective closed {} virtual shards, this rank trains {}",
                runner.step + 1,
                acc.shards(),
                plan.mine().len()
            );
        }
        let update = runner.apply(acc.finish()?)?;
        let comm = runner.take_comm();
        if runner.world_size() > 1 {
            r.loss_parts.insert("dp/collective_s".into(), comm.seconds);
            r.loss_parts.insert("dp/bytes".into(), comm.bytes);
        }
        tokens_seen = tokens_seen.saturating_add(r.tokens);
        skipped += r.skipped;
        let dt = t_step.elapsed().as_secs_f64();
        let m = StepMetrics {
            split: "train".into(),
            step: runner.step,
            epoch: r.epoch,
            loss: r.loss,
            loss_parts: r.loss_parts,
            kl: r.kl,
            grad_norm: Some(update.grad_norm),
            lr: update.lr,
            tokens: r.tokens,
            loss_tokens: r.loss_tokens,
            tokens_per_s: r.tokens as f64 / dt.max(1e-9),
            step_time_s: dt,
            teacher_latency_s: r.teacher_latency_s,
            teacher_wait_s: r.teacher_wait_s,
            skipped_records: skipped,
            time: unix_time(),
        };
        if main {
            log.append(&m)?;
            progress.step(&m);
        }
        // Validation, evaluation (rank 0) and checkpoints.
        let step = runner.step;
        let at_end = step == total_steps;
        let due =
            (dist.val_period > 0 && step % dist.val_period == 0) || (at_end && dist.val_at_end);
        if due && main {
            last_val = validation(objective, &runner, &mut log, step)?;
        }
        if main {
            evals.extend(objective.evaluate(EvalCtx {
                student: &runner.student,
                log: &mut log,
                progress: &progress,
                step,
                at_end,
            })?);
        }
        let mut state = TrainerState::new(step, r.next, &rng, hash.clone());
        state.tokens_seen = tokens_seen;
        if let Some(v) = &last_val {
            state.metrics.insert(v.metric.into(), v.loss);
        }
        state.metrics.extend(evals.clone());
        runner.after_step(&cfg.checkpointing, &state, &|l| progress.println(l))?;
        if opts.stop_after == Some(step) && !at_end {
            stopped = true;
            break;
        }
    }
    drop(inputs);
    progress.finish();
    let final_dir = out.join(checkpoint::FINAL_DIR);
    // Data ran out before max_num_steps: still write the final model.
    if !stopped && main && !final_dir.is_dir() {
        let mut state = TrainerState::new(runner.step, DataPosition::default(), &rng, hash);
        state.tokens_seen = tokens_seen;
        runner.save_final(out, &state)?;
    }
    Ok(Outcome {
        steps: runner.step,
        seconds: t_start.elapsed().as_secs_f64(),
        skipped_records: skipped,
        final_dir: if stopped {
            String::new()
        } else {
            final_dir.display().to_string()
        },
        val_start,
        val_end: last_val,
    })
}
