//! Pruning old checkpoints: keep the newest and the best by a metric.

use super::{io_err, list, read_state, CheckpointError};
use std::path::{Path, PathBuf};

/// How [`retain`] ranks checkpoints.
#[derive(Debug, Clone, PartialEq)]
pub enum Ranking {
    /// Newest steps first.
    Newest,
    /// By `TrainerState::metrics[name]`; checkpoints without it rank last.
    Metric {
        name: String,
        higher_is_better: bool,
    },
}

/// Keeps the `keep` best checkpoints (always including the newest, which a resume needs) and
/// deletes the others; returns the deleted paths. `final/` is never touched.
pub fn retain(
    output_dir: &Path,
    keep: usize,
    ranking: &Ranking,
) -> Result<Vec<PathBuf>, CheckpointError> {
    let all = list(output_dir)?;
    let Some((newest, _)) = all.last().cloned() else {
        return Ok(Vec::new());
    };
    let keep = keep.max(1);
    let mut others: Vec<(u64, PathBuf)> = all.into_iter().filter(|(s, _)| *s != newest).collect();
    match ranking {
        Ranking::Newest => others.sort_by_key(|x| std::cmp::Reverse(x.0)),
        Ranking::Metric {
            name,
            higher_is_better,
        } => {
            let mut scored: Vec<(Option<f64>, u64, PathBuf)> = others
                .into_iter()
                .map(|(s, p)| {
                    let v = read_state(&p)
                        .ok()
                        .and_then(|st| st.metrics.get(name).copied())
                        .filter(|v| v.is_finite());
                    (v, s, p)
                })
                .collect();
            // Best first; missing values last; ties broken by the newer step.
            scored.sort_by(|a, b| match (a.0, b.0) {
                (Some(x), Some(y)) => {
                    let o = if *higher_is_better {
                        y.total_cmp(&x)
                    } else {
                        x.total_cmp(&y)
                    };
                    o.then(b.1.cmp(&a.1))
                }
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => b.1.cmp(&a.1),
            });
            others = scored.into_iter().map(|(_, s, p)| (s, p)).collect();
        }
    }
    let mut removed = Vec::new();
    for (_, path) in others.into_iter().skip(keep - 1) {
        std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        removed.push(path);
    }
    Ok(removed)
}
