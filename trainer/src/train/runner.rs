//! The state every training loop owns: the student, its optimiser and schedule, and the step.

//!
//! [`run`] is the one training loop: it opens (or resumes) the [`Session`], validates at the
//! start, asks the [`Objective`] for each step's gradients, applies them, logs [`StepMetrics`],
//! validates on the configured cadence, checkpoints with the full [`TrainerState`], stops where
//! asked, and writes the final model. What differs between SFT, off-policy and on-policy
//! distillation lives behind the trait, one file per objective.

use crate::checkpoint::{self, Checkpoint, CheckpointData, TrainerState};
use crate::config::{Config, LrSchedule, OptimizerConfig};
use crate::data::{Batcher, DataPosition, Record};
use crate::dist::{self, Collective, Ownership, ShardPlan, StepShards};
use crate::metrics_log::{unix_time, MetricsLog, Progress, StepMetrics, ValMetrics};
use crate::optim::{
    clip_to, grad_norm, norm_of, sq_norms, AdamW, AdamWConfig, GradAccumulator, Grads, OptimConfig,
    OptimizerState, ScheduleConfig,
};
use crate::student::Student;
use anyhow::{Context, Result};
use candle_core::{DType, Tensor, Var};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
        let out = f(&mut *self.group)?;
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
        // The gradients this rank updates with, as (vars, store), and the global norm.
        let (vars, mut grads, grad_norm) = if world == 1 {
            let store = grads.into_store(&self.vars);
            let norm = grad_norm(&store, &self.vars)?;
            (self.vars.clone(), store, norm)
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
            (vars, store, norm)
        } else {
            let mut flat = grads.flatten()?;
            drop(grads);
            let bytes = 8 * flat.len();
            let fast = self.fast_all_reduce;
            self.collective(bytes, |g| {
                if fast {
                    g.all_reduce_sum_fast(&mut flat)
                } else {
                    g.all_reduce_sum(&mut flat)
                }
            })?;
            let store = Grads::from_flat(&flat, &self.vars, &device)?.into_store(&self.vars);
            let norm = grad_norm(&store, &self.vars)?;
            (self.vars.clone(), store, norm)
        };
        clip_to(&mut grads, &vars, grad_norm, self.optim.max_grad_norm)?;
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
        drop(grads);
        if let Some(own) = self.zero.clone() {
            self.gather_weights(&own)?;
        }
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
        let mine = Grads(
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

/// What every training loop opens before its first step: data, the student with its optimiser
/// and schedule, the batcher, the run's RNG, and — with `--resume` — the newest checkpoint's state.
pub struct Session {
    pub runner: Runner,
    pub batcher: Batcher,
    pub val: Vec<Record>,
    pub rng: ChaCha8Rng,
    /// `Config::training_hash`, stored in checkpoints.
    pub hash: String,
    pub tokens_seen: u64,
    /// Records skipped while loading.
    pub skipped: u64,
    /// The step a resumed run continues from.
    pub resumed_from: Option<u64>,
    pub log: MetricsLog,
    pub progress: Progress,
}

/// Records an objective cannot train on, dropped (and counted) when the session opens, before
/// anything is sent to a teacher.
pub struct RecordFilter<'a> {
    pub too_long: Box<dyn Fn(&Record) -> bool + Sync + 'a>,
    /// The limits, for the error of a run left with no record: "longer than {limits}".
    pub limits: String,
}

impl Session {
    /// Loads data and the student, drops the records `objective`'s filter rejects (a run left
    /// with no training record is an error), and with `resume` restores the newest valid
    /// checkpoint.
    pub fn open<O: Objective + ?Sized>(
        cfg: &Config,
        device: &candle_core::Device,
        resume: bool,
        objective: &mut O,
    ) -> Result<Session> {
        Session::open_in(cfg, device, resume, objective, Box::new(dist::Solo))
    }

    /// [`Session::open`] for one rank of a data-parallel `group`: every rank loads the same
    /// data and checkpoint; rank 0 alone owns `metrics.jsonl` and the progress bar.
    pub fn open_in<O: Objective + ?Sized>(
        cfg: &Config,
        device: &candle_core::Device,
        resume: bool,
        objective: &mut O,
        group: Box<dyn Collective + Send>,
    ) -> Result<Session> {
        let main = group.rank() == 0;
        use rand::SeedableRng;
        let out = &cfg.checkpointing.checkpoint_dir;
        let (mut train_set, mut val_set) =
            crate::data::load_train_val(&cfg.data, cfg.distillation.seed)?;
        let dtype = xdistill_shared::device::dtype_for(&cfg.policy.precision, device)?;
        let student = Student::load(&cfg.policy.model_name, device, dtype)?;
        tracing::info!(
            device = %xdistill_shared::device::device_name(device),
            kernels_simd = xdistill_shared::simd::Simd::current().name(),
            "student loaded"
        );
        objective.check_records(&train_set.records, "training")?;
        objective.check_records(&val_set.records, "validation")?;
        if let Some(f) = objective.open(&student)? {
            let before = train_set.records.len();
            train_set.drop_where(&*f.too_long);
            val_set.drop_where(&*f.too_long);
            if train_set.records.is_empty() {
                anyhow::bail!(
                    "{}: nothing to train on: all {before} training records are longer than {} \
                     and were skipped ({})",
                    cfg.data.train_path.display(),
                    f.limits,
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
        let mut runner = Runner::in_group(
            student,
            optim_config(&cfg.policy.optimizer),
            total_steps,
            group,
            cfg.policy.data_parallel.zero,
        )?;
        runner.max_nonfinite_steps = cfg.policy.max_nonfinite_steps;
        runner.fast_all_reduce =
            cfg.policy.data_parallel.all_reduce == crate::config::AllReduceMode::Fast;
        let mut batcher = Batcher::new(
            train_set.records,
            crate::data::BatchOptions::from_config(cfg),
        );
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.distillation.seed);
        let hash = cfg.training_hash();
        let mut tokens_seen = 0;
        let mut resumed_from = None;
        if resume {
            if main {
                checkpoint::remove_temp_dirs(out)?;
            }
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
                // Nothing to resume from. An empty folder is a first start; a previous run's
                // traces mean its progress would be lost, so that needs saying so on purpose.
                let mut leftovers = checkpoint::corrupt_dirs(out)?;
                leftovers.extend(crate::metrics_log::previous(out));
                if !leftovers.is_empty() && !cfg.checkpointing.start_fresh {
                    return Err(checkpoint::CheckpointError::NothingToResume {
                        dir: out.clone(),
                        leftovers,
                    }
                    .into());
                }
                if leftovers.is_empty() {
                    tracing::info!(
                        "--resume: no checkpoint in {}, starting fresh",
                        out.display()
                    );
                } else {
                    tracing::warn!(
                        "--resume: no valid checkpoint in {}; starting from step 0 as \
                         checkpointing.start_fresh asks",
                        out.display()
                    );
                }
            }
        }
        let (log, progress) = if main {
            let log = MetricsLog::open(out, resumed_from)?;
            let progress = Progress::new(
                runner.total_steps,
                runner.step,
                cfg.logger.progress_bar,
                cfg.logger.log_every,
            );
            (log, progress)
        } else {
            let quiet = Progress::new(runner.total_steps, runner.step, false, u64::MAX);
            (MetricsLog::disabled(out), quiet)
        };
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
    let plan = ShardPlan::new(dp.virtual_shards, group.world_size(), group.rank())
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
        let mut acc = GradAccumulator::new(runner.vars().to_vec());
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
        tokens_seen += r.tokens;
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
