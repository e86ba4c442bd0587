//! Running the trainer's commands for the demo: the `teacher` and `trainer` executables, each
//! training run as a subprocess (`trainer sft` / `off-policy` / `on-policy`) with a config built
//! as a [`Config`] value ([`RunConfig`]), and the small helpers around those runs.

use crate::settings::{ModelSpec, TrainSpec};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use xdistill_trainer::config::{Config, LrSchedule, ObjectiveKind, VirtualShards};
use xdistill_trainer::generate::GenerationConfig;

/// The `teacher` binary: `--teacher-bin`, else beside the running executable.
pub fn teacher_binary(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            bail!("--teacher-bin {}: no such file", p.display())
        };
    }
    let exe = std::env::current_exe().context("locating the trainer executable")?;
    let name = format!("teacher{}", std::env::consts::EXE_SUFFIX);
    let mut candidates = vec![];
    if let Some(dir) = exe.parent() {
        candidates.push(dir.join(&name));
        // Test binaries live in target/<profile>/deps/.
        if let Some(up) = dir.parent() {
            candidates.push(up.join(&name));
        }
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "the `teacher` server binary is not beside {} — build the whole workspace first \
             (`cargo build --release` at the repository root), or pass --teacher-bin",
                exe.display()
            )
        })
}

/// The `trainer` executable to run subcommands with (tests run from `deps/`).
pub(crate) fn trainer_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the trainer executable")?;
    let name = format!("trainer{}", std::env::consts::EXE_SUFFIX);
    if exe.file_name().and_then(|n| n.to_str()) == Some(name.as_str()) {
        return Ok(exe);
    }
    let dir = exe.parent().context("executable has no folder")?;
    [dir.join(&name), dir.join("..").join(&name)]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "no `trainer` executable near {} — build the workspace first (`cargo build --release`)",
                exe.display()
            )
        })
}

/// A stage heading on stderr.
pub(crate) fn stage(label: &str, text: &str) {
    eprintln!("\n== [{label}] {text}");
}

/// Runs `trainer SUB --config CONFIG [EXTRA]`, the child's progress on our stderr; returns the
/// JSON summary it prints last on stdout.
pub(crate) fn run_trainer(sub: &str, config: &Path, extra: &[String]) -> Result<serde_json::Value> {
    let bin = trainer_binary()?;
    let out = Command::new(&bin)
        .arg(sub)
        .arg("--config")
        .arg(config)
        .args(extra)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {sub}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "`trainer {sub} --config {}` failed ({}){}",
            config.display(),
            out.status,
            if stdout.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", stdout.trim())
            }
        );
    }
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("`trainer {sub}` printed no JSON summary"))?;
    serde_json::from_str(last).with_context(|| format!("`trainer {sub}` summary: {last}"))
}

/// A randomly initialised model of `spec` (its tokenizer found or fetched) at `out`.
pub(crate) fn init_model(spec: &ModelSpec, out: &Path) -> Result<()> {
    let tokenizer = crate::tokenizers::tokenizer(&spec.tokenizer)?;
    xdistill_trainer::init_model::run(xdistill_trainer::init_model::Args {
        arch: spec.arch.clone(),
        tokenizer,
        hidden_size: spec.hidden_size,
        layers: spec.layers,
        heads: spec.heads,
        kv_heads: spec.kv_heads,
        intermediate_size: spec.intermediate_size,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: true,
        init_std: 0.02,
        seed: spec.seed,
        out: out.to_path_buf(),
        features: Default::default(),
    })
}

/// The teacher side of a distillation run's config.
#[derive(Debug, Clone, Copy)]
pub struct Distill<'a> {
    pub teacher_url: &'a str,
    /// Teacher top-k per position.
    pub k: usize,
    /// The `[loss] kd` type (`forward_kl`, `first_kl`, …).
    pub kd: &'a str,
    /// `checkpointing.cache_dir`: the runs share the teacher's tokenizer and the projection
    /// map, fetched and built by the first.
    pub cache_dir: &'a Path,
}

/// The rollouts of an on-policy run: `[on_policy]` with λ = 1 (every step samples).
#[derive(Debug, Clone, Copy)]
pub struct Rollouts {
    pub max_new_tokens: usize,
    pub temperature: f64,
}

/// One generated training config: what `trainer sft` / `off-policy` / `on-policy` is run with.
pub struct RunConfig<'a> {
    pub model: &'a Path,
    pub data: &'a Path,
    pub out: &'a Path,
    pub train: &'a TrainSpec,
    pub save_period: u64,
    pub seed: u64,
    /// The teacher and the distillation loss (None: SFT, which has neither).
    pub distill: Option<Distill<'a>>,
    /// On-policy's sampling (None: SFT and off-policy).
    pub rollouts: Option<Rollouts>,
    /// The data file holds prompts only (`data.prompts_only`, on-policy with `lambda = 1`).
    pub prompts_only: bool,
}

impl RunConfig<'_> {
    /// The command the config is for, which it is validated for.
    fn objective(&self) -> ObjectiveKind {
        match (&self.distill, &self.rollouts) {
            (None, _) => ObjectiveKind::Sft,
            (Some(_), None) => ObjectiveKind::OffPolicy,
            (Some(_), Some(_)) => ObjectiveKind::OnPolicy,
        }
    }

    /// The config, built as a [`Config`] value and validated for its command.
    pub fn config(&self) -> Result<Config> {
        let t = self.train;
        let mut c = Config::default();
        c.policy.model_name = self.model.to_path_buf();
        c.policy.max_total_sequence_length = 128;
        c.policy.train_micro_batch_size = t.micro_batch;
        // The demo runs one process: whole micro-batches summed in order (`"auto"`'s shards, which
        // keep 2 to 8 processes exact, would cut each step into smaller passes).
        c.policy.data_parallel.virtual_shards = VirtualShards::Fixed(0);
        let o = &mut c.policy.optimizer;
        (o.lr, o.min_lr, o.weight_decay) = (t.lr, t.min_lr, 0.0);
        (o.warmup_steps, o.max_grad_norm) = (t.warmup_steps, 1.0);
        o.schedule = LrSchedule::Cosine;
        if let Some(d) = &self.distill {
            c.teacher.urls = vec![d.teacher_url.to_string()];
            c.teacher.k = d.k;
            c.teacher.max_wait_s = 120.0;
            c.loss = Some(toml::from_str(&format!("kd = {{ type = \"{}\" }}", d.kd))?);
            c.checkpointing.cache_dir = Some(d.cache_dir.to_path_buf());
        }
        c.data.train_path = self.data.to_path_buf();
        c.data.prompt_field = Some("prompt".into());
        if self.prompts_only {
            c.data.prompts_only = true;
        } else {
            c.data.completion_field = Some("completion".into());
        }
        let d = &mut c.distillation;
        (d.num_prompts_per_step, d.max_num_steps) = (t.prompts_per_step, t.steps);
        (d.max_num_epochs, d.seed) = (1000, self.seed);
        c.checkpointing.enabled = true;
        c.checkpointing.checkpoint_dir = self.out.to_path_buf();
        c.checkpointing.save_period = self.save_period;
        c.checkpointing.keep_top_k = Some(1_000_000);
        c.logger.log_every = 10;
        c.logger.progress_bar = true;
        if let Some(r) = &self.rollouts {
            c.on_policy.lambda = 1.0;
            c.on_policy.include_prompt = false;
            c.on_policy.generation = GenerationConfig {
                max_new_tokens: r.max_new_tokens,
                temperature: r.temperature,
                num_generations: 1,
                stop_strings: vec!["\n\n".into(), "\nQ:".into()],
                ..GenerationConfig::default()
            };
        }
        c.validate_for(self.objective())?;
        Ok(c)
    }

    /// Writes the config file (TOML) to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = format!(
            "# Generated by `trainer demo`.\n{}",
            self.config()?.to_toml_string()?
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }
}

/// `trainer sft` from `init` on `train` with `dir/sft.toml` (written here), checkpoints and the
/// final model under `dir/run/`; returns the trainer's JSON summary.
pub(crate) fn sft_run(
    dir: &Path,
    init: &Path,
    train: &Path,
    t: &TrainSpec,
    seed: u64,
) -> Result<serde_json::Value> {
    let cfg = dir.join("sft.toml");
    RunConfig {
        model: init,
        data: train,
        out: &dir.join("run"),
        train: t,
        save_period: t.steps,
        seed,
        distill: None,
        rollouts: None,
        prompts_only: false,
    }
    .write(&cfg)?;
    run_trainer("sft", &cfg, &[])
}

/// The `seconds` of a trainer's JSON summary (0 when absent).
pub(crate) fn seconds_of(v: &serde_json::Value) -> f64 {
    v.get("seconds").and_then(|s| s.as_f64()).unwrap_or(0.0)
}

/// The `steps` of a trainer's JSON summary (0 when absent).
pub(crate) fn steps_of(v: &serde_json::Value) -> u64 {
    v.get("steps").and_then(|s| s.as_u64()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SFT configs name no teacher and no loss; distillation ones do, on-policy with its
    /// rollouts on prompts only; every file reads back to the value it was built as.
    #[test]
    fn run_configs_are_config_values_that_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let t = TrainSpec {
            steps: 4,
            prompts_per_step: 4,
            micro_batch: 4,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 1,
        };
        let run = |distill, rollouts, prompts_only| RunConfig {
            model: Path::new("/models/student"),
            data: Path::new("/data/train.jsonl"),
            out: Path::new("/runs/x"),
            train: &t,
            save_period: 2,
            seed: 3,
            distill,
            rollouts,
            prompts_only,
        };
        let d = Distill {
            teacher_url: "http://127.0.0.1:9",
            k: 4,
            kd: "reverse_kl",
            cache_dir: Path::new("/runs/teacher_cache"),
        };
        let r = Rollouts {
            max_new_tokens: 6,
            temperature: 0.5,
        };
        for (rc, objective) in [
            (run(None, None, false), ObjectiveKind::Sft),
            (run(Some(d), None, false), ObjectiveKind::OffPolicy),
            (run(Some(d), Some(r), true), ObjectiveKind::OnPolicy),
        ] {
            assert_eq!(rc.objective(), objective);
            let c = rc.config().unwrap();
            let path = dir.path().join("run.toml");
            rc.write(&path).unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            assert_eq!(Config::from_toml_str(&text, &path).unwrap(), c);
            let sft = objective == ObjectiveKind::Sft;
            assert_eq!(c.teacher.urls.is_empty(), sft, "{objective:?}");
            assert_eq!(c.loss.is_none(), sft, "{objective:?}");
            assert_eq!(c.data.prompts_only, objective == ObjectiveKind::OnPolicy);
            assert_eq!(c.data.completion_field.is_none(), c.data.prompts_only);
            assert_eq!(c.distillation.max_num_steps, 4);
            assert_eq!(c.checkpointing.save_period, 2);
        }
    }
}
