//! Shared by the distillation end-to-end tests: tiny models and short-run configs.

use std::path::{Path, PathBuf};
use xdistill_shared::init::{init_model_dir, random_params, InitSpec};
use xdistill_trainer::config::{CommonArgs, Config, DistillArgs, ObjectiveKind};

#[allow(clippy::too_many_arguments)]
pub fn model(
    dir: &Path,
    name: &str,
    arch: &str,
    tokenizer: &str,
    hidden: usize,
    layers: usize,
    std: f64,
    seed: u64,
) -> PathBuf {
    let out = dir.join(name);
    init_model_dir(&InitSpec {
        arch: arch.into(),
        tokenizer: xdistill_shared::paths::tokenizer_json(tokenizer),
        hidden_size: hidden,
        layers,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 2 * hidden,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: false,
        init_std: std,
        seed,
        out: out.clone(),
        features: Default::default(),
    })
    .expect("init-model");
    out
}

/// A teacher whose predictions mostly depend on the current token: large random embedding and
/// LM head (peaked, token-specific distributions), small attention and MLP weights. A student can
/// learn that from a few hundred records and generalise to held-out text.
pub fn token_driven_teacher(dir: &Path, arch: &str, tokenizer: &str, seed: u64) -> PathBuf {
    let (args, cfg) = teacher_args(dir, arch, tokenizer, seed);
    let out = args.out.clone();
    let mut params = random_params(&cfg, 0.02, seed).unwrap();
    let big = random_params(&cfg, 0.5, seed + 100).unwrap();
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        params.insert(name.into(), big[name].clone());
    }
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params, &args.tokenizer).unwrap();
    out
}

pub fn data_file() -> PathBuf {
    xdistill_shared::paths::repo_root().join("configs/data/gsm8k_sample.jsonl")
}

/// A config for a short run on `data` (default: the GSM8K sample); `loss` is the `[loss]` table's
/// body; `extra` is appended (e.g. an `[on_policy]` section).
pub fn config(
    dir: &Path,
    student: &Path,
    teacher: &str,
    out: &Path,
    steps: u64,
    loss: &str,
) -> Config {
    config_with(
        dir,
        student,
        teacher,
        out,
        steps,
        loss,
        &data_file(),
        "question",
        "answer",
        "",
    )
}

#[allow(clippy::too_many_arguments)]
pub fn config_with(
    dir: &Path,
    student: &Path,
    teacher: &str,
    out: &Path,
    steps: u64,
    loss: &str,
    data: &Path,
    prompt_field: &str,
    completion_field: &str,
    extra: &str,
) -> Config {
    let text = format!(
        r#"
[policy]
model_name = "{student}"
max_total_sequence_length = 96
train_micro_batch_size = 2
[policy.optimizer]
lr = 1e-2
min_lr = 1e-3
weight_decay = 0.0
warmup_steps = 2
schedule = "cosine"
max_grad_norm = 1.0
[teacher]
urls = ["{teacher}"]
k = 16
max_wait_s = 60.0
[loss]
{loss}
[data]
train_path = "{data}"
prompt_field = "{prompt_field}"
completion_field = "{completion_field}"
val_count = 8
# Most GSM8K records are longer than 96 tokens: train on their first 96 (not skip them).
truncate = true
[distillation]
num_prompts_per_step = 4
max_num_steps = {steps}
max_num_epochs = 50
seed = 3
val_period = 0
val_at_start = true
val_at_end = true
[checkpointing]
enabled = true
checkpoint_dir = "{out}"
save_period = 4
[logger]
log_every = 5
progress_bar = false
{extra}
"#,
        student = student.display(),
        data = data.display(),
        out = out.display(),
    );
    let path = dir.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&path, &text).unwrap();
    let args = DistillArgs {
        common: CommonArgs::with_config(path),
        teacher_url: vec![],
    };
    args.load_config(ObjectiveKind::OffPolicy).expect("config")
}

/// A teacher whose next-token distribution barely depends on the context: every embedding is
/// one shared random vector plus small noise, so the hidden state is nearly constant, and a large
/// LM head makes the distribution peaked. On-policy learning then has a target the student can
/// reach from its own (initially random) samples.
pub fn context_free_teacher(dir: &Path, arch: &str, tokenizer: &str, seed: u64) -> PathBuf {
    use candle_core::Tensor;
    let (args, cfg) = teacher_args(dir, arch, tokenizer, seed);
    let out = args.out.clone();
    let mut params = random_params(&cfg, 0.02, seed).unwrap();
    let noise = random_params(&cfg, 0.05, seed + 300).unwrap();
    let c = Tensor::from_vec(
        (0..cfg.hidden_size)
            .map(|i| ((i as f32) * 1.7 + seed as f32).sin())
            .collect::<Vec<f32>>(),
        cfg.hidden_size,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let embed = noise["model.embed_tokens.weight"]
        .broadcast_add(&c)
        .unwrap();
    params.insert("model.embed_tokens.weight".into(), embed);
    let big = random_params(&cfg, 0.5, seed + 100).unwrap();
    params.insert("lm_head.weight".into(), big["lm_head.weight"].clone());
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params, &args.tokenizer).unwrap();
    out
}

/// The shape both test teachers share: hidden 64, one layer, written to `dir/teacher`.
fn teacher_args(
    dir: &Path,
    arch: &str,
    tokenizer: &str,
    seed: u64,
) -> (InitSpec, xdistill_shared::hf::ModelConfig) {
    let args = InitSpec {
        arch: arch.into(),
        tokenizer: xdistill_shared::paths::tokenizer_json(tokenizer),
        hidden_size: 64,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 128,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: false,
        init_std: 0.02,
        seed,
        out: dir.join("teacher"),
        features: Default::default(),
    };
    let cfg = xdistill_shared::init::build_config(&args).unwrap();
    (args, cfg)
}
