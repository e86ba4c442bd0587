//! Short-run trainer configs of the distillation end-to-end tests (the models and data they
//! train on come from `xdistill_testkit`).

use std::path::Path;
use xdistill_testkit::data_file;
use xdistill_trainer::config::{CommonArgs, Config, DistillArgs, ObjectiveKind};

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
# A test's runs share what they fetch from the teacher and build from it.
cache_dir = "{cache}"
[logger]
log_every = 5
progress_bar = false
{extra}
"#,
        student = student.display(),
        data = data.display(),
        out = out.display(),
        cache = dir.join("teacher_cache").display(),
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
