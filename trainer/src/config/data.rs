//! `[data]`: the training text and its validation split.

use super::{invalid, ConfigError, Validate};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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

impl Validate for DataConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        let d = self;
        let key = |name: &str| format!("{at}.{name}");
        if d.train_path.as_os_str().is_empty() {
            return Err(invalid(
                &key("train_path"),
                "the training data file is required (or --data)",
            ));
        }
        match (&d.prompt_field, &d.completion_field) {
            (None, _) if d.prompts_only => {
                return Err(invalid(
                    &key("prompt_field"),
                    "required with data.prompts_only = true",
                ))
            }
            (Some(_), None) if d.prompts_only => {}
            (Some(_), None) => {
                return Err(invalid(
                    &key("completion_field"),
                    "required with data.prompt_field",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    &key("prompt_field"),
                    "required with data.completion_field",
                ))
            }
            _ => {}
        }
        if d.text_field.is_empty() {
            return Err(invalid(&key("text_field"), "must not be empty"));
        }
        if !(d.val_fraction.is_finite() && (0.0..1.0).contains(&d.val_fraction)) {
            return Err(invalid(&key("val_fraction"), "must be in [0, 1)"));
        }
        if d.max_record_bytes == 0 {
            return Err(invalid(&key("max_record_bytes"), "must be at least 1"));
        }
        Ok(())
    }
}
