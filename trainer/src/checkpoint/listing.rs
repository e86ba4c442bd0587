//! Finding checkpoints in an output directory: complete ones, ones set aside as corrupt, and
//! the staging directories an interrupted save left.

use super::{io_err, CheckpointError, CORRUPT_SUFFIX, FINAL_DIR, STATE_FILE};
use std::path::{Path, PathBuf};

/// Directory name of step `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step}")
}

fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Complete checkpoints in `output_dir`, oldest first. Temp directories and directories without
/// `trainer_state.json` are ignored; a missing `output_dir` has none.
pub fn list(output_dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match std::fs::read_dir(output_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(output_dir)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(output_dir))?;
        let name = entry.file_name();
        let Some(step) = name.to_str().and_then(parse_step_dir) else {
            continue;
        };
        let path = entry.path();
        if path.join(STATE_FILE).is_file() {
            out.push((step, path));
        }
    }
    out.sort();
    Ok(out)
}

/// Checkpoints set aside as corrupt (`step_N.corrupt/`) by an earlier resume, oldest first.
pub fn corrupt_dirs(output_dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let entries = match std::fs::read_dir(output_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(output_dir)(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(output_dir))?;
        let name = entry.file_name();
        let step = name
            .to_str()
            .and_then(|n| n.strip_suffix(CORRUPT_SUFFIX))
            .and_then(parse_step_dir);
        if let Some(step) = step {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// The newest complete checkpoint.
pub fn latest(output_dir: &Path) -> Result<Option<(u64, PathBuf)>, CheckpointError> {
    Ok(list(output_dir)?.pop())
}

/// Deletes temp directories left by an interrupted save; returns how many.
pub fn remove_temp_dirs(output_dir: &Path) -> Result<usize, CheckpointError> {
    let entries = match std::fs::read_dir(output_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_err(output_dir)(e)),
    };
    let mut n = 0;
    for entry in entries {
        let entry = entry.map_err(io_err(output_dir))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name.starts_with(".step_") || name.starts_with(&format!(".{FINAL_DIR}."));
        if ours && name.contains(".tmp-") && entry.path().is_dir() {
            std::fs::remove_dir_all(entry.path()).map_err(io_err(&entry.path()))?;
            n += 1;
        }
    }
    Ok(n)
}
