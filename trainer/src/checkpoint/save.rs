//! Writing a checkpoint (`step_N/`) or the final model (`final/`).

use super::atomic::write_atomically;
use super::state::write_state;
use super::{step_dir_name, CheckpointError, TrainerState, FINAL_DIR, OPTIMIZER_FILE, STATE_FILE};
use candle_core::Tensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::hf::{write_model_dir, ModelConfig};

/// What [`save`] writes.
pub struct CheckpointData<'a> {
    /// Student weights by Hugging Face name.
    pub model: &'a HashMap<String, Tensor>,
    pub model_config: &'a ModelConfig,
    /// The student's `tokenizer.json` (copied with its `tokenizer_config.json`, if any).
    pub tokenizer_json: &'a Path,
    pub optimizer: &'a HashMap<String, Tensor>,
    pub state: &'a TrainerState,
}

/// Writes `OUTPUT/step_<state.step>/` atomically and returns its path. An existing checkpoint
/// of the same step is replaced.
pub fn save(output_dir: &Path, data: &CheckpointData) -> Result<PathBuf, CheckpointError> {
    let name = step_dir_name(data.state.step);
    write_atomically(output_dir, &name, |tmp| {
        write_model_dir(tmp, data.model_config, data.model, data.tokenizer_json)?;
        write_tensors(&tmp.join(OPTIMIZER_FILE), data.optimizer)?;
        write_state(&tmp.join(STATE_FILE), data.state)
    })
}

/// Writes the final model to `OUTPUT/final/` (Hugging Face layout plus `trainer_state.json`).
pub fn save_final(
    output_dir: &Path,
    model: &HashMap<String, Tensor>,
    model_config: &ModelConfig,
    tokenizer_json: &Path,
    state: &TrainerState,
) -> Result<PathBuf, CheckpointError> {
    write_atomically(output_dir, FINAL_DIR, |tmp| {
        write_model_dir(tmp, model_config, model, tokenizer_json)?;
        write_state(&tmp.join(STATE_FILE), state)
    })
}

fn write_tensors(path: &Path, tensors: &HashMap<String, Tensor>) -> Result<(), CheckpointError> {
    let mut owned: Vec<(&str, Tensor)> = Vec::with_capacity(tensors.len());
    for (k, v) in tensors {
        let v = v.contiguous().map_err(|e| CheckpointError::Safetensors {
            path: path.to_path_buf(),
            message: format!("{k}: {e}"),
        })?;
        owned.push((k.as_str(), v));
    }
    owned.sort_by(|a, b| a.0.cmp(b.0));
    safetensors::serialize_to_file(owned.iter().map(|(k, v)| (*k, v)), None, path).map_err(|e| {
        CheckpointError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    })
}
