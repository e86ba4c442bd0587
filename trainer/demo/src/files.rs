//! The demo's data files, all derived from one seeded task:
//!
//! - `train_demo.jsonl` / `test_demo.jsonl`: the task's splits with the end-of-answer blank line
//!   appended to every completion (the control scenario's data; the evaluation's stop string);
//! - `teacher_corrected.jsonl`: the corrected teacher's fine-tune data (`train_demo.jsonl` with
//!   a corrected-prefix record for each problem shuffled in; the plain teacher trains on
//!   `train_demo.jsonl`);
//! - `labelled.jsonl`: the scarce scenario's labels, a seeded sample of `train_demo.jsonl`;
//! - `prompts.jsonl`: every training prompt and nothing else (no completion, no answer), what
//!   on-policy distillation samples from in the scarce scenario.

use crate::mistakes;
use crate::settings::ScarceSpec;
use crate::task::{self, TaskConfig, TaskRecord};
use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};

/// Paths of the files [`write`](fn@write) made.
#[derive(Debug, Clone)]
pub struct TaskFiles {
    pub train: PathBuf,
    pub test: PathBuf,
    pub teacher_corrected: PathBuf,
    pub labelled: PathBuf,
    pub prompts: PathBuf,
    /// Held-out records with the end marker (for the after-mistake measurement).
    pub test_records: Vec<TaskRecord>,
    pub train_records: usize,
}

/// The end-of-answer marker every completion gets (the evaluation's default stop string).
pub const END_MARKER: &str = "\n\n";

fn write_jsonl<T: serde::Serialize>(path: &Path, records: &[T]) -> Result<()> {
    let mut text = String::new();
    for r in records {
        text.push_str(&serde_json::to_string(r)?);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Records with [`END_MARKER`] appended to the completion.
fn with_marker(records: &[TaskRecord]) -> Vec<TaskRecord> {
    records
        .iter()
        .map(|r| TaskRecord {
            completion: format!("{}{END_MARKER}", r.completion),
            ..r.clone()
        })
        .collect()
}

/// `n` records of `records` drawn without replacement by `seed`, in their file order.
pub fn sample(records: &[TaskRecord], n: usize, seed: u64) -> Result<Vec<TaskRecord>> {
    if n == 0 || n > records.len() {
        bail!(
            "labelled problems (--labelled) = {n}: must be between 1 and the {} training problems",
            records.len()
        );
    }
    let mut idx: Vec<usize> = (0..records.len()).collect();
    idx.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut keep = idx[..n].to_vec();
    keep.sort_unstable();
    Ok(keep.into_iter().map(|i| records[i].clone()).collect())
}

/// The corrected teacher's fine-tune records: the task's and a corrected-prefix record per
/// problem, shuffled together by `seed`.
pub fn corrected_mix(train: &[TaskRecord], seed: u64) -> Vec<TaskRecord> {
    let mut out = train.to_vec();
    out.extend(mistakes::corrected_records(train, seed ^ 0xc0de));
    out.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    out
}

/// Writes every data file of the demo into `dir`.
pub fn write(dir: &Path, cfg: &TaskConfig, scarce: &ScarceSpec) -> Result<TaskFiles> {
    let splits = task::make_splits(cfg)?;
    task::write_splits(dir, cfg, &splits)?;
    let (train, test) = (with_marker(&splits.train), with_marker(&splits.test));
    let files = TaskFiles {
        train: dir.join("train_demo.jsonl"),
        test: dir.join("test_demo.jsonl"),
        teacher_corrected: dir.join("teacher_corrected.jsonl"),
        labelled: dir.join("labelled.jsonl"),
        prompts: dir.join("prompts.jsonl"),
        test_records: test.clone(),
        train_records: train.len(),
    };
    write_jsonl(&files.train, &train)?;
    write_jsonl(&files.test, &test)?;
    write_jsonl(&files.teacher_corrected, &corrected_mix(&train, cfg.seed))?;
    write_jsonl(
        &files.labelled,
        &sample(&train, scarce.labelled, scarce.seed)?,
    )?;
    let prompts: Vec<serde_json::Value> = train
        .iter()
        .map(|r| serde_json::json!({ "prompt": r.prompt }))
        .collect();
    write_jsonl(&files.prompts, &prompts)?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> TaskConfig {
        TaskConfig {
            train: 40,
            test: 5,
            ..TaskConfig::default()
        }
    }

    #[test]
    fn the_files_hold_what_each_side_may_see() {
        let dir = tempfile::tempdir().unwrap();
        let scarce = ScarceSpec {
            labelled: 6,
            seed: 1,
        };
        let f = write(dir.path(), &cfg(), &scarce).unwrap();
        let read = |p: &Path| -> Vec<serde_json::Value> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let train = read(&f.train);
        assert_eq!(train.len(), 40);
        assert!(train
            .iter()
            .all(|r| r["completion"].as_str().unwrap().ends_with(END_MARKER)));
        // Labels: 6 distinct training records, unchanged.
        let labelled = read(&f.labelled);
        assert_eq!(labelled.len(), 6);
        assert!(labelled.iter().all(|r| train.contains(r)));
        // Prompts: every training prompt, and no field that could carry an answer.
        let prompts = read(&f.prompts);
        assert_eq!(prompts.len(), 40);
        for (p, t) in prompts.iter().zip(&train) {
            assert_eq!(p.as_object().unwrap().len(), 1);
            assert_eq!(p["prompt"], t["prompt"]);
        }
        // Teacher's fine-tune: the training records plus a corrected-prefix record for each
        // problem whose wrong digit is not the last one (after it only the blank marker is
        // left, which no SFT record may be).
        let teacher = read(&f.teacher_corrected);
        assert!(
            teacher.len() > 60 && teacher.len() < 80,
            "{}",
            teacher.len()
        );
        assert_eq!(
            teacher.iter().filter(|r| train.contains(r)).count(),
            40,
            "all training records are in"
        );
        for r in teacher.iter().filter(|r| !train.contains(r)) {
            let completion = r["completion"].as_str().unwrap();
            assert!(!completion.trim().is_empty());
            let prompt = r["prompt"].as_str().unwrap();
            let source = train
                .iter()
                .find(|t| prompt.starts_with(t["prompt"].as_str().unwrap()))
                .unwrap();
            assert!(source["completion"].as_str().unwrap().ends_with(completion));
        }
    }

    #[test]
    fn a_label_sample_is_seeded_and_bounded() {
        let train = with_marker(&task::make_splits(&cfg()).unwrap().train);
        assert_eq!(sample(&train, 5, 3).unwrap(), sample(&train, 5, 3).unwrap());
        assert_ne!(sample(&train, 5, 3).unwrap(), sample(&train, 5, 4).unwrap());
        assert!(sample(&train, 0, 3).is_err());
        assert!(sample(&train, 41, 3).is_err());
        assert_eq!(sample(&train, 40, 3).unwrap(), train);
    }
}
