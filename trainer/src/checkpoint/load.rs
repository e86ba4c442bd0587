//! Reading a checkpoint back, and finding the newest one that is intact.

use super::{
    list, read_state, step_dir_name, verify, CheckpointError, TrainerState, CHECKSUM_FILE,
    CORRUPT_SUFFIX, MODEL_FILE, OPTIMIZER_FILE,
};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::hf::ModelConfig;

/// A checkpoint read back by [`load`].
#[derive(Debug)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub model_config: ModelConfig,
    pub model: HashMap<String, Tensor>,
    pub optimizer: HashMap<String, Tensor>,
    pub state: TrainerState,
}

fn read_tensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>, CheckpointError> {
    candle_core::safetensors::load(path, device).map_err(|e| CheckpointError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Loads a checkpoint directory (`step_N/`) onto `device`, tensors in their stored dtype.
pub fn load(dir: &Path, device: &Device) -> Result<Checkpoint, CheckpointError> {
    let state = read_state(dir)?;
    let cfg_path = dir.join("config.json");
    let cfg_bytes = super::read_json_file(
        &cfg_path,
        xdistill_shared::hf::limits::CONFIG_JSON,
        "config.json",
    )?;
    let model_config: ModelConfig =
        serde_json::from_slice(&cfg_bytes).map_err(|e| CheckpointError::State {
            path: cfg_path.clone(),
            message: e.to_string(),
        })?;
    // Nothing is allocated from `model_config` here: a resume restores these tensors into the
    // student (loaded and checked from `policy.model_name`), which checks every name and shape.
    let model = read_tensors(&dir.join(MODEL_FILE), device)?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let optimizer = if opt_path.is_file() {
        read_tensors(&opt_path, device)?
    } else {
        HashMap::new()
    };
    Ok(Checkpoint {
        path: dir.to_path_buf(),
        model_config,
        model,
        optimizer,
        state,
    })
}

/// Fails when a model tensor holds NaN or ±inf.
fn check_finite(dir: &Path, model: &HashMap<String, Tensor>) -> Result<(), CheckpointError> {
    for (name, t) in model {
        let m = t
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.abs()?.max_all()?.to_scalar::<f32>());
        match m {
            Ok(v) if v.is_finite() => {}
            Ok(_) => {
                return Err(CheckpointError::Corrupt {
                    path: dir.join(MODEL_FILE),
                    message: format!("tensor {name:?} holds non-finite values"),
                })
            }
            Err(e) => {
                return Err(CheckpointError::Safetensors {
                    path: dir.join(MODEL_FILE),
                    message: format!("{name}: {e}"),
                })
            }
        }
    }
    Ok(())
}

/// Verifies and loads the newest usable checkpoint. A corrupt one (checksum mismatch, unreadable
/// file, non-finite weights) is reported with a warning naming the file, renamed to
/// `step_N.corrupt` so that no later resume or pruning takes it for a checkpoint, and the next
/// older one is tried. `Ok(None)`: no checkpoint at all; an error when every one is corrupt.
pub fn load_newest_valid(
    output_dir: &Path,
    device: &Device,
) -> Result<Option<Checkpoint>, CheckpointError> {
    let all = list(output_dir)?;
    if all.is_empty() {
        return Ok(None);
    }
    let mut errors = Vec::new();
    for (step, path) in all.into_iter().rev() {
        let attempt = verify(&path).and_then(|verified| {
            if !verified {
                tracing::warn!(
                    "{}: no {CHECKSUM_FILE} (written by an older trainer): not verified",
                    path.display()
                );
            }
            let ck = load(&path, device)?;
            check_finite(&path, &ck.model)?;
            Ok(ck)
        });
        match attempt {
            Ok(ck) => return Ok(Some(ck)),
            Err(e) => {
                let aside = output_dir.join(format!("{}{CORRUPT_SUFFIX}", step_dir_name(step)));
                let moved = !aside.exists() && std::fs::rename(&path, &aside).is_ok();
                tracing::warn!(
                    "checkpoint step {step} is unusable: {e}; {}falling back to the previous checkpoint",
                    if moved {
                        format!("moved to {}; ", aside.display())
                    } else {
                        String::new()
                    }
                );
                errors.push(e.to_string());
            }
        }
    }
    Err(CheckpointError::Corrupt {
        path: output_dir.to_path_buf(),
        message: format!(
            "no usable checkpoint to resume from ({}); remove them or run without --resume",
            errors.join("; ")
        ),
    })
}
