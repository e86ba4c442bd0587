//! The off-policy trainer's TOML configuration, with sections modelled on NeMo RL's
//! (`policy`, `teacher`, `loss`, `data`, `distillation`, `checkpointing`, `logger`).
//!
//! Every section and key has a default except the ones a run cannot guess (the student, the data,
//! the teacher URLs), which may also come from the command line ([`OffPolicyArgs`]). Relative
//! paths in a file resolve against the file's directory; paths on the command line against the
//! working directory. `docs/training.md` is the reference for every key.

use crate::loss::LossConfig;
use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Duration;
use xdistill_shared::model::{Activations, Decoder};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A constraint on one key failed; `key` is its dotted path (e.g. `teacher.k`).
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub policy: PolicyConfig,
    #[serde(default)]
    pub teacher: TeacherConfig,
    /// `[[teachers]]`: several teacher services, each with a `name` (routed per record or
    /// mixed, `distillation.teachers`); `[teacher]` is the one-teacher shorthand.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teachers: Vec<TeacherConfig>,
    /// `[loss]`, required by the distillation objectives (SFT has none; an empty table is none).
    #[serde(default, deserialize_with = "loss_section")]
    pub loss: Option<LossConfig>,
    /// `[loss_cross]`: the loss of teachers whose tokenizer differs from the student's, when
    /// `[loss]` is a same-tokenizer loss (routing among same- and cross-tokenizer teachers);
    /// absent: `[loss]` for every teacher.
    #[serde(
        default,
        deserialize_with = "loss_section",
        skip_serializing_if = "Option::is_none"
    )]
    pub loss_cross: Option<LossConfig>,
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub distillation: DistillationConfig,
    #[serde(default)]
    pub checkpointing: CheckpointingConfig,
    #[serde(default)]
    pub logger: LoggerConfig,
    /// `[on_policy]`: used by `trainer on-policy` only.
    #[serde(default)]
    pub on_policy: OnPolicyConfig,
}

/// `[on_policy]`: the student samples completions of the data's prompts and the teacher scores them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnPolicyConfig {
    /// Share of steps that are on-policy (drawn per step from the run's seeded RNG); the others
    /// train off-policy on the data's own prompt + completion (TRL GKD's λ).
    pub lambda: f64,
    /// Also train on the prompt's positions (scored by the teacher); default: completion only.
    pub include_prompt: bool,
    /// Sampling settings (see docs/evaluation.md).
    pub generation: crate::generate::GenerationConfig,
}

impl Default for OnPolicyConfig {
    fn default() -> Self {
        OnPolicyConfig {
            lambda: 1.0,
            include_prompt: false,
            generation: crate::generate::GenerationConfig {
                max_new_tokens: 64,
                stop_strings: vec!["\n\n".into(), "\nQ:".into()],
                ..Default::default()
            },
        }
    }
}

/// `[policy]`: the student model and how it is trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Student model directory in Hugging Face layout (`trainer init-model` makes one).
    pub model_name: PathBuf,
    /// Student tokenizer; default `<model_name>/tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// Longest tokenized sequence (student tokens); longer records are skipped (or truncated
    /// with `data.truncate`).
    pub max_total_sequence_length: usize,
    /// Compute dtype: `auto` (bf16 on a GPU, f32 on the CPU), f32, bf16 or f16 (master weights
    /// stay f32 either way).
    pub precision: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Sequences per forward/backward pass; a step accumulates gradients over
    /// `ceil(num_prompts_per_step / train_micro_batch_size)` micro-batches.
    pub train_micro_batch_size: usize,
    /// Abort the run after this many consecutive steps with a non-finite gradient norm (each
    /// is skipped); 0: never abort.
    pub max_nonfinite_steps: u64,
    /// Whether the training forward keeps every activation or only each layer's input
    /// (recomputing layers in the backward): `"auto"`, `true` or `false`.
    pub activation_checkpointing: ActivationCheckpointing,
    pub optimizer: OptimizerConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            model_name: PathBuf::new(),
            tokenizer: None,
            max_total_sequence_length: 1024,
            precision: "auto".into(),
            device: "cpu".into(),
            train_micro_batch_size: 4,
            max_nonfinite_steps: 10,
            activation_checkpointing: ActivationCheckpointing::Auto,
            optimizer: OptimizerConfig::default(),
        }
    }
}

/// `policy.activation_checkpointing`: how the student's training forward keeps what its
/// backward needs. Checkpointing keeps each decoder layer's input only and recomputes the layer
/// in the backward (memory linear in the sequence, about one extra forward of compute).
/// TOML: `true`, `false` or `"auto"` (the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationCheckpointing {
    /// Checkpoint a micro-batch when plain autograd would keep more than 1 GiB
    /// ([`Activations::auto`]); tiny models keep everything.
    #[default]
    Auto,
    /// Always checkpoint.
    On,
    /// Never: plain autograd (every intermediate lives until the backward).
    Off,
}

impl ActivationCheckpointing {
    /// The way `model` keeps activations for a micro-batch of `b` rows of `t` tokens.
    pub fn resolve(self, model: &Decoder, b: usize, t: usize) -> Activations {
        match self {
            ActivationCheckpointing::Auto => Activations::auto(model, b, t),
            ActivationCheckpointing::On => Activations::Checkpoint,
            ActivationCheckpointing::Off => Activations::Keep,
        }
    }

    /// From the command line's `auto`, `on`/`true` or `off`/`false`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" | "true" => Ok(Self::On),
            "off" | "false" => Ok(Self::Off),
            _ => Err(format!(
                "activation checkpointing must be auto, on or off, got {s:?}"
            )),
        }
    }
}

impl Serialize for ActivationCheckpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ActivationCheckpointing::Auto => s.serialize_str("auto"),
            ActivationCheckpointing::On => s.serialize_bool(true),
            ActivationCheckpointing::Off => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for ActivationCheckpointing {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const WANT: &str = "policy.activation_checkpointing must be true, false or \"auto\"";
        impl serde::de::Visitor<'_> for V {
            type Value = ActivationCheckpointing;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(WANT)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(if v {
                    ActivationCheckpointing::On
                } else {
                    ActivationCheckpointing::Off
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "auto" => Ok(ActivationCheckpointing::Auto),
                    _ => Err(E::custom(format!("{WANT}, got {v:?}"))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Shape of the learning rate after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Constant,
    Linear,
    /// Cosine decay from `lr` to `min_lr` at `max_num_steps`.
    #[default]
    Cosine,
}

/// `[policy.optimizer]`: AdamW with warm-up, decay and gradient clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub lr: f64,
    pub min_lr: f64,
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Linear warm-up from 0 to `lr` over this many steps.
    pub warmup_steps: u64,
    pub schedule: LrSchedule,
    /// Clip the global gradient L2 norm to this; absent or 0 disables clipping.
    pub max_grad_norm: Option<f64>,
    /// Also apply weight decay to 1-D parameters (norm weights, biases).
    pub decay_1d: bool,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            lr: 1e-4,
            min_lr: 0.0,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
            warmup_steps: 0,
            schedule: LrSchedule::Cosine,
            max_grad_norm: Some(1.0),
            decay_1d: false,
        }
    }
}

/// `[teacher]`: where the teacher server is and how to ask it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherConfig {
    /// The teacher's name: records name it in `data.teacher_field`, its metrics carry it
    /// (`teacher/<name>/kd`). Required in `[[teachers]]`; `[teacher]` is named `teacher`.
    pub name: Option<String>,
    /// Its share of an ensemble's mixture (`distillation.teachers = "ensemble"`; the weights
    /// are normalised over the teachers).
    pub weight: f64,
    /// Base URLs of teacher replicas, used round-robin (`--teacher-url` replaces the list).
    pub urls: Vec<String>,
    /// Top-k entries per position.
    pub k: usize,
    /// Temperature applied by the teacher (and to the student's logits by the loss).
    pub temperature: f32,
    /// Whole-request timeout, seconds.
    pub timeout_s: f64,
    pub connect_timeout_s: f64,
    /// How long a request keeps retrying (with capped backoff) while the teacher is away, before
    /// the run fails. Steps are never skipped: the step waits.
    pub max_wait_s: f64,
    /// Optional cap on attempts per request (absent: limited by `max_wait_s` only).
    pub max_attempts: Option<u32>,
    pub backoff_initial_s: f64,
    pub backoff_max_s: f64,
    /// Name of the environment variable holding the API key (sent as `Authorization: Bearer`).
    pub api_key_env: Option<String>,
    /// How many batches' teacher results are fetched ahead of the training step (≥ 1).
    pub prefetch: usize,
    /// Teacher tokenizer file; default: fetched from the server's `/tokenizer.json` and cached
    /// under `<checkpoint_dir>/teacher_tokenizer/<sha256>/`.
    pub tokenizer: Option<PathBuf>,
}

impl Default for TeacherConfig {
    fn default() -> Self {
        TeacherConfig {
            name: None,
            weight: 1.0,
            urls: Vec::new(),
            k: 64,
            temperature: 1.0,
            timeout_s: 300.0,
            connect_timeout_s: 10.0,
            max_wait_s: 1800.0,
            max_attempts: None,
            backoff_initial_s: 0.5,
            backoff_max_s: 30.0,
            api_key_env: None,
            prefetch: 1,
            tokenizer: None,
        }
    }
}

impl TeacherConfig {
    /// `urls`, parsed (the error names the offending entry).
    pub fn parsed_urls(&self) -> Result<Vec<reqwest::Url>, ConfigError> {
        self.urls
            .iter()
            .enumerate()
            .map(|(i, u)| parse_base_url(u).map_err(|m| invalid(&format!("teacher.urls[{i}]"), m)))
            .collect()
    }

    /// The API key, read from the environment variable named by `api_key_env`.
    pub fn api_key(&self) -> Result<Option<String>, ConfigError> {
        match &self.api_key_env {
            None => Ok(None),
            Some(var) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => Ok(Some(v)),
                _ => Err(invalid(
                    "teacher.api_key_env",
                    format!("environment variable {var} is not set"),
                )),
            },
        }
    }
}

/// File format of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// `jsonl` for `.jsonl`/`.json` files, `text` otherwise.
    #[default]
    Auto,
    /// One JSON object per line.
    Jsonl,
    /// Plain text; documents are separated by blank lines.
    Text,
}

/// `[data]`: the training text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    pub train_path: PathBuf,
    /// A separate validation file; when absent, a split of `train_path` (see `val_fraction`).
    pub val_path: Option<PathBuf>,
    pub format: DataFormat,
    /// JSONL field holding the whole text (loss on every token).
    pub text_field: String,
    /// JSONL prompt and completion fields; when both are set they replace `text_field`.
    pub prompt_field: Option<String>,
    pub completion_field: Option<String>,
    /// Records are prompts alone (`prompt_field`; a completion field is not read even when the
    /// file has one): unlabelled prompts for `trainer on-policy` with `lambda = 1`, the only
    /// objective that needs no completion. SFT and off-policy refuse it.
    pub prompts_only: bool,
    /// Appended to the prompt, between prompt and completion (e.g. "\n").
    pub separator: String,
    /// With prompt/completion records: loss on the completion's tokens only.
    pub completion_only_loss: bool,
    /// Held-out fraction of `train_path` for validation (ignored with `val_path` or `val_count`).
    pub val_fraction: f64,
    /// Held-out number of records (wins over `val_fraction`).
    pub val_count: Option<usize>,
    /// Records longer than this many bytes are skipped.
    pub max_record_bytes: usize,
    /// Truncate records over the token limits (both tokenizations at one chunk boundary of
    /// their alignment) instead of skipping them.
    pub truncate: bool,
    pub shuffle: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    /// JSONL field naming each record's teacher (a `[[teachers]]` name) when
    /// `distillation.teachers = "route"`.
    pub teacher_field: Option<String>,
    /// The teacher of records without `teacher_field` (or naming no configured teacher); absent:
    /// such records are an error at start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_teacher: Option<String>,
    /// Drop an epoch's last batch when it is smaller than `num_prompts_per_step`.
    pub drop_last: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train_path: PathBuf::new(),
            val_path: None,
            format: DataFormat::Auto,
            text_field: "text".into(),
            prompt_field: None,
            completion_field: None,
            prompts_only: false,
            separator: String::new(),
            completion_only_loss: true,
            val_fraction: 0.0,
            val_count: None,
            max_record_bytes: 1 << 20,
            truncate: false,
            shuffle: true,
            teacher_field: None,
            default_teacher: None,
            drop_last: false,
        }
    }
}

/// `[distillation]`: the run's length and cadence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillationConfig {
    /// Records per optimizer step (global batch).
    pub num_prompts_per_step: usize,
    /// The run stops after this many steps or `max_num_epochs` epochs, whichever comes first.
    pub max_num_steps: u64,
    pub max_num_epochs: u64,
    /// Seeds data shuffling, the validation split and the trainer's RNG.
    pub seed: u64,
    /// Validate every this many steps (0: never, except at start/end).
    pub val_period: u64,
    pub val_at_start: bool,
    pub val_at_end: bool,
    /// Cap on validation records used per validation (absent: all).
    pub max_val_samples: Option<usize>,
    /// With several `[[teachers]]`: each record learns from the teacher it names (`route`), or
    /// from the weighted mixture of all of them (`ensemble`).
    pub teachers: TeacherMode,
}

/// How a student learns from several teachers (`distillation.teachers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TeacherMode {
    /// Each record from the teacher named by `data.teacher_field` (or `data.default_teacher`).
    #[default]
    Route,
    /// Every record from the weighted mixture of the teachers' distributions
    /// (docs/losses.md, "Ensembles").
    Ensemble,
}

impl Default for DistillationConfig {
    fn default() -> Self {
        DistillationConfig {
            num_prompts_per_step: 8,
            max_num_steps: 1000,
            max_num_epochs: 1,
            seed: 42,
            val_period: 0,
            val_at_start: false,
            val_at_end: false,
            max_val_samples: None,
            teachers: TeacherMode::Route,
        }
    }
}

/// `[checkpointing]`: where the run writes and what it keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointingConfig {
    pub enabled: bool,
    /// The run's output directory: `step_N/`, `final/`, `metrics.jsonl` (`--output` overrides).
    pub checkpoint_dir: PathBuf,
    /// Save every this many steps (the last step is always saved when enabled).
    pub save_period: u64,
    /// Keep this many checkpoints (absent: all). The newest is always kept.
    pub keep_top_k: Option<usize>,
    /// Rank checkpoints by this metric (from `trainer_state.json`'s `metrics`) instead of by step.
    pub metric_name: Option<String>,
    pub higher_is_better: bool,
    /// With `--resume`, start over from step 0 on purpose when nothing valid is left to resume
    /// from although a previous run left traces (`step_N.corrupt/`, a non-empty
    /// `metrics.jsonl`); without it such a resume is an error. The old `metrics.jsonl` is set
    /// aside, never appended to (`--start-fresh`, or `--set checkpointing.start_fresh=true`).
    pub start_fresh: bool,
}

impl Default for CheckpointingConfig {
    fn default() -> Self {
        CheckpointingConfig {
            enabled: true,
            checkpoint_dir: PathBuf::from("runs/off_policy"),
            save_period: 100,
            keep_top_k: Some(3),
            metric_name: None,
            higher_is_better: false,
            start_fresh: false,
        }
    }
}

/// `[logger]`: console output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggerConfig {
    /// Write a log line every this many steps (also when the progress bar is hidden).
    pub log_every: u64,
    /// Show a progress bar (hidden anyway when stderr is not a terminal or `CI` is set).
    pub progress_bar: bool,
}

impl Default for LoggerConfig {
    fn default() -> Self {
        LoggerConfig {
            log_every: 10,
            progress_bar: true,
        }
    }
}

/// `trainer off-policy`: flags override the config file.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct OffPolicyArgs {
    /// TOML configuration file (see configs/ and docs/training.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Teacher server base URL; repeat for several replicas (replaces `teacher.urls`).
    #[arg(long = "teacher-url")]
    pub teacher_url: Vec<String>,
    /// Student model directory (replaces `policy.model_name`).
    #[arg(long)]
    pub student: Option<PathBuf>,
    /// Training data file (replaces `data.train_path`); `--prompts` for on-policy runs.
    #[arg(long, visible_alias = "prompts")]
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
    /// With `--resume`: start from step 0 on purpose when the output directory holds only a
    /// previous run's traces (corrupt checkpoints, old metrics) and nothing valid to resume
    /// (`checkpointing.start_fresh`).
    #[arg(long, requires = "resume")]
    pub start_fresh: bool,
    /// Set any key: `--set policy.optimizer.lr=3e-5` (value in TOML syntax; bare words are
    /// strings). Applied after the file, before the other flags.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

impl Config {
    /// Parses TOML text; relative paths stay as written.
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Reads a file, resolves its relative paths against its directory and validates it.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let c = Self::read_unvalidated(path, &[])?;
        c.validate()?;
        Ok(c)
    }

    /// Reads the file named by `args.config`, applies `--set` then the other flags, validates.
    pub fn load(args: &OffPolicyArgs) -> Result<Config, ConfigError> {
        let mut c = Self::read_unvalidated(&args.config, &args.set)?;
        c.apply_overrides(args)?;
        c.validate()?;
        Ok(c)
    }

    fn read_unvalidated(path: &Path, sets: &[String]) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        for s in sets {
            apply_set(&mut table, s)?;
        }
        let mut c: Config =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        c.resolve_paths(base);
        Ok(c)
    }

    /// Makes every relative path absolute-ish by joining it to `base` (empty paths stay empty).
    pub fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if !p.as_os_str().is_empty() && p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.policy.model_name);
        if let Some(t) = &mut self.policy.tokenizer {
            fix(t);
        }
        for t in std::iter::once(&mut self.teacher).chain(self.teachers.iter_mut()) {
            if let Some(tok) = &mut t.tokenizer {
                fix(tok);
            }
        }
        fix(&mut self.data.train_path);
        if let Some(v) = &mut self.data.val_path {
            fix(v);
        }
        fix(&mut self.checkpointing.checkpoint_dir);
    }

    /// Applies the command-line flags (paths relative to the working directory).
    pub fn apply_overrides(&mut self, a: &OffPolicyArgs) -> Result<(), ConfigError> {
        if !a.teacher_url.is_empty() {
            if !self.teachers.is_empty() {
                return Err(invalid(
                    "teachers",
                    "--teacher-url sets the one teacher of [teacher]; with [[teachers]], set \
                     each entry's urls in the config (or with --set)",
                ));
            }
            self.teacher.urls = a.teacher_url.clone();
        }
        if let Some(s) = &a.student {
            self.policy.model_name = s.clone();
        }
        if let Some(d) = &a.data {
            self.data.train_path = d.clone();
        }
        if let Some(o) = &a.output {
            self.checkpointing.checkpoint_dir = o.clone();
        }
        if let Some(n) = a.max_steps {
            self.distillation.max_num_steps = n;
        }
        if a.start_fresh {
            self.checkpointing.start_fresh = true;
        }
        Ok(())
    }

    /// Checks every constraint: each section its own ([`Validate`]), then the ones that span
    /// sections. The error names the offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.policy.validate()?;
        self.validate_teachers()?;
        for (name, loss) in [("loss", &self.loss), ("loss_cross", &self.loss_cross)] {
            if let Some(loss) = loss {
                loss.validate().map_err(|e| match e {
                    crate::loss::LossError::Config { field, message } => {
                        invalid(&format!("{name}.{field}"), message)
                    }
                    other => invalid(name, other.to_string()),
                })?;
            }
        }
        if let Some(lc) = &self.loss_cross {
            if self.loss.is_none() {
                return Err(invalid("loss_cross", "needs a [loss] section beside it"));
            }
            if !lc.kd.works_across_tokenizers() {
                return Err(invalid(
                    "loss_cross.kd",
                    format!("{:?} does not work across tokenizers (first_kl, pkl, gold, alm, sampled_kl do)", lc.kd),
                ));
            }
            if self
                .loss
                .as_ref()
                .is_some_and(|l| (l.temperature - lc.temperature).abs() > 1e-6)
            {
                return Err(invalid(
                    "loss_cross.temperature",
                    "must equal loss.temperature (one teacher temperature)",
                ));
            }
        }
        self.data.validate()?;
        self.distillation.validate()?;
        self.checkpointing.validate()?;
        self.logger.validate()?;
        self.check_across_sections()
    }

    /// `[teacher]` or `[[teachers]]` (not both), each entry valid, names unique, and the routing
    /// keys naming teachers that exist.
    fn validate_teachers(&self) -> Result<(), ConfigError> {
        if self.teachers.is_empty() {
            self.teacher.validate()?;
        } else if self.teacher != TeacherConfig::default() {
            return Err(invalid(
                "teacher",
                "both [teacher] and [[teachers]] are set: list every teacher under [[teachers]] \
                 ([teacher] is the one-teacher shorthand)",
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, t) in self.teachers.iter().enumerate() {
            let at = |e: ConfigError| match e {
                ConfigError::Invalid { key, message } => ConfigError::Invalid {
                    key: key.replacen("teacher", &format!("teachers[{i}]"), 1),
                    message,
                },
                other => other,
            };
            match t.name.as_deref() {
                None | Some("") => {
                    return Err(invalid(
                        &format!("teachers[{i}].name"),
                        "every [[teachers]] entry needs a name",
                    ))
                }
                Some(n) if !names.insert(n) => {
                    return Err(invalid(
                        &format!("teachers[{i}].name"),
                        format!("duplicate teacher name {n:?}"),
                    ))
                }
                Some(_) => {}
            }
            t.validate().map_err(at)?;
        }
        let list = self.teacher_list();
        let known = || {
            list.iter()
                .map(|(n, _)| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(d) = &self.data.default_teacher {
            if !list.iter().any(|(n, _)| n == d) {
                return Err(invalid(
                    "data.default_teacher",
                    format!("no teacher is named {d:?} (teachers: {})", known()),
                ));
            }
        }
        if self.data.teacher_field.as_deref() == Some("") {
            return Err(invalid("data.teacher_field", "must not be empty"));
        }
        let routed = self.distillation.teachers == TeacherMode::Route && list.len() > 1;
        if routed && self.data.teacher_field.is_none() && self.data.default_teacher.is_none() {
            return Err(invalid(
                "data.teacher_field",
                format!(
                    "distillation.teachers = \"route\" with {} teachers needs the field that \
                     names each record's teacher (or data.default_teacher)",
                    list.len()
                ),
            ));
        }
        Ok(())
    }

    /// The run's teachers with their names: the `[[teachers]]` entries, or `[teacher]` (named
    /// `teacher` unless it says otherwise).
    pub fn teacher_list(&self) -> Vec<(String, &TeacherConfig)> {
        if self.teachers.is_empty() {
            let name = self
                .teacher
                .name
                .clone()
                .unwrap_or_else(|| "teacher".into());
            vec![(name, &self.teacher)]
        } else {
            self.teachers
                .iter()
                .map(|t| (t.name.clone().unwrap_or_default(), t))
                .collect()
        }
    }

    /// The constraints between sections.
    fn check_across_sections(&self) -> Result<(), ConfigError> {
        // The loss divides the student's logits by its temperature; every teacher's must match.
        for (i, (name, t)) in self.teacher_list().into_iter().enumerate() {
            if let Some(lt) = self.loss.as_ref().map(|l| l.temperature) {
                if (lt - t.temperature as f64).abs() > 1e-6 {
                    let key = if self.teachers.is_empty() {
                        "teacher.temperature".to_string()
                    } else {
                        format!("teachers[{i}].temperature")
                    };
                    return Err(invalid(
                        &key,
                        format!(
                            "{} (teacher {name:?}) differs from loss.temperature = {lt}",
                            t.temperature
                        ),
                    ));
                }
            }
        }
        let (d, r) = (&self.data, &self.distillation);
        let has_val = d.val_path.is_some() || d.val_count.unwrap_or(0) > 0 || d.val_fraction > 0.0;
        if (r.val_period > 0 || r.val_at_start || r.val_at_end) && !has_val {
            return Err(invalid(
                "distillation.val_period",
                "validation is requested but there is no validation data \
                 (set data.val_path, data.val_fraction or data.val_count)",
            ));
        }
        Ok(())
    }

    /// `[loss]`, which the distillation objectives need.
    pub fn loss(&self) -> Result<&LossConfig, ConfigError> {
        self.loss.as_ref().ok_or_else(|| {
            invalid(
                "loss",
                "a distillation run needs a [loss] section (e.g. kd = { type = \"forward_kl\" })",
            )
        })
    }

    /// Teacher URLs, parsed.
    pub fn teacher_urls(&self) -> Result<Vec<reqwest::Url>, ConfigError> {
        self.teacher.parsed_urls()
    }

    /// The student tokenizer file.
    pub fn student_tokenizer(&self) -> PathBuf {
        self.policy
            .tokenizer
            .clone()
            .unwrap_or_else(|| self.policy.model_name.join("tokenizer.json"))
    }

    /// Where a teacher tokenizer fetched from the server is cached.
    pub fn teacher_tokenizer_cache(&self) -> PathBuf {
        self.checkpointing.checkpoint_dir.join("teacher_tokenizer")
    }

    /// sha256 (hex) of everything that determines the weights a run produces, so that a resume
    /// can warn when the config changed. Excludes run length, output location, validation
    /// cadence, logging and teacher connection settings.
    pub fn training_hash(&self) -> String {
        /// Name, k, temperature, weight.
        type HashedTeacher<'a> = (&'a Option<String>, usize, f32, f64);
        #[derive(Serialize)]
        struct Hashed<'a> {
            policy: &'a PolicyConfig,
            k: usize,
            temperature: f32,
            loss: &'a Option<LossConfig>,
            data: &'a DataConfig,
            num_prompts_per_step: usize,
            seed: u64,
            /// Several teachers: names, k, temperatures, weights and the mode (absent with one
            /// `[teacher]`, so its hash is unchanged).
            #[serde(skip_serializing_if = "Option::is_none")]
            teachers: Option<(TeacherMode, Vec<HashedTeacher<'a>>)>,
        }
        let h = Hashed {
            policy: &self.policy,
            k: self.teacher.k,
            temperature: self.teacher.temperature,
            loss: &self.loss,
            data: &self.data,
            num_prompts_per_step: self.distillation.num_prompts_per_step,
            seed: self.distillation.seed,
            teachers: (!self.teachers.is_empty()).then(|| {
                let list = self.teachers.iter();
                let t = list
                    .map(|t| (&t.name, t.k, t.temperature, t.weight))
                    .collect();
                (self.distillation.teachers, t)
            }),
        };
        let bytes = serde_json::to_vec(&h).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))
    }
}

impl TeacherConfig {
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_s)
    }
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.connect_timeout_s)
    }
    pub fn max_wait(&self) -> Duration {
        Duration::from_secs_f64(self.max_wait_s)
    }
    pub fn backoff_initial(&self) -> Duration {
        Duration::from_secs_f64(self.backoff_initial_s)
    }
    pub fn backoff_max(&self) -> Duration {
        Duration::from_secs_f64(self.backoff_max_s)
    }
}

impl DataConfig {
    /// The format of `path`, with `auto` resolved from the file extension.
    pub fn resolved_format(&self, path: &Path) -> DataFormat {
        self.format.resolve(path)
    }
}

impl DataFormat {
    /// `Jsonl` or `Text`: `Auto` becomes `Jsonl` for `.jsonl`/`.json`/`.ndjson` files.
    pub fn resolve(self, path: &Path) -> DataFormat {
        match self {
            DataFormat::Auto => match path.extension().and_then(|e| e.to_str()) {
                Some("jsonl") | Some("json") | Some("ndjson") => DataFormat::Jsonl,
                _ => DataFormat::Text,
            },
            f => f,
        }
    }
}

/// A config section that checks its own constraints; the error names the offending key.
pub trait Validate {
    fn validate(&self) -> Result<(), ConfigError>;
}

impl Validate for PolicyConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let p = self;
        if p.model_name.as_os_str().is_empty() {
            return Err(invalid(
                "policy.model_name",
                "the student model directory is required (or --student)",
            ));
        }
        if xdistill_shared::gguf::is_gguf(&p.model_name) {
            return Err(invalid(
                "policy.model_name",
                format!(
                    "{} is a GGUF file: a student is trained from a Hugging Face model directory \
                     (config.json, safetensors, tokenizer.json); GGUF files load for inference \
                     only (the teacher, `trainer eval`)",
                    p.model_name.display()
                ),
            ));
        }
        if p.max_total_sequence_length < 2 {
            return Err(invalid(
                "policy.max_total_sequence_length",
                "must be at least 2",
            ));
        }
        xdistill_shared::device::check_dtype(&p.precision)
            .map_err(|e| invalid("policy.precision", e.to_string()))?;
        if !is_device_name(&p.device) {
            return Err(invalid(
                "policy.device",
                format!("{:?} is not cpu, cuda or cuda:N", p.device),
            ));
        }
        if p.train_micro_batch_size == 0 {
            return Err(invalid(
                "policy.train_micro_batch_size",
                "must be at least 1",
            ));
        }
        let o = &p.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return Err(invalid("policy.optimizer.lr", "must be positive"));
        }
        if !(o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
            return Err(invalid("policy.optimizer.min_lr", "must be in [0, lr]"));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err(invalid("policy.optimizer.weight_decay", "must be >= 0"));
        }
        if o.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return Err(invalid(
                "policy.optimizer.betas",
                "each beta must be in [0, 1)",
            ));
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            return Err(invalid("policy.optimizer.eps", "must be positive"));
        }
        if let Some(g) = o.max_grad_norm {
            if !(g.is_finite() && g >= 0.0) {
                return Err(invalid("policy.optimizer.max_grad_norm", "must be >= 0"));
            }
        }

        Ok(())
    }
}

impl Validate for TeacherConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let t = self;
        if t.urls.is_empty() {
            return Err(invalid(
                "teacher.urls",
                "at least one teacher URL is required (or --teacher-url)",
            ));
        }
        t.parsed_urls()?;
        if t.k == 0 {
            return Err(invalid("teacher.k", "must be at least 1"));
        }
        if !(t.temperature.is_finite() && t.temperature > 0.0) {
            return Err(invalid("teacher.temperature", "must be positive"));
        }
        for (key, v) in [
            ("teacher.timeout_s", t.timeout_s),
            ("teacher.connect_timeout_s", t.connect_timeout_s),
            ("teacher.backoff_initial_s", t.backoff_initial_s),
            ("teacher.backoff_max_s", t.backoff_max_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(key, "must be a positive number of seconds"));
            }
        }
        if !(t.max_wait_s.is_finite() && t.max_wait_s >= 0.0) {
            return Err(invalid("teacher.max_wait_s", "must be >= 0 seconds"));
        }
        if t.backoff_max_s < t.backoff_initial_s {
            return Err(invalid(
                "teacher.backoff_max_s",
                "must be >= backoff_initial_s",
            ));
        }
        if t.max_attempts == Some(0) {
            return Err(invalid("teacher.max_attempts", "must be at least 1"));
        }
        if t.prefetch == 0 {
            return Err(invalid("teacher.prefetch", "must be at least 1"));
        }
        if !(t.weight.is_finite() && t.weight > 0.0) {
            return Err(invalid("teacher.weight", "must be a positive number"));
        }
        Ok(())
    }
}

impl Validate for DataConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let d = self;
        if d.train_path.as_os_str().is_empty() {
            return Err(invalid(
                "data.train_path",
                "the training data file is required (or --data)",
            ));
        }
        match (&d.prompt_field, &d.completion_field) {
            (None, _) if d.prompts_only => {
                return Err(invalid(
                    "data.prompt_field",
                    "required with data.prompts_only = true",
                ))
            }
            (Some(_), None) if d.prompts_only => {}
            (Some(_), None) => {
                return Err(invalid(
                    "data.completion_field",
                    "required with data.prompt_field",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "data.prompt_field",
                    "required with data.completion_field",
                ))
            }
            _ => {}
        }
        if d.text_field.is_empty() {
            return Err(invalid("data.text_field", "must not be empty"));
        }
        if !(d.val_fraction.is_finite() && (0.0..1.0).contains(&d.val_fraction)) {
            return Err(invalid("data.val_fraction", "must be in [0, 1)"));
        }
        if d.max_record_bytes == 0 {
            return Err(invalid("data.max_record_bytes", "must be at least 1"));
        }
        Ok(())
    }
}

impl Validate for DistillationConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let r = self;
        if r.num_prompts_per_step == 0 {
            return Err(invalid(
                "distillation.num_prompts_per_step",
                "must be at least 1",
            ));
        }
        if r.max_num_steps == 0 {
            return Err(invalid("distillation.max_num_steps", "must be at least 1"));
        }
        if r.max_num_epochs == 0 {
            return Err(invalid("distillation.max_num_epochs", "must be at least 1"));
        }
        Ok(())
    }
}

impl Validate for CheckpointingConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let c = self;
        if c.checkpoint_dir.as_os_str().is_empty() {
            return Err(invalid("checkpointing.checkpoint_dir", "must not be empty"));
        }
        if c.enabled && c.save_period == 0 {
            return Err(invalid("checkpointing.save_period", "must be at least 1"));
        }
        if c.keep_top_k == Some(0) {
            return Err(invalid(
                "checkpointing.keep_top_k",
                "must be at least 1 (or absent to keep all)",
            ));
        }
        Ok(())
    }
}

impl Validate for LoggerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.log_every == 0 {
            return Err(invalid("logger.log_every", "must be at least 1"));
        }
        Ok(())
    }
}

/// `[loss]` as typed config; an absent or empty table is none.
fn loss_section<'de, D: Deserializer<'de>>(d: D) -> Result<Option<LossConfig>, D::Error> {
    let table = toml::Table::deserialize(d)?;
    if table.is_empty() {
        return Ok(None);
    }
    toml::Value::Table(table)
        .try_into()
        .map(Some)
        .map_err(|e: toml::de::Error| serde::de::Error::custom(format!("[loss]: {}", e.message())))
}

fn is_device_name(s: &str) -> bool {
    s == "cpu"
        || s == "cuda"
        || s.strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Parses a teacher base URL (http or https, no query).
pub fn parse_base_url(s: &str) -> Result<reqwest::Url, String> {
    let u = reqwest::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if u.scheme() != "http" && u.scheme() != "https" {
        return Err(format!("{s:?}: scheme must be http or https"));
    }
    if u.host_str().is_none() {
        return Err(format!("{s:?}: no host"));
    }
    Ok(u)
}

/// Applies one `key.path=value` assignment to a TOML table. The value is parsed as TOML
/// (`3e-5`, `true`, `"x"`, `[1, 2]`); anything that does not parse is taken as a string.
fn apply_set(table: &mut toml::Table, assignment: &str) -> Result<(), ConfigError> {
    let (key, raw) = assignment
        .split_once('=')
        .ok_or_else(|| invalid(assignment, "--set expects KEY=VALUE"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if key.is_empty() || parts.iter().any(|p| p.is_empty()) {
        return Err(invalid(key, "--set: empty key"));
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut cur = table;
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            cur.insert(part.to_string(), value);
            return Ok(());
        }
        let entry = cur
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(invalid(&parts[..=i].join("."), "--set: not a table")),
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        [policy]
        model_name = "student"
        [teacher]
        urls = ["http://127.0.0.1:8000"]
        [data]
        train_path = "data/train.jsonl"
    "#;

    fn write(dir: &Path, text: &str) -> PathBuf {
        let p = dir.join("c.toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn activation_checkpointing_takes_a_bool_or_auto() {
        let dir = tempfile::tempdir().unwrap();
        let c = Config::from_file(&write(dir.path(), MINIMAL)).unwrap();
        assert_eq!(
            c.policy.activation_checkpointing,
            ActivationCheckpointing::Auto
        );
        for (v, want) in [
            ("true", ActivationCheckpointing::On),
            ("false", ActivationCheckpointing::Off),
            ("\"auto\"", ActivationCheckpointing::Auto),
        ] {
            let text = MINIMAL.replace(
                "[policy]\n",
                &format!("[policy]\nactivation_checkpointing = {v}\n"),
            );
            let c = Config::from_file(&write(dir.path(), &text)).unwrap();
            assert_eq!(c.policy.activation_checkpointing, want, "{v}");
        }
        for bad in ["\"yes\"", "1"] {
            let text = MINIMAL.replace(
                "[policy]\n",
                &format!("[policy]\nactivation_checkpointing = {bad}\n"),
            );
            let e = Config::from_file(&write(dir.path(), &text))
                .unwrap_err()
                .to_string();
            assert!(e.contains("activation_checkpointing"), "{bad}: {e}");
        }
    }

    #[test]
    fn defaults_fill_everything_else() {
        let dir = tempfile::tempdir().unwrap();
        let c = Config::from_file(&write(dir.path(), MINIMAL)).unwrap();
        assert_eq!(c.teacher.k, 64);
        assert_eq!(c.distillation, DistillationConfig::default());
        assert_eq!(c.policy.optimizer, OptimizerConfig::default());
        assert!(c.loss.is_none());
        // Relative paths resolve against the config's directory.
        assert_eq!(c.policy.model_name, dir.path().join("student"));
        assert_eq!(c.data.train_path, dir.path().join("data/train.jsonl"));
        assert_eq!(
            c.checkpointing.checkpoint_dir,
            dir.path().join("runs/off_policy")
        );
        assert_eq!(
            c.student_tokenizer(),
            dir.path().join("student/tokenizer.json")
        );
        assert_eq!(
            c.data.resolved_format(&c.data.train_path),
            DataFormat::Jsonl
        );
        assert_eq!(c.data.resolved_format(Path::new("a.txt")), DataFormat::Text);
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let args = OffPolicyArgs {
            config: write(dir.path(), MINIMAL),
            teacher_url: vec!["http://a:1".into(), "http://b:2/".into()],
            student: Some("cli_student".into()),
            data: Some("cli.txt".into()),
            output: Some("out".into()),
            max_steps: Some(7),
            resume: true,
            start_fresh: false,
            set: vec![
                "policy.optimizer.lr=3e-5".into(),
                "loss.kd.type=forward_kl".into(),
            ],
        };
        let c = Config::load(&args).unwrap();
        assert_eq!(c.teacher.urls, ["http://a:1", "http://b:2/"]);
        assert_eq!(c.teacher_urls().unwrap().len(), 2);
        assert_eq!(c.policy.model_name, PathBuf::from("cli_student"));
        assert_eq!(c.data.train_path, PathBuf::from("cli.txt"));
        assert_eq!(c.checkpointing.checkpoint_dir, PathBuf::from("out"));
        assert_eq!(c.distillation.max_num_steps, 7);
        assert_eq!(c.policy.optimizer.lr, 3e-5);
        assert_eq!(
            c.loss.as_ref().map(|l| &l.kd),
            Some(&crate::loss::KdConfig::ForwardKl {})
        );
    }

    fn err_key(text: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        match Config::from_file(&write(dir.path(), text)) {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("expected an Invalid error, got {other:?}"),
        }
    }

    #[test]
    fn validation_errors_name_the_key() {
        let with = |extra: &str| format!("{MINIMAL}\n{extra}");
        assert_eq!(
            err_key(&with("[distillation]\nnum_prompts_per_step = 0")),
            "distillation.num_prompts_per_step"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("[teacher]", "[teacher]\nk = 0")),
            "teacher.k"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("http://127.0.0.1:8000", "ftp://x")),
            "teacher.urls[0]"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("urls = [\"http://127.0.0.1:8000\"]", "")),
            "teacher.urls"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("[policy]", "[policy]\ndevice = \"tpu\"")),
            "policy.device"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("[policy]", "[policy]\nprecision = \"f8\"")),
            "policy.precision"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("[data]", "[data]\nprompt_field = \"q\"")),
            "data.completion_field"
        );
        assert_eq!(
            err_key(&MINIMAL.replace("[data]", "[data]\nprompts_only = true")),
            "data.prompt_field"
        );
        // A prompt field alone is a prompts-only file.
        let ok = MINIMAL.replace(
            "[data]",
            "[data]\nprompt_field = \"q\"\nprompts_only = true",
        );
        let dir = tempfile::tempdir().unwrap();
        let c = Config::from_file(&write(dir.path(), &ok)).unwrap();
        assert!(c.data.prompts_only && c.data.completion_field.is_none());
        assert_eq!(
            err_key(&with("[distillation]\nval_period = 10")),
            "distillation.val_period"
        );
        assert_eq!(
            err_key(&with("[policy.optimizer]\nbetas = [0.9, 1.0]")),
            "policy.optimizer.betas"
        );
        assert_eq!(
            err_key(&with("[checkpointing]\nkeep_top_k = 0")),
            "checkpointing.keep_top_k"
        );
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let dir = tempfile::tempdir().unwrap();
        let text = MINIMAL.replace("[teacher]", "[teacher]\ntopk = 3");
        match Config::from_file(&write(dir.path(), &text)) {
            Err(ConfigError::Parse { message, .. }) => {
                assert!(message.contains("topk"), "{message}")
            }
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn set_parses_toml_values_and_strings() {
        let mut t = toml::Table::new();
        apply_set(&mut t, "a.b=3").unwrap();
        apply_set(&mut t, "a.c=hello").unwrap();
        apply_set(&mut t, "a.d=[1, 2]").unwrap();
        assert_eq!(t["a"]["b"].as_integer(), Some(3));
        assert_eq!(t["a"]["c"].as_str(), Some("hello"));
        assert_eq!(t["a"]["d"].as_array().map(|a| a.len()), Some(2));
        assert!(apply_set(&mut t, "a.b.c=1").is_err());
        assert!(apply_set(&mut t, "novalue").is_err());
    }

    #[test]
    fn temperatures_of_teacher_and_loss_must_agree() {
        let with = |extra: &str| format!("{MINIMAL}\n{extra}");
        assert_eq!(
            err_key(&with(
                "[loss]\nkd = { type = \"forward_kl\" }\ntemperature = 2.0"
            )),
            "teacher.temperature"
        );
        let dir = tempfile::tempdir().unwrap();
        let ok = MINIMAL.replace("[teacher]", "[teacher]\ntemperature = 2.0");
        Config::from_file(&write(
            dir.path(),
            &with_loss(&ok, "kd = { type = \"forward_kl\" }\ntemperature = 2"),
        ))
        .unwrap();
    }

    fn with_loss(text: &str, loss: &str) -> String {
        format!("{text}\n[loss]\n{loss}\n")
    }

    /// Every example in `configs/` parses, validates, and names a data file that exists.
    #[test]
    fn every_shipped_config_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("configs");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("toml") {
                continue;
            }
            let c = Config::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                c.data.train_path.is_file(),
                "{}: {}",
                path.display(),
                c.data.train_path.display()
            );
            assert!(c.loss.is_some(), "{}: no [loss]", path.display());
            // The [loss] table must be a valid loss config, not just TOML.
            let loss = c
                .loss()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            loss.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            c.on_policy
                .generation
                .validate()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
        assert!(n >= 3, "expected the example configs in {}", dir.display());
    }

    #[test]
    fn training_hash_ignores_run_length_but_not_lr() {
        let mut a = Config::default();
        let h0 = a.training_hash();
        a.distillation.max_num_steps += 10;
        a.checkpointing.checkpoint_dir = "elsewhere".into();
        assert_eq!(a.training_hash(), h0);
        a.policy.optimizer.lr *= 2.0;
        assert_ne!(a.training_hash(), h0);
    }
}

#[cfg(test)]
mod teachers_tests {
    use super::*;

    const TWO: &str = r#"
        [policy]
        model_name = "student"
        [data]
        train_path = "data/train.jsonl"
        teacher_field = "domain"
        [[teachers]]
        name = "math"
        urls = ["http://127.0.0.1:8000"]
        k = 16
        [[teachers]]
        name = "code"
        urls = ["http://127.0.0.1:8001"]
        weight = 3.0
    "#;

    fn load(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, text).unwrap();
        Config::from_file(&p)
    }

    fn err(text: &str) -> (String, String) {
        match load(text) {
            Err(ConfigError::Invalid { key, message }) => (key, message),
            other => panic!("expected an Invalid error, got {other:?}"),
        }
    }

    #[test]
    fn teachers_list_names_weights_and_the_shorthand() {
        let c = load(TWO).unwrap();
        let list = c.teacher_list();
        assert_eq!(list.len(), 2);
        assert_eq!((list[0].0.as_str(), list[0].1.k), ("math", 16));
        assert_eq!(
            (list[1].0.as_str(), list[1].1.k, list[1].1.weight),
            ("code", 64, 3.0)
        );
        assert_eq!(c.distillation.teachers, TeacherMode::Route);
        // `[teacher]` is one teacher named `teacher`, and its training hash is the one it had
        // before `[[teachers]]` existed (the new keys are not serialised when unset).
        let one = load(
            "[policy]\nmodel_name = \"s\"\n[teacher]\nurls = [\"http://a:1\"]\n[data]\ntrain_path = \"t.jsonl\"\n",
        )
        .unwrap();
        assert_eq!(one.teacher_list()[0].0, "teacher");
        let json = serde_json::to_string(&one.data).unwrap();
        assert!(
            !json.contains("teacher_field") && !json.contains("default_teacher"),
            "{json}"
        );
        assert_ne!(
            c.training_hash(),
            load(&TWO.replace("weight = 3.0", "weight = 2.0"))
                .unwrap()
                .training_hash()
        );
    }

    #[test]
    fn bad_teacher_configs_name_the_key() {
        let cases: Vec<(String, &str, &str)> = vec![
            (
                TWO.replace("name = \"code\"", "name = \"math\""),
                "teachers[1].name",
                "duplicate",
            ),
            (
                TWO.replace("name = \"code\"\n", ""),
                "teachers[1].name",
                "needs a name",
            ),
            (
                TWO.replace("k = 16", "k = 0"),
                "teachers[0].k",
                "at least 1",
            ),
            (
                TWO.replace("weight = 3.0", "weight = -1.0"),
                "teachers[1].weight",
                "positive",
            ),
            (
                TWO.replace("[data]", "[teacher]\nurls = [\"http://x:1\"]\n[data]"),
                "teacher",
                "both [teacher] and [[teachers]]",
            ),
            (
                TWO.replace("teacher_field = \"domain\"", ""),
                "data.teacher_field",
                "needs the field",
            ),
            (
                TWO.replace("teacher_field = \"domain\"", "default_teacher = \"chem\""),
                "data.default_teacher",
                "no teacher is named \"chem\"",
            ),
            (
                format!("{TWO}\n[loss]\nkd = {{ type = \"forward_kl\" }}\ntemperature = 2.0\n"),
                "teachers[0].temperature",
                "differs from loss.temperature",
            ),
        ];
        for (text, key, msg) in cases {
            let (k, m) = err(&text);
            assert_eq!(k, key, "{m}");
            assert!(m.contains(msg), "{key}: {m}");
        }
        // An ensemble needs no routing field; a default alone routes everything.
        let ens = TWO.replace("teacher_field = \"domain\"", "")
            + "\n[distillation]\nteachers = \"ensemble\"\n";
        assert_eq!(
            load(&ens).unwrap().distillation.teachers,
            TeacherMode::Ensemble
        );
        load(&TWO.replace("teacher_field = \"domain\"", "default_teacher = \"code\"")).unwrap();
    }

    #[test]
    fn teacher_url_flag_is_refused_with_several_teachers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, TWO).unwrap();
        let args = OffPolicyArgs {
            config: p,
            teacher_url: vec!["http://a:1".into()],
            ..Default::default()
        };
        match Config::load(&args) {
            Err(ConfigError::Invalid { key, message }) => {
                assert_eq!(key, "teachers");
                assert!(message.contains("--teacher-url"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}
