//! The training commands' TOML configuration, with sections modelled on NeMo RL's
//! (`policy`, `teacher`, `loss`, `data`, `distillation`, `checkpointing`, `logger`), one file
//! per section here.
//!
//! Every section and key has a default except the ones a run cannot guess (the student, the data,
//! the teacher URLs), which may also come from the command line ([`CommonArgs`],
//! [`DistillArgs`]). A file is validated for the command that runs it ([`ObjectiveKind`]): `trainer
//! sft` needs no teacher. Relative paths in a file resolve against the file's directory; paths
//! on the command line against the working directory. `docs/training.md` is the reference for
//! every key.

mod args;
mod checkpointing;
mod data;
mod distillation;
mod logger;
mod on_policy;
mod policy;
mod teacher;

pub use args::{CommonArgs, DistillArgs};
pub use checkpointing::CheckpointingConfig;
pub use data::{DataConfig, DataFormat};
pub use distillation::{DistillationConfig, TeacherMode};
pub use logger::LoggerConfig;
pub use on_policy::OnPolicyConfig;
pub use policy::{
    ActivationCheckpointing, AllReduceMode, DataParallelConfig, LrSchedule, OptimizerConfig,
    PolicyConfig, VirtualShards,
};
pub use teacher::{parse_base_url, TeacherConfig, Transport};

use crate::loss::LossConfig;
use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

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
        deserialize_with = "loss_cross_section",
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

/// The training command a configuration is validated for (which of the trainer's objectives,
/// [`crate::train::runner::Objective`], the run drives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectiveKind {
    /// `trainer sft`: no teacher (`[teacher]`, `[[teachers]]` and the routing keys are not read).
    Sft,
    /// `trainer off-policy`.
    OffPolicy,
    /// `trainer on-policy`.
    OnPolicy,
}

impl ObjectiveKind {
    /// Whether the objective asks a teacher (and so needs `[teacher]` or `[[teachers]]`).
    pub fn needs_teachers(self) -> bool {
        match self {
            ObjectiveKind::Sft => false,
            ObjectiveKind::OffPolicy | ObjectiveKind::OnPolicy => true,
        }
    }
}

/// A config section that checks its own constraints; the error names the offending key under
/// `at`, the key the section is reported under (`policy`, `teacher`, `teachers[1]`).
pub trait Validate {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError>;
}

impl Config {
    /// Parses TOML text; relative paths stay as written.
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// The config as TOML text, which [`Config::from_toml_str`] and [`Config::load`] read back
    /// to an equal value (relative paths resolve against the file's directory when loaded).
    pub fn to_toml_string(&self) -> Result<String, toml::ser::Error> {
        toml::to_string(self)
    }

    /// Reads a file, resolves its relative paths against its directory and validates it with
    /// every section checked ([`Config::validate`]).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let c = Self::read_unvalidated(path, &[])?;
        c.validate()?;
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
        if let Some(c) = &mut self.checkpointing.cache_dir {
            fix(c);
        }
    }

    /// Checks every section, the teachers included: what the distillation objectives need
    /// ([`Config::validate_for`] with [`ObjectiveKind::OffPolicy`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_for(ObjectiveKind::OffPolicy)
    }

    /// Checks every constraint `objective` depends on: each section its own ([`Validate`]),
    /// then the ones that span sections. The error names the offending key.
    pub fn validate_for(&self, objective: ObjectiveKind) -> Result<(), ConfigError> {
        self.policy.validate_at("policy")?;
        if objective.needs_teachers() {
            self.validate_teachers()?;
        }
        self.validate_losses()?;
        self.data.validate_at("data")?;
        self.distillation.validate_at("distillation")?;
        self.checkpointing.validate_at("checkpointing")?;
        self.logger.validate_at("logger")?;
        if objective.needs_teachers() {
            self.check_teacher_temperatures()?;
        }
        self.check_validation_data()
    }

    /// `[loss]` and `[loss_cross]`, each valid, and `[loss_cross]` a cross-tokenizer loss at
    /// `[loss]`'s temperature.
    fn validate_losses(&self) -> Result<(), ConfigError> {
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
                .is_some_and(|l| l.temperature != lc.temperature)
            {
                return Err(invalid(
                    "loss_cross.temperature",
                    "must equal loss.temperature (one teacher temperature)",
                ));
            }
        }
        Ok(())
    }

    /// Validation requested (`[distillation]`) needs validation data (`[data]`).
    fn check_validation_data(&self) -> Result<(), ConfigError> {
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

    /// The student tokenizer file.
    pub fn student_tokenizer(&self) -> PathBuf {
        self.policy
            .tokenizer
            .clone()
            .unwrap_or_else(|| self.policy.model_name.join("tokenizer.json"))
    }

    /// Where a teacher tokenizer fetched from the server is cached.
    pub fn teacher_tokenizer_cache(&self) -> PathBuf {
        self.cache_dir().join("teacher_tokenizer")
    }

    /// Where the teachers' LM heads are kept (`transport = "hidden"`), by fingerprint.
    pub fn teacher_head_cache(&self) -> PathBuf {
        self.cache_dir().join("teacher_head")
    }

    /// `checkpointing.cache_dir`, else the run's directory.
    fn cache_dir(&self) -> &Path {
        let c = &self.checkpointing;
        c.cache_dir.as_deref().unwrap_or(&c.checkpoint_dir)
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
            /// Teachers sending hidden states (absent when every one sends its top-k, so older
            /// runs' hashes are unchanged).
            #[serde(skip_serializing_if = "Vec::is_empty")]
            hidden: Vec<String>,
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
            hidden: self
                .teacher_list()
                .into_iter()
                .filter(|(_, t)| t.transport.is_hidden())
                .map(|(name, _)| name)
                .collect(),
        };
        let bytes = serde_json::to_vec(&h).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))
    }
}

/// `[loss]` as typed config; an absent or empty table is none.
fn loss_section<'de, D: Deserializer<'de>>(d: D) -> Result<Option<LossConfig>, D::Error> {
    section_as_loss(d, "loss")
}

/// `[loss_cross]` as typed config, as [`loss_section`].
fn loss_cross_section<'de, D: Deserializer<'de>>(d: D) -> Result<Option<LossConfig>, D::Error> {
    section_as_loss(d, "loss_cross")
}

/// The table `[name]` as a loss config (an absent or empty one is none); errors name `[name]`.
fn section_as_loss<'de, D: Deserializer<'de>>(
    d: D,
    name: &str,
) -> Result<Option<LossConfig>, D::Error> {
    let table = toml::Table::deserialize(d)?;
    if table.is_empty() {
        return Ok(None);
    }
    toml::Value::Table(table)
        .try_into()
        .map(Some)
        .map_err(|e: toml::de::Error| {
            serde::de::Error::custom(format!("[{name}]: {}", e.message()))
        })
}

/// A config value that is a whole number or one keyword (`"auto"`, `"all"`): `Some(n)` for a
/// number, `None` for `word`; anything else is an error that says `want` and what was given.
fn number_or_word<'de, D: Deserializer<'de>>(
    d: D,
    word: &'static str,
    want: &'static str,
) -> Result<Option<usize>, D::Error> {
    struct V {
        word: &'static str,
        want: &'static str,
    }
    impl serde::de::Visitor<'_> for V {
        type Value = Option<usize>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str(self.want)
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            usize::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("{}, got {v}", self.want)))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            u64::try_from(v)
                .map_err(|_| E::custom(format!("{}, got {v}", self.want)))
                .and_then(|v| self.visit_u64(v))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            if v == self.word {
                Ok(None)
            } else {
                Err(E::custom(format!("{}, got {v:?}", self.want)))
            }
        }
    }
    d.deserialize_any(V { word, want })
}

#[cfg(test)]
mod teachers_tests;
#[cfg(test)]
mod tests;
