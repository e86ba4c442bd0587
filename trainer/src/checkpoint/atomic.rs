//! Crash-safe writes: a checkpoint is filled in a hidden staging directory, checksummed, fsynced
//! and renamed into place only when complete.

use super::manifest::write_manifest;
use super::{io_err, CheckpointError};
use std::path::{Path, PathBuf};

/// Runs `fill` on a fresh directory inside a hidden staging directory, fsyncs it, and renames it
/// to `output_dir/name`. On failure the staging directory (with anything `fill` left in it,
/// including `write_model_dir`'s own temp directory) is removed.
pub(super) fn write_atomically(
    output_dir: &Path,
    name: &str,
    fill: impl FnOnce(&Path) -> Result<(), CheckpointError>,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(output_dir).map_err(io_err(output_dir))?;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let staging = output_dir.join(format!(".{name}.tmp-{}-{nonce}", std::process::id()));
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let tmp = staging.join(name);
    let result = (|| {
        fill(&tmp)?;
        write_manifest(&tmp)?;
        sync_tree(&tmp)?;
        let dst = output_dir.join(name);
        if dst.exists() {
            // rename() cannot replace a non-empty directory: move the old one aside first.
            let old = staging.join("old");
            std::fs::rename(&dst, &old).map_err(io_err(&dst))?;
            std::fs::rename(&tmp, &dst).map_err(io_err(&dst))?;
        } else {
            std::fs::rename(&tmp, &dst).map_err(io_err(&dst))?;
        }
        sync_dir(output_dir)?;
        Ok(dst)
    })();
    // Best effort: a leftover staging directory is invisible to `latest` and removed by
    // `remove_temp_dirs`.
    let _ = std::fs::remove_dir_all(&staging);
    result
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    // Directories can be opened and fsynced on Unix; elsewhere this is best effort.
    match std::fs::File::open(dir) {
        Ok(f) => match f.sync_all() {
            Ok(()) => Ok(()),
            Err(_) if !cfg!(unix) => Ok(()),
            Err(e) => Err(io_err(dir)(e)),
        },
        Err(_) if !cfg!(unix) => Ok(()),
        Err(e) => Err(io_err(dir)(e)),
    }
}

/// fsyncs every file directly in `dir`, then `dir` itself.
fn sync_tree(dir: &Path) -> Result<(), CheckpointError> {
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.is_file() {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io_err(&path))?;
        }
    }
    sync_dir(dir)
}
