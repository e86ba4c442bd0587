//! `[teacher]` and `[[teachers]]`: where the teacher servers are and how to ask them.

use super::{invalid, Config, ConfigError, TeacherMode, Validate};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

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
    /// What the teacher sends per position: its top-`k` log-probs (`topk`), or its final hidden
    /// states (`hidden`), from which the trainer computes the teacher's exact distribution over
    /// the whole vocabulary with the teacher's own LM head (downloaded once from `/v1/head`).
    #[serde(skip_serializing_if = "Transport::is_topk")]
    pub transport: Transport,
    /// The most memory (GB, 10^9 bytes) the teacher's head may take on the student's device with
    /// `transport = "hidden"` (held in f32: `head_rows · hidden_size · 4` bytes). Default: a
    /// quarter of the machine's memory on the CPU, 8 GB on a GPU.
    pub head_memory_gb: Option<f64>,
}

/// How a teacher sends its distribution (`teacher.transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// `POST /topk_logits`: the top-k log-probs per position (the losses' tail bucket stands
    /// for the rest).
    #[default]
    Topk,
    /// `POST /hidden_states` + `GET /v1/head`: the exact full-vocabulary distribution.
    Hidden,
}

impl Transport {
    pub fn is_hidden(self) -> bool {
        self == Transport::Hidden
    }
    /// The default (left out when a config is written back).
    pub fn is_topk(&self) -> bool {
        *self == Transport::Topk
    }
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
            transport: Transport::Topk,
            head_memory_gb: None,
        }
    }
}

impl TeacherConfig {
    /// `urls`, parsed; errors name the entry under `teacher` (validation names every entry
    /// under its own section, [`TeacherConfig::parsed_urls_at`]).
    pub fn parsed_urls(&self) -> Result<Vec<reqwest::Url>, ConfigError> {
        self.parsed_urls_at("teacher")
    }

    /// `urls`, parsed; the error names the offending entry under `at` (`teachers[1].urls[0]`).
    pub fn parsed_urls_at(&self, at: &str) -> Result<Vec<reqwest::Url>, ConfigError> {
        self.urls
            .iter()
            .enumerate()
            .map(|(i, u)| parse_base_url(u).map_err(|m| invalid(&format!("{at}.urls[{i}]"), m)))
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

/// The longest time setting taken (about 31 years): a `Duration` ends at 2^64 s, and an
/// `Instant` plus a far shorter one already overflows.
const MAX_SECONDS: f64 = 1e9;

impl Validate for TeacherConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        let t = self;
        let key = |name: &str| format!("{at}.{name}");
        if t.urls.is_empty() {
            return Err(invalid(
                &key("urls"),
                "at least one teacher URL is required (or --teacher-url)",
            ));
        }
        t.parsed_urls_at(at)?;
        if t.k == 0 {
            return Err(invalid(&key("k"), "must be at least 1"));
        }
        if !(t.temperature.is_finite() && t.temperature > 0.0) {
            return Err(invalid(&key("temperature"), "must be positive"));
        }
        for (name, v) in [
            ("timeout_s", t.timeout_s),
            ("connect_timeout_s", t.connect_timeout_s),
            ("backoff_initial_s", t.backoff_initial_s),
            ("backoff_max_s", t.backoff_max_s),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= MAX_SECONDS) {
                return Err(invalid(
                    &key(name),
                    format!("must be a positive number of seconds, at most {MAX_SECONDS:e}"),
                ));
            }
        }
        if !(t.max_wait_s.is_finite() && t.max_wait_s >= 0.0 && t.max_wait_s <= MAX_SECONDS) {
            return Err(invalid(
                &key("max_wait_s"),
                format!("must be >= 0 seconds, at most {MAX_SECONDS:e}"),
            ));
        }
        if t.backoff_max_s < t.backoff_initial_s {
            return Err(invalid(
                &key("backoff_max_s"),
                "must be >= backoff_initial_s",
            ));
        }
        if t.max_attempts == Some(0) {
            return Err(invalid(&key("max_attempts"), "must be at least 1"));
        }
        if t.prefetch == 0 {
            return Err(invalid(&key("prefetch"), "must be at least 1"));
        }
        if !(t.weight.is_finite() && t.weight > 0.0) {
            return Err(invalid(&key("weight"), "must be a positive number"));
        }
        if let Some(gb) = t.head_memory_gb {
            if !(gb.is_finite() && gb > 0.0) {
                return Err(invalid(
                    &key("head_memory_gb"),
                    "must be a positive number of GB",
                ));
            }
        }
        Ok(())
    }
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

impl Config {
    /// The section key of the `i`th teacher of [`Config::teacher_list`]: `teacher` for the
    /// one-teacher shorthand, `teachers[i]` otherwise.
    pub fn teacher_key(&self, i: usize) -> String {
        if self.teachers.is_empty() {
            "teacher".to_string()
        } else {
            format!("teachers[{i}]")
        }
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

    /// `[teacher]` or `[[teachers]]` (not both), each entry valid under its own key, names
    /// unique, the routing keys naming teachers that exist, and every teacher's temperature the
    /// loss's.
    pub(super) fn validate_teachers(&self) -> Result<(), ConfigError> {
        if self.teachers.is_empty() {
            self.teacher.validate_at("teacher")?;
        } else if self.teacher != TeacherConfig::default() {
            return Err(invalid(
                "teacher",
                "both [teacher] and [[teachers]] are set: list every teacher under [[teachers]] \
                 ([teacher] is the one-teacher shorthand)",
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, t) in self.teachers.iter().enumerate() {
            let at = self.teacher_key(i);
            match t.name.as_deref() {
                None | Some("") => {
                    return Err(invalid(
                        &format!("{at}.name"),
                        "every [[teachers]] entry needs a name",
                    ))
                }
                Some(n) if !names.insert(n) => {
                    return Err(invalid(
                        &format!("{at}.name"),
                        format!("duplicate teacher name {n:?}"),
                    ))
                }
                Some(_) => {}
            }
            t.validate_at(&at)?;
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

    /// The loss divides the student's logits by its temperature; every teacher's must match.
    pub(super) fn check_teacher_temperatures(&self) -> Result<(), ConfigError> {
        let Some(lt) = self.loss.as_ref().map(|l| l.temperature) else {
            return Ok(());
        };
        for (i, (name, t)) in self.teacher_list().into_iter().enumerate() {
            // Exact, at the precision the teacher scores at: the wire carries an f32.
            if t.temperature != lt.get() as f32 {
                return Err(invalid(
                    &format!("{}.temperature", self.teacher_key(i)),
                    format!(
                        "{} (teacher {name:?}) differs from loss.temperature = {lt}",
                        t.temperature
                    ),
                ));
            }
        }
        Ok(())
    }
}
