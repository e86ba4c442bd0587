//! `[policy]` and `[policy.optimizer]`: the student model and how it is trained.

use super::{invalid, ConfigError, Validate};
use serde::{Deserialize, Deserializer, Serialize};
use std::path::PathBuf;
use xdistill_shared::model::{Activations, Decoder};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Student model directory in Hugging Face layout (`trainer init-model` makes one).
    pub model_name: PathBuf,
    /// Student tokenizer; default `<model_name>/tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// Longest tokenized sequence (student tokens); longer records are skipped (or truncated
    /// with `data.truncate`).
    pub max_total_sequence_length: usize,
    /// Compute dtype: `auto` (bf16 on a GPU, f32 on the CPU), f32, bf16 or f16 (master weights
    /// stay f32 either way).
    pub precision: String,
    /// `auto` (the default: the first GPU where the binary has CUDA and the machine a GPU, else
    /// the CPU; in a data-parallel job a GPU means `cuda:LOCAL_RANK`), `cpu`, `cuda` or
    /// `cuda:N`.
    pub device: String,
    /// Sequences per forward/backward pass; a step accumulates gradients over
    /// `ceil(num_prompts_per_step / train_micro_batch_size)` micro-batches.
    pub train_micro_batch_size: usize,
    /// Abort the run after this many consecutive steps with a non-finite gradient norm (each
    /// is skipped); 0: never abort.
    pub max_nonfinite_steps: u64,
    /// Whether the training forward keeps every activation or only each layer's input
    /// (recomputing layers in the backward): `"auto"`, `true` or `false`.
    pub activation_checkpointing: ActivationCheckpointing,
    pub optimizer: OptimizerConfig,
    /// `[policy.data_parallel]`: how a job of several processes splits and sums a step
    /// (omitted from the serialised config while at its defaults, so the hash of a config
    /// without the section is unchanged).
    #[serde(skip_serializing_if = "DataParallelConfig::is_default")]
    pub data_parallel: DataParallelConfig,
}

/// `[policy.data_parallel]`: data-parallel training (one process per device, launched by
/// torchrun, srun or a Kubernetes indexed Job; see docs/training.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataParallelConfig {
    /// `S`: a step's gradient is the pairwise-tree sum of this many virtual shards (contiguous
    /// slices of the step's records), each process computing a contiguous share; the number
    /// of processes must divide it. With `S/N` a power of two, every such `N` gives the same
    /// weights bit for bit. `"auto"` (the default): see [`VirtualShards::Auto`]; 0: one shard
    /// per process.
    pub virtual_shards: VirtualShards,
    /// ZeRO-1: AdamW's moments and f32 masters sharded over the processes (whole tensors per
    /// process); the same weights as unsharded.
    pub zero: bool,
    /// How long a collective waits for the other processes before naming the one that did
    /// not answer. Rank 0 validates and writes checkpoints while the others wait: cover that.
    pub timeout_s: f64,
    /// `exact`: the gradient's all-reduce is the pairwise tree in rank order (the same bits
    /// for any process count, see `virtual_shards`). `fast`: the backend's own all-reduce
    /// (NCCL's ring or tree: faster, its bits depend on the process count and topology); on
    /// the CPU backend both are the tree.
    pub all_reduce: AllReduceMode,
}

/// `policy.data_parallel.virtual_shards`: `"auto"` or a number. TOML: `"auto"` or an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VirtualShards {
    /// The largest power of two, at most [`VirtualShards::AUTO_MAX`], that divides
    /// `num_prompts_per_step`: equal shards whatever the process count, so a run's weights are
    /// the same at every process count that divides it (1, 2, 4 and 8 for a step of 8k records).
    #[default]
    Auto,
    /// This many shards; 0: one per process (the fewest gradient buffers, but the weights
    /// depend on the process count).
    Fixed(usize),
}

impl VirtualShards {
    /// The most shards `"auto"` picks: 8 processes, four gradient buffers on one.
    pub const AUTO_MAX: usize = 8;
    /// The most shards a config may ask for.
    pub const MAX: usize = 4096;
}

impl Serialize for VirtualShards {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            VirtualShards::Auto => s.serialize_str("auto"),
            VirtualShards::Fixed(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for VirtualShards {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const WANT: &str =
            "policy.data_parallel.virtual_shards must be \"auto\" or a whole number (0: one shard per process)";
        Ok(match super::number_or_word(d, "auto", WANT)? {
            Some(n) => VirtualShards::Fixed(n),
            None => VirtualShards::Auto,
        })
    }
}

/// `policy.data_parallel.all_reduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllReduceMode {
    #[default]
    Exact,
    Fast,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig {
            virtual_shards: VirtualShards::Auto,
            zero: false,
            timeout_s: 1800.0,
            all_reduce: AllReduceMode::Exact,
        }
    }
}

impl DataParallelConfig {
    pub fn is_default(&self) -> bool {
        *self == DataParallelConfig::default()
    }

    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_s)
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            model_name: PathBuf::new(),
            tokenizer: None,
            max_total_sequence_length: 1024,
            precision: "auto".into(),
            device: "auto".into(),
            train_micro_batch_size: 4,
            max_nonfinite_steps: 10,
            activation_checkpointing: ActivationCheckpointing::Auto,
            optimizer: OptimizerConfig::default(),
            data_parallel: DataParallelConfig::default(),
        }
    }
}

/// `policy.activation_checkpointing`: how the student's training forward keeps what its
/// backward needs. Checkpointing keeps each decoder layer's input only and recomputes the layer
/// in the backward (memory linear in the sequence, about one extra forward of compute);
/// selective keeps everything but the attention core, which its backward recomputes block by
/// block (memory linear in the sequence, no GEMM recomputed). TOML: `true`, `false`,
/// `"selective"` or `"auto"` (the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActivationCheckpointing {
    /// Per micro-batch, the cheapest way whose activations fit the device's memory left after
    /// the run's own state (`activation_budget`): keep everything, else selective, else
    /// checkpoint.
    #[default]
    Auto,
    /// Always checkpoint.
    On,
    /// Always selective.
    Selective,
    /// Never: plain autograd (every intermediate lives until the backward).
    Off,
}

impl ActivationCheckpointing {
    /// The way `model` keeps activations for a micro-batch of `b` rows of `t` tokens.
    pub fn resolve(self, model: &Decoder, b: usize, t: usize) -> Activations {
        match self {
            ActivationCheckpointing::Auto => {
                Activations::auto(model, b, t, activation_budget(model))
            }
            ActivationCheckpointing::On => Activations::Checkpoint,
            ActivationCheckpointing::Selective => Activations::Selective,
            ActivationCheckpointing::Off => Activations::Keep,
        }
    }

    /// From the command line's `auto`, `on`/`true`, `selective` or `off`/`false`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" | "true" => Ok(Self::On),
            "selective" => Ok(Self::Selective),
            "off" | "false" => Ok(Self::Off),
            _ => Err(format!(
                "activation checkpointing must be auto, on, selective or off, got {s:?}"
            )),
        }
    }
}

/// Bytes of the run's own state per parameter: f32 master (4), the compute copy (up to 4),
/// AdamW's two f32 moments (8), the gradient and the micro-batches' sum (4 + 4).
const STATE_BYTES_PER_PARAM: f64 = 24.0;
/// Besides the parameters' state: the LM head's chunks (logits and their gradient), the CUDA
/// context and the allocator's slack.
const STATE_BYTES_FIXED: f64 = (2u64 << 30) as f64;
/// Used where the device's memory is unknown: the earlier fixed rule's 1 GiB.
const UNKNOWN_BUDGET: f64 = (1u64 << 30) as f64;

/// The bytes a micro-batch's kept activations may take on `model`'s device: the device's
/// memory (a GPU's, or the machine's or its cgroup's limit) less the run's own state
/// ([`STATE_BYTES_PER_PARAM`], [`STATE_BYTES_FIXED`]), three quarters of it on a GPU and half on
/// the CPU (shared with the system and often a teacher). From the total, not the free memory,
/// so a resumed run chooses as the first run did.
pub fn activation_budget(model: &Decoder) -> f64 {
    let Some(mem) = xdistill_shared::device::memory_info(model.device()) else {
        return UNKNOWN_BUDGET;
    };
    let params = xdistill_shared::init::parameter_count(model.config());
    let room = mem.total as f64 - params * STATE_BYTES_PER_PARAM - STATE_BYTES_FIXED;
    let share = if model.device().is_cpu() { 0.5 } else { 0.75 };
    (room * share).max(0.0)
}

impl Serialize for ActivationCheckpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ActivationCheckpointing::Auto => s.serialize_str("auto"),
            ActivationCheckpointing::On => s.serialize_bool(true),
            ActivationCheckpointing::Selective => s.serialize_str("selective"),
            ActivationCheckpointing::Off => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for ActivationCheckpointing {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const WANT: &str =
            "policy.activation_checkpointing must be true, false, \"selective\" or \"auto\"";
        impl serde::de::Visitor<'_> for V {
            type Value = ActivationCheckpointing;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(WANT)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(if v {
                    ActivationCheckpointing::On
                } else {
                    ActivationCheckpointing::Off
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "auto" => Ok(ActivationCheckpointing::Auto),
                    "selective" => Ok(ActivationCheckpointing::Selective),
                    _ => Err(E::custom(format!("{WANT}, got {v:?}"))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Shape of the learning rate after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Constant,
    Linear,
    /// Cosine decay from `lr` to `min_lr` at `max_num_steps`.
    #[default]
    Cosine,
}

/// `[policy.optimizer]`: AdamW with warm-up, decay and gradient clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub lr: f64,
    pub min_lr: f64,
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Linear warm-up from 0 to `lr` over this many steps.
    pub warmup_steps: u64,
    pub schedule: LrSchedule,
    /// Clip the global gradient L2 norm to this; 0 disables clipping.
    pub max_grad_norm: f64,
    /// Also apply weight decay to 1-D parameters (norm weights, biases).
    pub decay_1d: bool,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            lr: 1e-4,
            min_lr: 0.0,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
            warmup_steps: 0,
            schedule: LrSchedule::Cosine,
            max_grad_norm: 1.0,
            decay_1d: false,
        }
    }
}

impl Validate for PolicyConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        let p = self;
        let key = |name: &str| format!("{at}.{name}");
        if p.model_name.as_os_str().is_empty() {
            return Err(invalid(
                &key("model_name"),
                "the student model directory is required (or --student)",
            ));
        }
        if xdistill_shared::gguf::is_gguf(&p.model_name) {
            return Err(invalid(
                &key("model_name"),
                format!(
                    "{} is a GGUF file: a student is trained from a Hugging Face model directory \
                     (config.json, safetensors, tokenizer.json); GGUF files load for inference \
                     only (the teacher, `trainer eval`)",
                    p.model_name.display()
                ),
            ));
        }
        if p.max_total_sequence_length < 2 {
            return Err(invalid(
                &key("max_total_sequence_length"),
                "must be at least 2",
            ));
        }
        xdistill_shared::device::check_dtype(&p.precision)
            .map_err(|e| invalid(&key("precision"), e.to_string()))?;
        if !is_device_name(&p.device) {
            return Err(invalid(
                &key("device"),
                format!("{:?} is not auto, cpu, cuda or cuda:N", p.device),
            ));
        }
        if p.train_micro_batch_size == 0 {
            return Err(invalid(
                &key("train_micro_batch_size"),
                "must be at least 1",
            ));
        }
        let t = p.data_parallel.timeout_s;
        if !(t.is_finite() && t > 0.0 && t < 1e7) {
            return Err(invalid(
                &key("data_parallel.timeout_s"),
                "must be a positive number of seconds",
            ));
        }
        if let VirtualShards::Fixed(s) = p.data_parallel.virtual_shards {
            if s > VirtualShards::MAX {
                return Err(invalid(
                    &key("data_parallel.virtual_shards"),
                    format!(
                        "{s} shards per step: at most {} (each is a gradient to compute and \
                         sum every step, an empty one too)",
                        VirtualShards::MAX
                    ),
                ));
            }
        }
        p.optimizer.validate_at(&key("optimizer"))
    }
}

impl Validate for OptimizerConfig {
    fn validate_at(&self, at: &str) -> Result<(), ConfigError> {
        let o = self;
        let key = |name: &str| format!("{at}.{name}");
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return Err(invalid(&key("lr"), "must be positive"));
        }
        if !(o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
            return Err(invalid(&key("min_lr"), "must be in [0, lr]"));
        }
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err(invalid(&key("weight_decay"), "must be >= 0"));
        }
        if o.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
            return Err(invalid(&key("betas"), "each beta must be in [0, 1)"));
        }
        if !(o.eps.is_finite() && o.eps > 0.0) {
            return Err(invalid(&key("eps"), "must be positive"));
        }
        if !(o.max_grad_norm.is_finite() && o.max_grad_norm >= 0.0) {
            return Err(invalid(&key("max_grad_norm"), "must be >= 0"));
        }
        Ok(())
    }
}

fn is_device_name(s: &str) -> bool {
    s == "auto"
        || s == "cpu"
        || s == "cuda"
        || s.strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}
