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
            tracing::warn!(
                "step {}: gradient norm is {grad_norm}; update skipped",
                self.step
            );
            return Ok(Update {
                grad_norm,
                lr,
                applied: false,
            });
        }
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
