//! What a checkpoint records besides tensors: the RNG's exact state and `trainer_state.json`.

use super::{io_err, CheckpointError, STATE_FILE, STATE_VERSION};
use crate::data::DataPosition;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The full state of a ChaCha8 generator (seed, stream, position), exact across save/load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// The 32-byte seed, hex.
    pub seed: String,
    pub stream: u64,
    /// Position in 32-bit words (a u128, written as a decimal string since JSON numbers are not
    /// exact beyond 2^53).
    pub word_pos: String,
}

impl RngState {
    pub fn capture(rng: &ChaCha8Rng) -> RngState {
        RngState {
            seed: hex::encode(rng.get_seed()),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    pub fn restore(&self) -> Result<ChaCha8Rng, String> {
        use rand::SeedableRng;
        let bytes = hex::decode(&self.seed).map_err(|e| format!("rng.seed: {e}"))?;
        let seed: [u8; 32] = bytes
            .try_into()
            .map_err(|_| "rng.seed: expected 32 bytes".to_string())?;
        let pos: u128 = self
            .word_pos
            .parse()
            .map_err(|e| format!("rng.word_pos: {e}"))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(pos);
        Ok(rng)
    }
}

/// Everything besides tensors that a resumed run needs (`trainer_state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: u64,
    /// Where the next batch starts (the `Batch::next` of the last trained batch).
    pub data: DataPosition,
    /// The trainer's RNG after the last step.
    pub rng: RngState,
    /// Training tokens consumed so far.
    #[serde(default)]
    pub tokens_seen: u64,
    /// Best validation value so far (lower is better unless the config says otherwise).
    #[serde(default)]
    pub best_val: Option<f64>,
    /// Latest metrics worth keeping (e.g. `val_loss`); also used to rank checkpoints.
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// `Config::training_hash()` of the run that wrote it.
    #[serde(default)]
    pub config_hash: String,
    /// Free-form state of other modules (e.g. the optimizer's scalar step counter).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl TrainerState {
    pub fn new(step: u64, data: DataPosition, rng: &ChaCha8Rng, config_hash: String) -> Self {
        TrainerState {
            format_version: STATE_VERSION,
            step,
            data,
            rng: RngState::capture(rng),
            tokens_seen: 0,
            best_val: None,
            metrics: BTreeMap::new(),
            config_hash,
            extra: serde_json::Value::Null,
        }
    }
}

/// The largest trainer state file read: a real one holds a few KB (positions, counters, the
/// RNG's seed, the recent metrics).
const STATE_FILE_LIMIT: u64 = 64 << 20;

/// Reads a trainer state file.
pub fn read_state(dir: &Path) -> Result<TrainerState, CheckpointError> {
    let path = dir.join(STATE_FILE);
    let bytes = super::read_json_file(&path, STATE_FILE_LIMIT, "trainer state")?;
    let state: TrainerState =
        serde_json::from_slice(&bytes).map_err(|e| CheckpointError::State {
            path: path.clone(),
            message: e.to_string(),
        })?;
    if state.format_version != STATE_VERSION {
        return Err(CheckpointError::State {
            path,
            message: format!(
                "format_version {} (this trainer reads {STATE_VERSION})",
                state.format_version
            ),
        });
    }
    Ok(state)
}

pub(super) fn write_state(path: &Path, state: &TrainerState) -> Result<(), CheckpointError> {
    let text = serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::State {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text).map_err(io_err(path))
}
