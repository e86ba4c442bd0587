//! The state every training loop owns: the student, its optimiser and schedule, and the step.

use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainerState};
use crate::config::{LrSchedule, OptimizerConfig};
use crate::optim::{
    clip_grad_norm, AdamW, AdamWConfig, OptimConfig, OptimizerState, ScheduleConfig,
};
use crate::student::Student;
use anyhow::{Context, Result};
use candle_core::backprop::GradStore;
use candle_core::Var;
use std::path::{Path, PathBuf};

/// `[policy.optimizer]` as the optimiser module's config.
pub fn optim_config(o: &OptimizerConfig) -> OptimConfig {
    let warmup_steps = o.warmup_steps as usize;
    OptimConfig {
        adamw: AdamWConfig {
            lr: o.lr,
            beta1: o.betas[0],
            beta2: o.betas[1],
            eps: o.eps,
            weight_decay: o.weight_decay,
            decay_1d: o.decay_1d,
        },
        schedule: match o.schedule {
            LrSchedule::Constant => ScheduleConfig::Constant { warmup_steps },
            LrSchedule::Linear => ScheduleConfig::Linear {
                warmup_steps,
                min_lr: o.min_lr,
            },
            LrSchedule::Cosine => ScheduleConfig::Cosine {
                warmup_steps,
                min_lr: o.min_lr,
            },
        },
        max_grad_norm: o.max_grad_norm.unwrap_or(0.0),
    }
}

pub struct Runner {
    pub student: Student,
    pub opt: AdamW,
    pub optim: OptimConfig,
    /// Updates in the whole run (the schedule's length).
    pub total_steps: u64,
    /// Updates done so far.
    pub step: u64,
    /// Consecutive non-finite steps after which [`Runner::apply`] fails (0: never).
    pub max_nonfinite_steps: u64,
    /// Current run of consecutive steps skipped for a non-finite gradient norm.
    nonfinite_run: u64,
    vars: Vec<Var>,
}

/// What one update did.
#[derive(Debug, Clone, Copy)]
pub struct Update {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// False when the norm was not finite and the update was skipped.
    pub applied: bool,
}

impl Runner {
    pub fn new(student: Student, optim: OptimConfig, total_steps: u64) -> Result<Runner> {
        optim.validate()?;
        let vars: Vec<Var> = student.named_vars().into_iter().map(|(_, v)| v).collect();
        let opt = AdamW::with_names(student.named_vars(), optim.adamw.clone())?;
        Ok(Runner {
            student,
            opt,
            optim,
            total_steps,
            step: 0,
            max_nonfinite_steps: 10,
            nonfinite_run: 0,
            vars,
        })
    }

    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Clips, sets the scheduled learning rate and applies one AdamW update.
    pub fn apply(&mut self, mut grads: GradStore) -> Result<Update> {
        let lr = self.optim.lr(self.total_steps as usize, self.step as usize);
        let grad_norm = clip_grad_norm(&mut grads, &self.vars, self.optim.max_grad_norm)?;
        self.step += 1;
        if !grad_norm.is_finite() {
            self.nonfinite_run += 1;
            tracing::warn!(
                "step {}: gradient norm is {grad_norm}; update skipped ({} in a row)",
                self.step,
                self.nonfinite_run
            );
            if self.max_nonfinite_steps > 0 && self.nonfinite_run >= self.max_nonfinite_steps {
                anyhow::bail!(
                    "{} consecutive steps (through step {}) had a non-finite gradient norm \
                     ({grad_norm}): aborting at policy.max_nonfinite_steps = {}; the weights or \
                     the data produce NaN/inf (check the student for non-finite weights, lower \
                     policy.optimizer.lr)",
                    self.nonfinite_run,
                    self.step,
                    self.max_nonfinite_steps
                );
            }
            return Ok(Update {
                grad_norm,
                lr,
                applied: false,
            });
        }
        self.nonfinite_run = 0;
        self.opt.set_learning_rate(lr);
        self.opt.step(&grads)?;
        self.student.refresh()?;
        Ok(Update {
            grad_norm,
            lr,
            applied: true,
        })
    }

    /// Restores weights, optimiser state and the step from a checkpoint.
    pub fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        for (name, var) in self.student.named_vars() {
            let t = ck
                .model
                .get(&name)
                .with_context(|| format!("checkpoint has no tensor {name:?}"))?;
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
        let state = OptimizerState {
            step: ck.state.step,
            tensors: ck.optimizer.clone(),
        };
        self.opt.load_state_dict(&state)?;
        self.student.refresh()?;
        self.step = ck.state.step;
        Ok(())
    }

    /// Writes `OUTPUT/step_N/` atomically.
    pub fn save_checkpoint(&self, out: &Path, state: &TrainerState) -> Result<PathBuf> {
        let model = self.student.tensors()?;
        let optimizer = self.opt.state_dict()?.tensors;
        Ok(checkpoint::save(
            out,
            &CheckpointData {
                model: &model,
                model_config: &self.student.config,
                tokenizer_json: &self.student.tokenizer_json,
                optimizer: &optimizer,
                state,
            },
        )?)
    }

    /// End-of-step bookkeeping shared by the loops: a checkpoint every `save_period` steps
    /// (pruned to `keep_top_k`), and the final model after the last step.
    pub fn after_step(
        &self,
        ck: &crate::config::CheckpointingConfig,
        state: &TrainerState,
        log: &dyn Fn(&str),
    ) -> Result<()> {
        let out = &ck.checkpoint_dir;
        if ck.enabled && self.step.is_multiple_of(ck.save_period) && self.step < self.total_steps {
            let path = self.save_checkpoint(out, state)?;
            log(&format!("checkpoint {}", path.display()));
            if let Some(keep) = ck.keep_top_k {
                let ranking = match &ck.metric_name {
                    Some(name) => checkpoint::Ranking::Metric {
                        name: name.clone(),
                        higher_is_better: ck.higher_is_better,
                    },
                    None => checkpoint::Ranking::Newest,
                };
                checkpoint::retain(out, keep, &ranking)?;
            }
        }
        if self.step == self.total_steps {
            let path = self.save_final(out, state)?;
            log(&format!("final model {}", path.display()));
        }
        Ok(())
    }

    /// Writes `OUTPUT/final/`.
    pub fn save_final(&self, out: &Path, state: &TrainerState) -> Result<PathBuf> {
        let model = self.student.tensors()?;
        Ok(checkpoint::save_final(
            out,
            &model,
            &self.student.config,
            &self.student.tokenizer_json,
            state,
        )?)
    }
}

/// What every training loop opens before its first step: data, the student with its optimiser
/// and schedule, the batcher, the run's RNG, and — with `--resume` — the newest checkpoint's state.
pub struct Session {
    pub runner: Runner,
    pub batcher: crate::data::Batcher,
    pub val: Vec<crate::data::Record>,
    pub rng: rand_chacha::ChaCha8Rng,
    /// `Config::training_hash`, stored in checkpoints.
    pub hash: String,
    pub tokens_seen: u64,
    /// Records skipped while loading.
    pub skipped: u64,
    /// The step a resumed run continues from.
    pub resumed_from: Option<u64>,
    pub log: crate::metrics_log::MetricsLog,
    pub progress: crate::metrics_log::Progress,
}

impl Session {
    /// `too_long` tells records over the token limits; unless `data.truncate` is set they are
    /// skipped and counted here, before anything is sent to a teacher, and a run left with no
    /// training record is an error.
    pub fn open(
        cfg: &crate::config::Config,
        device: &candle_core::Device,
        resume: bool,
        too_long: Option<&(dyn Fn(&crate::data::Record) -> bool + Sync)>,
    ) -> Result<Session> {
        use rand::SeedableRng;
        let out = &cfg.checkpointing.checkpoint_dir;
        let (mut train_set, mut val_set) =
            crate::data::load_train_val(&cfg.data, cfg.distillation.seed)?;
        if let (Some(f), false) = (too_long, cfg.data.truncate) {
            let before = train_set.records.len();
            train_set.drop_where(f);
            val_set.drop_where(f);
            if train_set.records.is_empty() {
                anyhow::bail!(
                    "{}: nothing to train on: all {before} training records are longer than the \
                     token limits (policy.max_total_sequence_length = {}, or the teacher's \
                     max_seq_len) and were skipped ({}); raise the limit or set \
                     data.truncate = true",
                    cfg.data.train_path.display(),
                    cfg.policy.max_total_sequence_length,
                    train_set.skipped
                );
            }
        }
        let skipped = train_set.skipped.total();
        if skipped > 0 {
            tracing::warn!("{skipped} training records skipped: {}", train_set.skipped);
        }
        let mut val = val_set.records;
        if let Some(n) = cfg.distillation.max_val_samples {
            val.truncate(n);
        }
        let dtype = xdistill_shared::device::parse_dtype(&cfg.policy.precision)?;
        let student = Student::load(&cfg.policy.model_name, device, dtype)?;
        let (n, b) = (
            train_set.records.len(),
            cfg.distillation.num_prompts_per_step,
        );
        let steps_per_epoch = if cfg.data.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        } as u64;
        if steps_per_epoch == 0 {
            anyhow::bail!("no training batch: {n} records for num_prompts_per_step = {b}");
        }
        let total_steps = cfg
            .distillation
            .max_num_steps
            .min(steps_per_epoch * cfg.distillation.max_num_epochs);
        let mut runner = Runner::new(student, optim_config(&cfg.policy.optimizer), total_steps)?;
        runner.max_nonfinite_steps = cfg.policy.max_nonfinite_steps;
        let mut batcher = crate::data::Batcher::new(
            train_set.records,
            crate::data::BatchOptions::from_config(cfg),
        );
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.distillation.seed);
        let hash = cfg.training_hash();
        let mut tokens_seen = 0;
        let mut resumed_from = None;
        if resume {
            checkpoint::remove_temp_dirs(out)?;
            if let Some(ck) = checkpoint::load_newest_valid(out, device)? {
                let (step, path) = (ck.state.step, ck.path.clone());
                if ck.state.config_hash != hash {
                    tracing::warn!(
                        "resuming {} with a changed config: the result will differ from an uninterrupted run",
                        path.display()
                    );
                }
                runner.restore(&ck)?;
                batcher.seek(ck.state.data)?;
                rng = ck.state.rng.restore().map_err(anyhow::Error::msg)?;
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
        let log = crate::metrics_log::MetricsLog::open(out, resumed_from)?;
        let progress = crate::metrics_log::Progress::new(
            runner.total_steps,
            runner.step,
            cfg.logger.progress_bar,
            cfg.logger.log_every,
        );
        Ok(Session {
            runner,
            batcher,
            val,
            rng,
            hash,
            tokens_seen,
            skipped,
            resumed_from,
            log,
            progress,
        })
    }
}
