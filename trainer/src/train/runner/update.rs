//! The state every training loop owns: the student, its optimiser and schedule, the step, and
//! the data-parallel group its updates are reduced over.

use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainerState};
use crate::config::{LrSchedule, OptimizerConfig};
use crate::dist::{self, Collective, Ownership};
use crate::optim::{
    clip_scale, grad_norm, norm_of, sq_norms, AdamW, AdamWConfig, Grads, OptimConfig,
    OptimizerState, ScheduleConfig,
};
use crate::student::Student;
use crate::train::phases;
use anyhow::{Context, Result};
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use xdistill_shared::profiling::{self, Phase};

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
        max_grad_norm: o.max_grad_norm,
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
    /// The data-parallel group: [`dist::Solo`] for a single process.
    pub(crate) group: Box<dyn Collective + Send>,
    /// ZeRO-1: the parameters each rank updates (`None`: every rank updates all of them).
    zero: Option<Ownership>,
    /// Reduce the gradients with the backend's own all-reduce (`all_reduce = "fast"`).
    pub fast_all_reduce: bool,
    /// Time in collectives and bytes this rank sent and received, since the last
    /// [`Runner::take_comm`].
    comm: Comm,
}

/// What a step's collectives cost this rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct Comm {
    pub seconds: f64,
    pub bytes: f64,
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
    /// A single process's runner.
    pub fn new(student: Student, optim: OptimConfig, total_steps: u64) -> Result<Runner> {
        Runner::in_group(student, optim, total_steps, Box::new(dist::Solo), false)
    }

    /// A runner in a data-parallel `group`; `zero` shards AdamW's state over its ranks.
    pub fn in_group(
        student: Student,
        optim: OptimConfig,
        total_steps: u64,
        group: Box<dyn Collective + Send>,
        zero: bool,
    ) -> Result<Runner> {
        optim.validate()?;
        let named = student.named_vars();
        let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        if group.world_size() > 1 {
            if let Some((name, v)) = named.iter().find(|(_, v)| v.dtype() == DType::F64) {
                anyhow::bail!(
                    "parameter {name} is {:?}: data-parallel training moves f32 buffers; \
                     use f32, bf16 or f16 weights",
                    v.dtype()
                );
            }
        }
        let zero = (zero && group.world_size() > 1).then(|| {
            let sizes: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
            Ownership::new(&sizes, group.world_size())
        });
        let owned = match &zero {
            Some(o) => named[o.vars[group.rank()].clone()].to_vec(),
            None => named,
        };
        let opt = AdamW::with_names(owned, optim.adamw.clone())?;
        Ok(Runner {
            student,
            opt,
            optim,
            total_steps,
            step: 0,
            max_nonfinite_steps: 10,
            nonfinite_run: 0,
            vars,
            group,
            zero,
            fast_all_reduce: false,
            comm: Comm::default(),
        })
    }

    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }

    /// Whether this process writes (metrics, checkpoints, the final model): rank 0.
    pub fn is_main(&self) -> bool {
        self.group.rank() == 0
    }

    /// The collectives' cost since the last call.
    pub fn take_comm(&mut self) -> Comm {
        std::mem::take(&mut self.comm)
    }

    /// Runs `f` on the group, counting its time and `bytes` towards [`Runner::take_comm`].
    fn collective<T>(
        &mut self,
        bytes: usize,
        f: impl FnOnce(&mut dyn Collective) -> Result<T, dist::CollectiveError>,
    ) -> Result<T> {
        let t0 = Instant::now();
        let out = {
            let _region = profiling::region(&self.student.device, Phase::Collective);
            f(&mut *self.group)?
        };
        self.comm.seconds += t0.elapsed().as_secs_f64();
        self.comm.bytes += bytes as f64;
        Ok(out)
    }

    /// Sums this rank's share of the step's gradient over the group (all-reduce, or with ZeRO-1
    /// reduce-scatter to the parameters this rank updates), clips by the global norm, sets the
    /// scheduled learning rate and applies one AdamW update; with ZeRO-1 the updated weights
    /// are then all-gathered. Every rank sees the same norm and the same weights.
    pub fn apply(&mut self, grads: Grads) -> Result<Update> {
        let lr = self.optim.lr(self.total_steps as usize, self.step as usize);
        let (world, rank) = (self.group.world_size(), self.group.rank());
        let device = self.student.device.clone();
        // The gradients this rank updates with (its vars' in a store), and the global norm.
        let (mut grads, grad_norm) = if world == 1 {
            let store = grads.into_store(&self.vars);
            let norm = phases::time(phases::Phase::Clip, &device, || {
                Ok(grad_norm(&store, &self.vars)?)
            })?;
            (store, norm)
        } else if let Some(own) = self.zero.clone() {
            let flat = grads.flatten()?;
            drop(grads);
            // The star through rank 0 moves each rank's buffer in and its share out.
            let bytes = 4 * (flat.len() + own.elems[rank].len());
            let mine = self.collective(bytes, |g| g.reduce_scatter_sum(&flat, &own.elems))?;
            drop(flat);
            let vars = self.vars[own.vars[rank].clone()].to_vec();
            let store = Grads::from_flat(&mine, &vars, &device)?.into_store(&vars);
            let sq = sq_norms(&store, &vars)?;
            let all = self.collective(16 * sq.len() * world, |g| dist::gather_f64(g, &sq))?;
            let norm = norm_of(&all.concat());
            (store, norm)
        } else {
            // One buffer on the device, summed where the backend keeps it (NCCL: on the GPU).
            let flat = grads.flatten_tensor()?;
            drop(grads);
            let bytes = 8 * flat.elem_count();
            let fast = self.fast_all_reduce;
            let sum = self.collective(bytes, |g| g.all_reduce_sum_tensor(&flat, fast))?;
            drop(flat);
            let store = Grads::from_flat_tensor(&sum, &self.vars)?.into_store(&self.vars);
            let norm = phases::time(phases::Phase::Clip, &device, || {
                Ok(grad_norm(&store, &self.vars)?)
            })?;
            (store, norm)
        };
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
        let clip = clip_scale(grad_norm, self.optim.max_grad_norm);
        phases::time(phases::Phase::Optimizer, &device, || {
            let copies = self.student.compute_copies();
            let written = self.opt.step_with_copies(&mut grads, clip, copies)?;
            drop(grads);
            if let Some(own) = self.zero.clone() {
                self.gather_weights(&own)?;
            }
            // The other ranks' parameters arrive in the masters only, under ZeRO-1.
            if !written || self.zero.is_some() {
                self.student.refresh()?;
            }
            Ok(())
        })?;
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
            if t.dims() != var.dims() {
                anyhow::bail!(
                    "checkpoint tensor {name:?} is {:?}, the student's {:?}: the checkpoint is \
                     of another model than policy.model_name",
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
        }
        // With ZeRO-1 each rank keeps the state of the parameters it updates.
        let keep: Option<std::collections::HashSet<String>> = self
            .zero
            .as_ref()
            .map(|_| {
                self.opt
                    .state_dict()
                    .map(|s| s.tensors.into_keys().collect())
            })
            .transpose()?;
        let tensors = ck
            .optimizer
            .iter()
            .filter(|(k, _)| keep.as_ref().is_none_or(|keep| keep.contains(*k)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let state = OptimizerState {
            step: ck.state.step,
            tensors,
        };
        self.opt.load_state_dict(&state)?;
        self.student.refresh()?;
        self.step = ck.state.step;
        Ok(())
    }

    /// Every rank's weights after a ZeRO-1 update: each rank sends the parameters it updated.
    fn gather_weights(&mut self, own: &Ownership) -> Result<()> {
        let rank = self.group.rank();
        let mine = Grads::new(
            self.vars[own.vars[rank].clone()]
                .iter()
                .map(|v| v.as_tensor().clone())
                .collect(),
        )
        .flatten()?;
        let total: usize = own.elems.iter().map(|e| e.len()).sum();
        let all = self.collective(4 * (mine.len() + total), |g| g.all_gather(&mine))?;
        let device = self.student.device.clone();
        for (r, buf) in all.iter().enumerate() {
            if r == rank {
                continue;
            }
            let vars = &self.vars[own.vars[r].clone()];
            let got = Grads::from_flat(buf, vars, &device)?;
            for (v, t) in vars.iter().zip(got.0) {
                v.set(&t.to_dtype(v.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The whole optimiser state, for a checkpoint. With ZeRO-1 every rank must call it (the
    /// ranks' shares are all-gathered); the state is the one an unsharded run would hold.
    pub fn optimizer_tensors(&mut self) -> Result<HashMap<String, Tensor>> {
        let mine = self.opt.state_dict()?.tensors;
        let Some(own) = self.zero.clone() else {
            return Ok(mine);
        };
        // Each rank's tensors in its parameters' order: exp_avg, exp_avg_sq, master.
        let named = self.student.named_vars();
        let layout = |r: usize| -> Vec<(String, Vec<usize>)> {
            named[own.vars[r].clone()]
                .iter()
                .flat_map(|(name, v)| {
                    let mut keys = vec![format!("{name}.exp_avg"), format!("{name}.exp_avg_sq")];
                    if !matches!(v.dtype(), DType::F32 | DType::F64) {
                        keys.push(format!("{name}.master"));
                    }
                    keys.into_iter().map(|k| (k, v.dims().to_vec()))
                })
                .collect()
        };
        let rank = self.group.rank();
        let mut flat = Vec::new();
        for (key, _) in layout(rank) {
            let t = mine
                .get(&key)
                .with_context(|| format!("optimizer state lacks {key}"))?;
            flat.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let all = self.collective(4 * flat.len(), |g| g.all_gather(&flat))?;
        let device = self.student.device.clone();
        let mut out = HashMap::new();
        for (r, buf) in all.iter().enumerate() {
            let mut at = 0;
            for (key, dims) in layout(r) {
                let n: usize = dims.iter().product();
                let t = Tensor::from_slice(&buf[at..at + n], dims.as_slice(), &device)?;
                out.insert(key, t);
                at += n;
            }
        }
        Ok(out)
    }

    /// Writes `OUTPUT/step_N/` atomically (rank 0).
    pub fn save_checkpoint(&self, out: &Path, state: &TrainerState) -> Result<PathBuf> {
        let optimizer = self.opt.state_dict()?.tensors;
        self.write_checkpoint(out, state, &optimizer)
    }

    fn write_checkpoint(
        &self,
        out: &Path,
        state: &TrainerState,
        optimizer: &HashMap<String, Tensor>,
    ) -> Result<PathBuf> {
        let model = self.student.tensors()?;
        Ok(checkpoint::save(
            out,
            &CheckpointData {
                model: &model,
                model_config: &self.student.config,
                tokenizer_json: &self.student.tokenizer_json,
                optimizer,
                state,
            },
        )?)
    }

    /// End-of-step bookkeeping shared by the loops: a checkpoint every `save_period` steps
    /// (pruned to `keep_top_k`), and the final model after the last step. Every rank calls
    /// it; rank 0 alone writes.
    pub fn after_step(
        &mut self,
        ck: &crate::config::CheckpointingConfig,
        state: &TrainerState,
        log: &dyn Fn(&str),
    ) -> Result<()> {
        let out = &ck.checkpoint_dir;
        if ck.enabled && self.step.is_multiple_of(ck.save_period) && self.step < self.total_steps {
            let optimizer = self.optimizer_tensors()?;
            if !self.is_main() {
                return Ok(());
            }
            let path = self.write_checkpoint(out, state, &optimizer)?;
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
        if self.step == self.total_steps && self.is_main() {
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
