//! `OUTPUT/metrics.jsonl` (one JSON object per step, flushed as written) and the console
//! progress: an indicatif bar on a terminal, a log line every `log_every` steps always.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const METRICS_FILE: &str = "metrics.jsonl";

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("encoding a metrics line: {0}")]
    Json(#[from] serde_json::Error),
}

/// One training step's line in `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StepMetrics {
    /// `"train"`; validation lines use [`ValMetrics`] with `"val"`.
    pub split: String,
    /// The optimizer step this line describes (1-based: the first step is 1).
    pub step: u64,
    pub epoch: u64,
    /// Total loss that was back-propagated.
    pub loss: f64,
    /// Named parts of the loss (e.g. `forward_kl`, `ce`), before weighting.
    #[serde(default)]
    pub loss_parts: BTreeMap<String, f64>,
    /// Forward KL(teacher ‖ student) over the teacher's top-k, for monitoring.
    pub kl: Option<f64>,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: Option<f64>,
    pub lr: f64,
    /// Student tokens in the step's batch, and those carrying loss.
    pub tokens: u64,
    pub loss_tokens: u64,
    pub tokens_per_s: f64,
    /// Wall time of the whole step (seconds).
    pub step_time_s: f64,
    /// Round-trip time of the teacher request for this batch (seconds, retries included).
    pub teacher_latency_s: f64,
    /// Time the step waited for the teacher's answer beyond what prefetching hid (seconds).
    pub teacher_wait_s: f64,
    /// Records skipped so far (bad or too long).
    pub skipped_records: u64,
    /// Unix time the line was written.
    pub time: f64,
}

/// A validation line in `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct ValMetrics {
    /// `"val"`.
    pub split: String,
    /// The step after which validation ran (0: before training).
    pub step: u64,
    pub loss: f64,
    #[serde(default)]
    pub loss_parts: BTreeMap<String, f64>,
    pub kl: Option<f64>,
    pub records: u64,
    pub loss_tokens: u64,
    pub time: f64,
}

/// Seconds since the Unix epoch.
pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Append-only writer of `metrics.jsonl`.
pub struct MetricsLog {
    path: PathBuf,
    /// `None`: a log that writes nothing (the ranks other than 0 of a data-parallel job).
    file: Option<std::fs::File>,
}

impl MetricsLog {
    /// Opens `output_dir/metrics.jsonl` for appending. With `resume_step = Some(s)` (a run
    /// resumed from the checkpoint of step `s`), lines of later steps — written by the
    /// interrupted run after its last checkpoint, and about to be written again — are removed
    /// first, as is a torn last line; so the file ends with one line per step.
    ///
    /// A fresh run (`None`) never appends to an earlier run's lines: a non-empty file is
    /// renamed to `metrics.prev-N.jsonl` (the first free N) with a warning naming both, so the
    /// file describes one run whose steps start at 1.
    pub fn open(output_dir: &Path, resume_step: Option<u64>) -> Result<MetricsLog, MetricsError> {
        let path = output_dir.join(METRICS_FILE);
        let io = |source| MetricsError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(output_dir).map_err(io)?;
        match resume_step {
            Some(step) if path.is_file() => truncate_after(&path, step).map_err(io)?,
            None => {
                if let Some(old) = previous(output_dir) {
                    let aside = free_aside_name(output_dir);
                    std::fs::rename(&old, &aside).map_err(io)?;
                    tracing::warn!(
                        "{} holds an earlier run's metrics; moved to {} (a fresh run starts a new file)",
                        old.display(),
                        aside.display()
                    );
                }
            }
            _ => {}
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io)?;
        Ok(MetricsLog {
            path,
            file: Some(file),
        })
    }

    /// A log that writes nothing: only rank 0 of a data-parallel job writes `metrics.jsonl`.
    pub fn disabled(output_dir: &Path) -> MetricsLog {
        MetricsLog {
            path: output_dir.join(METRICS_FILE),
            file: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line and flushes it to the OS.
    pub fn append<T: Serialize>(&mut self, line: &T) -> Result<(), MetricsError> {
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        file.write_all(&bytes)
            .and_then(|_| file.flush())
            .map_err(|source| MetricsError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// `output_dir/metrics.jsonl` when it exists and is not empty (an earlier run's lines).
pub fn previous(output_dir: &Path) -> Option<PathBuf> {
    let path = output_dir.join(METRICS_FILE);
    std::fs::metadata(&path)
        .is_ok_and(|m| m.is_file() && m.len() > 0)
        .then_some(path)
}

/// `metrics.prev-N.jsonl` for the first N that does not exist yet.
fn free_aside_name(output_dir: &Path) -> PathBuf {
    (1u64..)
        .map(|n| output_dir.join(format!("metrics.prev-{n}.jsonl")))
        .find(|p| !p.exists())
        .unwrap_or_else(|| output_dir.join("metrics.prev.jsonl"))
}

/// Rewrites `path` keeping the lines whose `step` is at most `step` (unparsable lines dropped).
fn truncate_after(path: &Path, step: u64) -> std::io::Result<()> {
    let reader = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut kept = Vec::new();
    for line in reader.split(b'\n') {
        let line = line?;
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&line) else {
            continue;
        };
        if v.get("step")
            .and_then(|s| s.as_u64())
            .is_some_and(|s| s <= step)
        {
            kept.extend_from_slice(&line);
            kept.push(b'\n');
        }
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, &kept)?;
    std::fs::rename(&tmp, path)
}

/// Whether a progress bar should be drawn: asked for, on a terminal, and not under CI.
pub fn bar_visible(enabled: bool, is_terminal: bool, ci: bool) -> bool {
    enabled && is_terminal && !ci
}

/// Progress over the run's steps: a bar when visible, and a `tracing` line every `log_every`
/// steps either way.
pub struct Progress {
    bar: ProgressBar,
    visible: bool,
    log_every: u64,
    total: u64,
}

impl Progress {
    /// `start` is the step the run starts from (non-zero on resume).
    pub fn new(total: u64, start: u64, enabled: bool, log_every: u64) -> Progress {
        use std::io::IsTerminal;
        let visible = bar_visible(
            enabled,
            std::io::stderr().is_terminal(),
            std::env::var_os("CI").is_some(),
        );
        let bar = if visible {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps (eta {eta}) {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            b.set_style(style);
            b.enable_steady_tick(Duration::from_millis(250));
            b
        } else {
            ProgressBar::hidden()
        };
        bar.set_position(start);
        Progress {
            bar,
            visible,
            log_every: log_every.max(1),
            total,
        }
    }

    pub fn is_visible(&self) -> bool {
        self.visible
    }

    /// Records a finished step.
    pub fn step(&self, m: &StepMetrics) {
        self.bar.set_position(m.step);
        let msg = step_summary(m);
        if self.visible {
            self.bar.set_message(msg.clone());
        }
        if m.step.checked_rem(self.log_every) == Some(0) || m.step == self.total {
            self.println(&format!("step {}/{} {msg}", m.step, self.total));
        }
    }

    /// Logs a line without tearing the bar.
    pub fn println(&self, line: &str) {
        self.bar.suspend(|| tracing::info!("{line}"));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The short human summary of a step (bar message and log line).
pub fn step_summary(m: &StepMetrics) -> String {
    let mut s = format!("loss {:.4}", m.loss);
    if let Some(kl) = m.kl {
        s += &format!(" kl {kl:.4}");
    }
    if let Some(g) = m.grad_norm {
        s += &format!(" gnorm {g:.3}");
    }
    s += &format!(
        " lr {:.2e} {:.0} tok/s teacher {:.0} ms (waited {:.0} ms)",
        m.lr,
        m.tokens_per_s,
        m.teacher_latency_s * 1e3,
        m.teacher_wait_s * 1e3
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64) -> StepMetrics {
        StepMetrics {
            split: "train".into(),
            step,
            loss: 1.0 / step as f64,
            loss_parts: [("forward_kl".to_string(), 0.5)].into(),
            kl: Some(0.25),
            grad_norm: None,
            lr: 1e-4,
            ..Default::default()
        }
    }

    fn read(path: &Path) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn lines_are_appended_and_parse_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        for s in 1..=3 {
            log.append(&line(s)).unwrap();
        }
        // Flushed: visible to a reader while the writer is still open.
        let v = read(log.path());
        assert_eq!(v.len(), 3);
        let back: StepMetrics = serde_json::from_value(v[1].clone()).unwrap();
        assert_eq!(back, line(2));
        assert_eq!(v[0]["grad_norm"], serde_json::Value::Null);
        assert_eq!(v[2]["loss_parts"]["forward_kl"], 0.5);
    }

    /// A fresh run never appends to an earlier run's lines: they are set aside, numbered.
    #[test]
    fn fresh_run_sets_earlier_metrics_aside() {
        let dir = tempfile::tempdir().unwrap();
        for run in 1..=2u64 {
            let mut log = MetricsLog::open(dir.path(), None).unwrap();
            for s in 1..=run + 1 {
                log.append(&line(s)).unwrap();
            }
        }
        assert!(previous(dir.path()).is_some());
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        log.append(&line(1)).unwrap();
        let steps = |p: &Path| -> Vec<u64> {
            read(p)
                .iter()
                .map(|v| v["step"].as_u64().unwrap())
                .collect()
        };
        assert_eq!(steps(log.path()), [1]);
        assert_eq!(steps(&dir.path().join("metrics.prev-1.jsonl")), [1, 2]);
        assert_eq!(steps(&dir.path().join("metrics.prev-2.jsonl")), [1, 2, 3]);
        // An empty file is no earlier run.
        std::fs::write(log.path(), b"").unwrap();
        assert!(previous(dir.path()).is_none());
    }

    #[test]
    fn resume_drops_steps_after_the_checkpoint_and_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut log = MetricsLog::open(dir.path(), None).unwrap();
            for s in 1..=5 {
                log.append(&line(s)).unwrap();
            }
            log.append(&ValMetrics {
                split: "val".into(),
                step: 4,
                ..Default::default()
            })
            .unwrap();
        }
        // A crash mid-line.
        let path = dir.path().join(METRICS_FILE);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"split\":\"train\",\"step\":6,\"lo")
            .unwrap();
        drop(f);
        // Resume from the checkpoint of step 3: steps 4, 5, the val line of 4 and the torn
        // line go; the resumed run appends step 4 again.
        let mut log = MetricsLog::open(dir.path(), Some(3)).unwrap();
        log.append(&line(4)).unwrap();
        let steps: Vec<u64> = read(&path)
            .iter()
            .map(|v| v["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, [1, 2, 3, 4]);
    }

    #[test]
    fn bar_only_on_a_terminal_outside_ci() {
        assert!(bar_visible(true, true, false));
        assert!(!bar_visible(true, false, false));
        assert!(!bar_visible(true, true, true));
        assert!(!bar_visible(false, true, false));
        // Under `cargo test` stderr is captured or CI is set: the bar is hidden but usable.
        let p = Progress::new(10, 2, true, 5);
        p.step(&line(5));
        p.finish();
        assert!(step_summary(&line(2)).starts_with("loss 0.5000 kl 0.2500 lr 1.00e-4"));
    }
}
