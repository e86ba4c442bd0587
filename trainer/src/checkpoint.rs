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

use crate::data::DataPosition;
use candle_core::{Device, Tensor};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use xdistill_shared::hf::{write_model_dir, HfError, ModelConfig};

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

/// A checkpoint read back by [`load`].
#[derive(Debug)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub model_config: ModelConfig,
    pub model: HashMap<String, Tensor>,
    pub optimizer: HashMap<String, Tensor>,
    pub state: TrainerState,
}

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

/// Runs `fill` on a fresh directory inside a hidden staging directory, fsyncs it, and renames it
/// to `output_dir/name`. On failure the staging directory (with anything `fill` left in it,
/// including `write_model_dir`'s own temp directory) is removed.
fn write_atomically(
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

/// SHA-256 of a file, hex, read in 1 MiB blocks.
fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Writes `dir/checksums.sha256`: one `HEX  NAME` line per file of `dir`, sorted by name.
fn write_manifest(dir: &Path) -> Result<(), CheckpointError> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if entry.path().is_file() && name != CHECKSUM_FILE {
            names.push(name);
        }
    }
    names.sort();
    let mut text = String::new();
    for name in names {
        text += &format!("{}  {name}\n", sha256_file(&dir.join(&name))?);
    }
    let path = dir.join(CHECKSUM_FILE);
    std::fs::write(&path, text).map_err(io_err(&path))
}

/// Checks every file named in `dir/checksums.sha256`. Returns `false` (nothing verified) for a
/// checkpoint written before manifests existed; a missing file or a wrong hash is an error
/// naming the file.
pub fn verify(dir: &Path) -> Result<bool, CheckpointError> {
    let manifest = dir.join(CHECKSUM_FILE);
    let text = match std::fs::read_to_string(&manifest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(&manifest)(e)),
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Some((want, name)) = line.split_once("  ") else {
            return Err(CheckpointError::Corrupt {
                path: manifest.clone(),
                message: format!("bad line {line:?}"),
            });
        };
        let path = dir.join(name);
        if name.contains('/') || name.contains('\\') || !path.is_file() {
            return Err(CheckpointError::Corrupt {
                path,
                message: "file named in the checksum manifest is missing".into(),
            });
        }
        let got = sha256_file(&path)?;
        if got != want {
            return Err(CheckpointError::Corrupt {
                path,
                message: format!("SHA-256 {got} does not match the manifest's {want}"),
            });
        }
    }
    Ok(true)
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

fn write_state(path: &Path, state: &TrainerState) -> Result<(), CheckpointError> {
    let text = serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::State {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text).map_err(io_err(path))
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

/// Reads a trainer state file.
pub fn read_state(dir: &Path) -> Result<TrainerState, CheckpointError> {
    let path = dir.join(STATE_FILE);
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
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
    let cfg_bytes = std::fs::read(&cfg_path).map_err(io_err(&cfg_path))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use rand::{RngCore, SeedableRng};

    fn tiny_config() -> ModelConfig {
        serde_json::from_str(
            r#"{"model_type":"qwen3","vocab_size":16,"hidden_size":8,"intermediate_size":16,
                "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":4}"#,
        )
        .unwrap()
    }

    fn tensors(seed: u64) -> HashMap<String, Tensor> {
        // Random bit patterns (including values that print identically but differ in the last
        // bit) so that any lossy conversion would show.
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut f = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| f32::from_bits((rng.next_u32() & 0x3fff_ffff) | 0x3000_0000))
                .collect()
        };
        let dev = Device::Cpu;
        let mut m = HashMap::new();
        m.insert(
            "model.embed_tokens.weight".to_string(),
            Tensor::from_vec(f(16 * 8), (16, 8), &dev).unwrap(),
        );
        m.insert(
            "model.norm.weight".to_string(),
            Tensor::from_vec(f(8), 8, &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        );
        m
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        match t.dtype() {
            DType::BF16 => t
                .flatten_all()
                .unwrap()
                .to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u32)
                .collect(),
            _ => t
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        }
    }

    fn assert_same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) {
        assert_eq!(a.len(), b.len());
        for (k, t) in a {
            let u = &b[k];
            assert_eq!(t.dtype(), u.dtype(), "{k}");
            assert_eq!(t.dims(), u.dims(), "{k}");
            assert_eq!(bits(t), bits(u), "{k}");
        }
    }

    fn tokenizer_file(dir: &Path) -> PathBuf {
        let p = dir.join("tok").join("tokenizer.json");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"{\"not\": \"a real tokenizer\"}").unwrap();
        p
    }

    fn state(step: u64) -> TrainerState {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for _ in 0..step {
            rng.next_u64();
        }
        TrainerState::new(
            step,
            DataPosition {
                epoch: 1,
                index: 3 * step as usize,
            },
            &rng,
            "h".into(),
        )
    }

    fn save_step(out: &Path, tok: &Path, step: u64, metric: Option<f64>) -> PathBuf {
        let mut st = state(step);
        if let Some(v) = metric {
            st.metrics.insert("val_loss".into(), v);
        }
        save(
            out,
            &CheckpointData {
                model: &tensors(step),
                model_config: &tiny_config(),
                tokenizer_json: tok,
                optimizer: &tensors(step + 100),
                state: &st,
            },
        )
        .unwrap()
    }

    #[test]
    fn round_trip_is_bit_exact_and_loadable_as_a_model_dir() {
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_file(dir.path());
        let out = dir.path().join("out");
        let p = save_step(&out, &tok, 7, Some(1.5));
        assert_eq!(p, out.join("step_7"));
        let ck = load(&p, &Device::Cpu).unwrap();
        assert_same(&ck.model, &tensors(7));
        assert_same(&ck.optimizer, &tensors(107));
        let mut expect = state(7);
        expect.metrics.insert("val_loss".into(), 1.5);
        assert_eq!(ck.state, expect);
        assert_eq!(ck.model_config.hidden_size, 8);
        // The directory is a Hugging Face model directory the teacher can open.
        let md = xdistill_shared::hf::ModelDir::open(&p).unwrap();
        assert_eq!(md.weights, vec![p.join(MODEL_FILE)]);
        // Saving the same step again replaces it.
        save_step(&out, &tok, 7, Some(1.0));
        assert_eq!(read_state(&p).unwrap().metrics["val_loss"], 1.0);
        assert_eq!(list(&out).unwrap().len(), 1);
    }

    #[test]
    fn corrupt_newest_checkpoint_falls_back_to_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_file(dir.path());
        let out = dir.path().join("out");
        save_step(&out, &tok, 2, None);
        let p4 = save_step(&out, &tok, 4, None);
        // Every file is in the manifest, which verifies.
        let manifest = std::fs::read_to_string(p4.join(CHECKSUM_FILE)).unwrap();
        for f in [
            MODEL_FILE,
            OPTIMIZER_FILE,
            STATE_FILE,
            "config.json",
            "tokenizer.json",
        ] {
            assert!(manifest.contains(&format!("  {f}\n")), "{manifest}");
        }
        assert!(verify(&p4).unwrap());
        // One flipped bit in the last tensor byte of the newest checkpoint.
        let mut bytes = std::fs::read(p4.join(MODEL_FILE)).unwrap();
        *bytes.last_mut().unwrap() ^= 0x01;
        std::fs::write(p4.join(MODEL_FILE), &bytes).unwrap();
        let e = verify(&p4).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("SHA-256"),
            "{e}"
        );
        let ck = load_newest_valid(&out, &Device::Cpu).unwrap().unwrap();
        assert_eq!(ck.state.step, 2);
        assert_same(&ck.model, &tensors(2));
        // The corrupt one is set aside, so it is neither resumed nor counted by pruning.
        assert!(out.join("step_4.corrupt").is_dir());
        assert_eq!(list(&out).unwrap(), vec![(2, out.join("step_2"))]);
        // A checkpoint without a manifest (an older trainer's) still loads, unverified.
        std::fs::remove_file(out.join("step_2").join(CHECKSUM_FILE)).unwrap();
        assert!(!verify(&out.join("step_2")).unwrap());
        assert_eq!(
            load_newest_valid(&out, &Device::Cpu)
                .unwrap()
                .unwrap()
                .state
                .step,
            2
        );
        // When every checkpoint is corrupt, resuming is an error.
        std::fs::write(out.join("step_2").join(MODEL_FILE), b"garbage").unwrap();
        assert!(load_newest_valid(&out, &Device::Cpu).is_err());
    }

    #[test]
    fn non_finite_weights_make_a_checkpoint_unusable() {
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_file(dir.path());
        let out = dir.path().join("out");
        save_step(&out, &tok, 1, None);
        let mut model = tensors(3);
        model.insert(
            "model.embed_tokens.weight".into(),
            Tensor::from_vec(vec![f32::NAN; 16 * 8], (16, 8), &Device::Cpu).unwrap(),
        );
        save(
            &out,
            &CheckpointData {
                model: &model,
                model_config: &tiny_config(),
                tokenizer_json: &tok,
                optimizer: &HashMap::new(),
                state: &state(3),
            },
        )
        .unwrap();
        assert_eq!(
            load_newest_valid(&out, &Device::Cpu)
                .unwrap()
                .unwrap()
                .state
                .step,
            1
        );
    }

    #[test]
    fn rng_state_restores_the_exact_stream() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        rng.set_stream(3);
        for _ in 0..13 {
            rng.next_u32(); // odd count: mid-block position
        }
        let saved: RngState =
            serde_json::from_str(&serde_json::to_string(&RngState::capture(&rng)).unwrap())
                .unwrap();
        let mut back = saved.restore().unwrap();
        let a: Vec<u64> = (0..40).map(|_| rng.next_u64()).collect();
        let b: Vec<u64> = (0..40).map(|_| back.next_u64()).collect();
        assert_eq!(a, b);
        let bad = RngState {
            seed: "00".into(),
            ..saved
        };
        assert!(bad.restore().is_err());
    }

    #[test]
    fn interrupted_saves_are_invisible() {
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_file(dir.path());
        let out = dir.path().join("out");
        assert_eq!(latest(&out).unwrap(), None);
        save_step(&out, &tok, 2, None);
        // A crash mid-write leaves a hidden temp dir with a partial checkpoint of a later step.
        let crashed = out.join(".step_4.tmp-999-1");
        std::fs::create_dir_all(&crashed).unwrap();
        std::fs::write(crashed.join(MODEL_FILE), b"partial").unwrap();
        // And a step directory without its state file (e.g. copied by hand, incompletely).
        std::fs::create_dir_all(out.join("step_9")).unwrap();
        assert_eq!(latest(&out).unwrap(), Some((2, out.join("step_2"))));
        // A save that fails midway (the tokenizer is missing) leaves nothing behind.
        let err = save(
            &out,
            &CheckpointData {
                model: &tensors(3),
                model_config: &tiny_config(),
                tokenizer_json: &dir.path().join("missing.json"),
                optimizer: &HashMap::new(),
                state: &state(3),
            },
        );
        assert!(err.is_err());
        assert!(!out.join("step_3").exists());
        assert_eq!(latest(&out).unwrap(), Some((2, out.join("step_2"))));
        assert_eq!(remove_temp_dirs(&out).unwrap(), 1);
        assert!(!crashed.exists());
    }

    /// The pieces a resume needs (data position, RNG, tensors) compose: a toy run whose update
    /// depends on the batch text and on RNG draws, interrupted after step 3 and resumed from
    /// its checkpoint, ends bit-identical to the uninterrupted run.
    #[test]
    fn toy_run_resumed_from_a_checkpoint_matches_an_uninterrupted_one() {
        use crate::data::{BatchOptions, Batcher, Content, Record};
        let records: Vec<Record> = (0..7)
            .map(|i| Record {
                line: i + 1,
                content: Content::Text {
                    text: format!("record number {i}"),
                },
                completion_only_loss: false,
                teacher: None,
            })
            .collect();
        let opts = BatchOptions {
            batch_size: 2,
            seed: 3,
            shuffle: true,
            drop_last: false,
            max_epochs: 3,
        };
        // One "step": w ← 0.9·w + (bytes of the batch) · noise, momentum m ← 0.5·m + w.
        let step = |w: &mut Vec<f32>, m: &mut Vec<f32>, texts: &[String], rng: &mut ChaCha8Rng| {
            let bytes: f32 = texts.iter().map(|t| t.len() as f32).sum();
            for (wi, mi) in w.iter_mut().zip(m.iter_mut()) {
                let noise = (rng.next_u32() % 1000) as f32 / 1000.0;
                *wi = 0.9 * *wi + bytes * noise * 1e-3;
                *mi = 0.5 * *mi + *wi;
            }
        };
        let run = |from: Option<&Path>, stop_after: usize, out: &Path| -> (Vec<f32>, Vec<f32>) {
            let dev = Device::Cpu;
            let (mut w, mut m, mut rng, mut batcher, mut n) = match from {
                None => {
                    let mut rng = ChaCha8Rng::seed_from_u64(3);
                    rng.set_stream(1);
                    (
                        vec![0.1f32; 4],
                        vec![0f32; 4],
                        rng,
                        Batcher::new(records.clone(), opts),
                        0,
                    )
                }
                Some(dir) => {
                    let ck = load(dir, &dev).unwrap();
                    let mut b = Batcher::new(records.clone(), opts);
                    b.seek(ck.state.data).unwrap();
                    (
                        ck.model["w"].to_vec1::<f32>().unwrap(),
                        ck.optimizer["m"].to_vec1::<f32>().unwrap(),
                        ck.state.rng.restore().unwrap(),
                        b,
                        ck.state.step as usize,
                    )
                }
            };
            let tok = tokenizer_file(out);
            for batch in batcher.by_ref() {
                let texts: Vec<String> = batch.records.iter().map(Record::text).collect();
                step(&mut w, &mut m, &texts, &mut rng);
                n += 1;
                let st = TrainerState::new(n as u64, batch.next, &rng, "h".into());
                save(
                    out,
                    &CheckpointData {
                        model: &[("w".to_string(), Tensor::new(w.as_slice(), &dev).unwrap())]
                            .into(),
                        model_config: &tiny_config(),
                        tokenizer_json: &tok,
                        optimizer: &[("m".to_string(), Tensor::new(m.as_slice(), &dev).unwrap())]
                            .into(),
                        state: &st,
                    },
                )
                .unwrap();
                if n == stop_after {
                    break;
                }
            }
            (w, m)
        };
        let dir = tempfile::tempdir().unwrap();
        let full = run(None, usize::MAX, &dir.path().join("a"));
        let out = dir.path().join("b");
        run(None, 3, &out);
        let (_, ck) = latest(&out).unwrap().unwrap();
        assert_eq!(ck, out.join("step_3"));
        let resumed = run(Some(&ck), usize::MAX, &out);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&resumed.0), bits(&full.0));
        assert_eq!(bits(&resumed.1), bits(&full.1));
        // 7 records in batches of 2: 4 steps per epoch, 3 epochs.
        assert_eq!(latest(&out).unwrap().unwrap().0, 12);
    }

    #[test]
    fn retention_keeps_the_newest_and_the_best() {
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_file(dir.path());
        let out = dir.path().join("out");
        let vals = [(1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0), (5, 4.0)];
        for (s, v) in vals {
            save_step(&out, &tok, s, Some(v));
        }
        std::fs::create_dir_all(out.join(FINAL_DIR)).unwrap();
        let steps = |out: &Path| {
            list(out)
                .unwrap()
                .into_iter()
                .map(|(s, _)| s)
                .collect::<Vec<_>>()
        };

        let ranking = Ranking::Metric {
            name: "val_loss".into(),
            higher_is_better: false,
        };
        retain(&out, 3, &ranking).unwrap();
        // Newest (5) plus the two lowest val_loss among the rest (2: 1.0, 3: 2.0).
        assert_eq!(steps(&out), [2, 3, 5]);
        retain(&out, 2, &Ranking::Newest).unwrap();
        assert_eq!(steps(&out), [3, 5]);
        retain(&out, 1, &Ranking::Newest).unwrap();
        assert_eq!(steps(&out), [5]);
        assert!(out.join(FINAL_DIR).is_dir());
    }
}
