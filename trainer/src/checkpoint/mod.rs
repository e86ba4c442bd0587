//! Training checkpoints under the run's output directory.
//!
//! Layout of `OUTPUT/step_N/` (a complete Hugging Face model directory, so `teacher --model
//! OUTPUT/step_N` and transformers load it as is, plus the trainer's own files):
//!
//! ```text
//! config.json  model.safetensors  tokenizer.json  [tokenizer_config.json]
//! optimizer.safetensors   optimizer state tensors (names chosen by the optimizer)
//! trainer_state.json      TrainerState: step, data position, RNG, metrics, config hash
//! checksums.sha256        SHA-256 of every other file (`sha256sum -c` format)
//! ```
//!
//! A checkpoint is written into `OUTPUT/.step_N.tmp-*`, every file is fsynced, and the directory
//! is renamed to `step_N` only when complete: a crash leaves at most a hidden temp directory,
//! which [`latest`] ignores and [`remove_temp_dirs`] deletes. `OUTPUT/final/` has the same
//! layout without the optimizer state.
//!
//! The checksum manifest is written inside the staging directory, so it appears atomically with
//! the files it covers; [`verify`] checks it on resume, and [`load_newest_valid`] falls back to
//! an older checkpoint when the newest is corrupt.

mod atomic;
mod listing;
mod load;
mod manifest;
mod retention;
mod save;
mod state;

pub use listing::{corrupt_dirs, latest, list, remove_temp_dirs, step_dir_name};
pub use load::{load, load_newest_valid, Checkpoint};
pub use manifest::verify;
pub use retention::{retain, Ranking};
pub use save::{save, save_final, CheckpointData};
pub use state::{read_state, RngState, TrainerState};

use std::path::{Path, PathBuf};
use xdistill_shared::hf::HfError;

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const MODEL_FILE: &str = "model.safetensors";
pub const FINAL_DIR: &str = "final";
pub const CHECKSUM_FILE: &str = "checksums.sha256";
/// Suffix of a checkpoint directory set aside as corrupt (ignored by [`list`]).
pub const CORRUPT_SUFFIX: &str = ".corrupt";
/// Version of `trainer_state.json`; bumped on incompatible changes.
pub const STATE_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the model: {0}")]
    Model(#[from] HfError),
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: invalid trainer state: {message}")]
    State { path: PathBuf, message: String },
    #[error("{path}: corrupt checkpoint: {message}")]
    Corrupt { path: PathBuf, message: String },
    /// `--resume` found no valid checkpoint but a previous run's traces: starting from step 0
    /// would silently lose that run (a restart loop would repeat it forever).
    #[error(
        "{dir}: --resume found no valid checkpoint, but a previous run left {}; refusing to start \
         over silently: remove them, or start from step 0 on purpose with --start-fresh \
         (checkpointing.start_fresh = true)",
        list_paths(.leftovers)
    )]
    NothingToResume {
        dir: PathBuf,
        leftovers: Vec<PathBuf>,
    },
}

fn list_paths(paths: &[PathBuf]) -> String {
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(", ")
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The bytes of a checkpoint's JSON file, at most `limit` of them (a resumed directory is
/// whatever is on disk: a file of gigabytes in its place is refused, not read into memory).
fn read_json_file(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>, CheckpointError> {
    xdistill_shared::hf::read_capped(path, limit, what).map_err(|e| match e {
        xdistill_shared::hf::HfError::Io { source, .. } => io_err(path)(source),
        other => CheckpointError::State {
            path: path.to_path_buf(),
            message: other.to_string(),
        },
    })
}

#[cfg(test)]
mod tests;
