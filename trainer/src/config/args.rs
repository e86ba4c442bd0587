//! The training commands' flags: [`CommonArgs`], which every training command flattens in
//! (`trainer sft` adds its task evaluation, [`crate::train::sft::SftArgs`]), and [`DistillArgs`]
//! for `trainer off-policy` and `trainer on-policy`. Flags override the config file; `--set`
//! any key of it.

use super::{invalid, Config, ConfigError, ObjectiveKind};
use std::path::{Path, PathBuf};

/// The flags of every training command (`sft`, `off-policy`, `on-policy`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CommonArgs {
    /// TOML configuration file (see configs/ and docs/training.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Student model directory (replaces `policy.model_name`).
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

/// `trainer off-policy` and `trainer on-policy`: the common flags and the teacher's URLs.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(mut_arg("data", |a| a
    .visible_alias("prompts")
    .help("Training data file (replaces `data.train_path`); `--prompts` for on-policy runs")))]
pub struct DistillArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Teacher server base URL; repeat for several replicas (replaces `teacher.urls`).
    // Listed in --help right after --config (same order, then by name), as before the split.
    #[arg(long = "teacher-url", display_order = 0)]
    pub teacher_url: Vec<String>,
}

impl CommonArgs {
    /// The flags of a run of `config` with nothing overridden.
    pub fn with_config(config: impl Into<PathBuf>) -> CommonArgs {
        CommonArgs {
            config: config.into(),
            ..Default::default()
        }
    }
}

impl DistillArgs {
    /// Reads the config file, applies the flags and validates it for `objective`.
    pub fn load_config(&self, objective: ObjectiveKind) -> Result<Config, ConfigError> {
        Config::load(&self.common, &self.teacher_url, objective)
    }
}

impl Config {
    /// Reads the file named by `args.config`, applies `--set`, then the other flags (and
    /// `--teacher-url`'s `teacher_urls`, when any), and validates the result for `objective`.
    pub fn load(
        args: &CommonArgs,
        teacher_urls: &[String],
        objective: ObjectiveKind,
    ) -> Result<Config, ConfigError> {
        let mut c = Self::read_unvalidated(&args.config, &args.set)?;
        c.set_teacher_urls(teacher_urls)?;
        c.apply_overrides(args);
        c.validate_for(objective)?;
        Ok(c)
    }

    /// `--teacher-url`: replaces `teacher.urls` (none given: nothing changes). Refused with
    /// `[[teachers]]`, whose URLs are per entry.
    pub fn set_teacher_urls(&mut self, urls: &[String]) -> Result<(), ConfigError> {
        if urls.is_empty() {
            return Ok(());
        }
        if !self.teachers.is_empty() {
            return Err(invalid(
                "teachers",
                "--teacher-url sets the one teacher of [teacher]; with [[teachers]], set \
                 each entry's urls in the config (or with --set)",
            ));
        }
        self.teacher.urls = urls.to_vec();
        Ok(())
    }

    /// Applies the common flags (paths relative to the working directory).
    pub fn apply_overrides(&mut self, a: &CommonArgs) {
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
    }

    /// Reads a file, applies the `--set` assignments and resolves the relative paths against
    /// the file's directory; not validated.
    pub(super) fn read_unvalidated(path: &Path, sets: &[String]) -> Result<Config, ConfigError> {
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
}

/// Applies one `key.path=value` assignment to a TOML table. The value is parsed as TOML
/// (`3e-5`, `true`, `"x"`, `[1, 2]`); anything that does not parse is taken as a string.
pub(super) fn apply_set(table: &mut toml::Table, assignment: &str) -> Result<(), ConfigError> {
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
