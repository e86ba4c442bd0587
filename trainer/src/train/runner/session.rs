//! What every training loop opens before its first step.

use super::update::optim_config;
use crate::checkpoint;
use crate::config::Config;
use crate::data::{Batcher, Record};
use crate::dist::{self, Collective};
use crate::metrics_log::{MetricsLog, Progress};
use crate::student::Student;
use anyhow::Result;
use rand_chacha::ChaCha8Rng;

use super::{Objective, Runner};

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
            kernels_simd = xdistill_cpu_kernels::simd::Simd::current().name(),
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
            .min(steps_per_epoch.saturating_mul(cfg.distillation.max_num_epochs));
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
