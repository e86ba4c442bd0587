//! Off-policy distillation end to end on loopback: a real `teacher` process on a tiny random
//! model, a smaller student trained by `trainer off-policy`'s loop.

use std::path::{Path, PathBuf};
use xdistill_server::testing::{teacher_binary, TeacherProcess};
use xdistill_trainer::config::{Config, OffPolicyArgs};
use xdistill_trainer::train::off_policy::{setup, train, Summary};

#[allow(clippy::too_many_arguments)]
fn model(
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
    xdistill_trainer::init_model::run(xdistill_trainer::init_model::Args {
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
    })
    .expect("init-model");
    out
}

/// A teacher whose predictions mostly depend on the current token: large random embedding and
/// LM head (peaked, token-specific distributions), small attention and MLP weights. A student can
/// learn that from a few hundred records and generalise to held-out text.
fn token_driven_teacher(dir: &Path, arch: &str, tokenizer: &str, seed: u64) -> PathBuf {
    use xdistill_trainer::init_model::{build_config, random_params, Args};
    let out = dir.join("teacher");
    let args = Args {
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
        out: out.clone(),
    };
    let cfg = build_config(&args).unwrap();
    let mut params = random_params(&cfg, 0.02, seed).unwrap();
    let big = random_params(&cfg, 0.5, seed + 100).unwrap();
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        params.insert(name.into(), big[name].clone());
    }
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params, &args.tokenizer).unwrap();
    out
}

fn data_file() -> PathBuf {
    xdistill_shared::paths::repo_root().join("configs/data/gsm8k_sample.jsonl")
}

/// A config for a short run; `loss` is the `[loss]` table's body.
fn config(dir: &Path, student: &Path, teacher: &str, out: &Path, steps: u64, loss: &str) -> Config {
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
prompt_field = "question"
completion_field = "answer"
val_count = 8
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
"#,
        student = student.display(),
        data = data_file().display(),
        out = out.display(),
    );
    let path = dir.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&path, &text).unwrap();
    let args = OffPolicyArgs {
        config: path,
        teacher_url: vec![],
        student: None,
        data: None,
        output: None,
        max_steps: None,
        resume: false,
        set: vec![],
    };
    Config::load(&args).expect("config")
}

fn run(cfg: Config, resume: bool, stop_after: Option<u64>) -> Summary {
    let s = setup(cfg).expect("setup");
    train(&s, resume, stop_after).expect("train")
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let t =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let mut v: Vec<_> = t
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn same_tokenizer_kl_halves_and_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    // A peaked, token-driven teacher and a smaller, near-uniform student on the same tokenizer.
    let teacher = token_driven_teacher(dir.path(), "llama", "llama2", 1);
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]);
    let loss = r#"kd = { type = "forward_kl" }
tail = "bucket""#;

    // 1. Distillation lowers held-out KL to at most half its start value.
    let out = dir.path().join("run");
    let s = run(
        config(dir.path(), &student, &t.base, &out, 40, loss),
        false,
        None,
    );
    let (kl0, kl1) = (s.val_kl_start.unwrap(), s.val_kl_end.unwrap());
    eprintln!(
        "same tokenizer: held-out KL {kl0:.4} -> {kl1:.4} in {} steps ({:.1}s)",
        s.steps, s.seconds
    );
    assert_eq!(s.steps, 40);
    assert!(kl1 <= 0.5 * kl0, "held-out KL {kl0} -> {kl1}");
    // metrics.jsonl has a line per step plus validation lines.
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        lines
            .lines()
            .filter(|l| l.contains("\"split\":\"train\""))
            .count(),
        40
    );

    // 2. Interrupted after step 6 (checkpoint at 4), resumed: the same weights as a straight run.
    let straight = dir.path().join("straight");
    run(
        config(dir.path(), &student, &t.base, &straight, 10, loss),
        false,
        None,
    );
    let resumed = dir.path().join("resumed");
    let cut = run(
        config(dir.path(), &student, &t.base, &resumed, 10, loss),
        false,
        Some(6),
    );
    assert_eq!(cut.steps, 6);
    assert!(!resumed.join("final").exists());
    let done = run(
        config(dir.path(), &student, &t.base, &resumed, 10, loss),
        true,
        None,
    );
    assert_eq!(done.steps, 10);
    let (a, b) = (
        weights(&straight.join("final")),
        weights(&resumed.join("final")),
    );
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(va == vb, "{na} differs after resume");
    }
    // The checkpoint directory is a model the teacher can serve.
    xdistill_shared::hf::ModelDir::open(resumed.join("step_4")).unwrap();
}

#[test]
fn cross_tokenizer_kl_falls() {
    let dir = tempfile::tempdir().unwrap();
    // Teacher on the Qwen3 tokenizer, student on Llama 2's: aligned chunks + projected KL.
    let teacher = token_driven_teacher(dir.path(), "qwen3", "qwen3", 4);
    let student = model(dir.path(), "student", "llama", "llama2", 32, 2, 0.02, 5);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]);
    let out = dir.path().join("xrun");
    let cfg = config(
        dir.path(),
        &student,
        &t.base,
        &out,
        30,
        r#"kd = { type = "pkl" }"#,
    );
    let s = run(cfg, false, None);
    let (kl0, kl1) = (s.val_kl_start.unwrap(), s.val_kl_end.unwrap());
    eprintln!(
        "cross tokenizer: held-out P-KL {kl0:.4} -> {kl1:.4} in {} steps ({:.1}s)",
        s.steps, s.seconds
    );
    assert!(kl1 < 0.8 * kl0, "held-out P-KL {kl0} -> {kl1}");
}
