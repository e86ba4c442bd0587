//! `trainer demo`: the end-to-end comparison on the synthetic arithmetic task.
//!
//! 1. Writes the task (seeded).
//! 2. Builds a teacher by SFT on it, cached under `OUTPUT/teacher/<hash of the teacher
//!    settings>/` and reused by later runs.
//! 3. Starts the real `teacher` binary on loopback (port 0).
//! 4. Initialises a smaller student **with a different tokenizer**.
//! 5. Gives it the same budget (steps × prompts per step) under (a) SFT, (b) off-policy and
//!    (c) on-policy distillation, each run as a subprocess of this executable (`trainer sft`,
//!    `trainer off-policy`, `trainer on-policy`) with a generated config file, so the demo
//!    exercises the real CLIs.
//! 6. Evaluates every checkpoint (greedy held-out accuracy: the curve) and the final models
//!    (accuracy and KL to the teacher).
//! 7. Prints the table and writes `OUTPUT/summary.json`, `OUTPUT/curves.json`, `OUTPUT/curves.svg`.
//!
//! The task's completions get a blank line appended (`"\n\n"`, the evaluation's default stop
//! string): every method then learns the same end-of-answer marker, whatever each tokenizer's
//! EOS and however the cross-tokenizer alignment treats special tokens.

use crate::config::{Config, OffPolicyArgs};
use crate::data::{self, Record};
use crate::eval::{self, EvalConfig, EvalRecord};
use crate::task::{self, TaskConfig};
use crate::train::off_policy;
mod report;
mod settings;

pub use report::{goal, steps_to, svg, table, Goal, Row, Summary};
pub use settings::{DemoSettings, ModelSpec, TrainSpec};

use anyhow::{bail, Context, Result};
use candle_core::DType;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;
use xdistill_shared::process::TeacherProcess;

/// `trainer demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Output directory (task, teacher cache, runs, summary.json, curves).
    #[arg(long, default_value = "runs/demo")]
    pub output: PathBuf,
    /// Tiny models and a handful of steps: checks the whole pipeline in well under a minute
    /// (the numbers mean nothing).
    #[arg(long)]
    pub fast: bool,
    /// Training steps per method (default: the preset's).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Build the teacher again even when a cached one matches the settings.
    #[arg(long)]
    pub rebuild_teacher: bool,
    /// The `teacher` server binary (default: beside this executable).
    #[arg(long)]
    pub teacher_bin: Option<PathBuf>,
}

/// The `teacher` binary: `--teacher-bin`, else beside the running executable.
pub fn teacher_binary(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            bail!("--teacher-bin {}: no such file", p.display())
        };
    }
    let exe = std::env::current_exe().context("locating the trainer executable")?;
    let name = format!("teacher{}", std::env::consts::EXE_SUFFIX);
    let mut candidates = vec![];
    if let Some(dir) = exe.parent() {
        candidates.push(dir.join(&name));
        // Test binaries live in target/<profile>/deps/.
        if let Some(up) = dir.parent() {
            candidates.push(up.join(&name));
        }
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "the `teacher` server binary is not beside {} — build the whole workspace first \
             (`cargo build --release` at the repository root), or pass --teacher-bin",
                exe.display()
            )
        })
}

/// The `trainer` executable to run subcommands with (tests run from `deps/`).
fn trainer_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the trainer executable")?;
    let name = format!("trainer{}", std::env::consts::EXE_SUFFIX);
    if exe.file_name().and_then(|n| n.to_str()) == Some(name.as_str()) {
        return Ok(exe);
    }
    let dir = exe.parent().context("executable has no folder")?;
    [dir.join(&name), dir.join("..").join(&name)]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "no `trainer` executable near {} — build the workspace first (`cargo build --release`)",
                exe.display()
            )
        })
}

fn stage(n: usize, text: &str) {
    eprintln!("\n== [{n}/8] {text}");
}

/// Runs `trainer SUB --config CONFIG [EXTRA]`, the child's progress on our stderr; returns the
/// JSON summary it prints last on stdout.
fn run_trainer(sub: &str, config: &Path, extra: &[String]) -> Result<serde_json::Value> {
    let bin = trainer_binary()?;
    let out = Command::new(&bin)
        .arg(sub)
        .arg("--config")
        .arg(config)
        .args(extra)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {sub}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "`trainer {sub} --config {}` failed ({}){}",
            config.display(),
            out.status,
            if stdout.trim().is_empty() {
                String::new()
            } else {
                format!(": {}", stdout.trim())
            }
        );
    }
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("`trainer {sub}` printed no JSON summary"))?;
    serde_json::from_str(last).with_context(|| format!("`trainer {sub}` summary: {last}"))
}

/// `NAME/tokenizer.json` of the real tokenizers (`XDISTILL_TOKENIZERS`, or the folders
/// `scripts/get-tokenizers.sh` fills).
fn tokenizer_path(name: &str) -> Result<PathBuf> {
    let dir = xdistill_shared::paths::tokenizers_dir().context(
        "the tokenizers were not found: run scripts/get-tokenizers.sh, or set XDISTILL_TOKENIZERS \
         to the folder holding NAME/tokenizer.json",
    )?;
    Ok(dir.join(name).join("tokenizer.json"))
}

fn init_model(spec: &ModelSpec, out: &Path) -> Result<()> {
    let tokenizer = tokenizer_path(&spec.tokenizer)?;
    if !tokenizer.is_file() {
        bail!(
            "tokenizer {:?} not found at {} (scripts/get-tokenizers.sh fetches them)",
            spec.tokenizer,
            tokenizer.display()
        );
    }
    crate::init_model::run(crate::init_model::Args {
        arch: spec.arch.clone(),
        tokenizer,
        hidden_size: spec.hidden_size,
        layers: spec.layers,
        heads: spec.heads,
        kv_heads: spec.kv_heads,
        intermediate_size: spec.intermediate_size,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: true,
        init_std: 0.02,
        seed: spec.seed,
        out: out.to_path_buf(),
        features: Default::default(),
    })
}

/// The config file text shared by the three methods (and the teacher's SFT).
#[allow(clippy::too_many_arguments)]
fn config_text(
    model: &Path,
    data: &Path,
    out: &Path,
    t: &TrainSpec,
    teacher_url: &str,
    loss: &str,
    save_period: u64,
    seed: u64,
    k: usize,
) -> String {
    let q = |p: &Path| toml::Value::String(p.display().to_string()).to_string();
    format!(
        r#"# Generated by `trainer demo`.
[policy]
model_name = {model}
max_total_sequence_length = 128
train_micro_batch_size = {mb}
[policy.optimizer]
lr = {lr:e}
min_lr = {min_lr:e}
weight_decay = 0.0
warmup_steps = {warmup}
schedule = "cosine"
max_grad_norm = 1.0
[teacher]
urls = ["{teacher_url}"]
k = {k}
max_wait_s = 120.0
[loss]
{loss}
[data]
train_path = {data}
prompt_field = "prompt"
completion_field = "completion"
[distillation]
num_prompts_per_step = {b}
max_num_steps = {steps}
max_num_epochs = 1000
seed = {seed}
[checkpointing]
enabled = true
checkpoint_dir = {out}
save_period = {save_period}
keep_top_k = 1000000
[logger]
log_every = 10
progress_bar = true
"#,
        model = q(model),
        data = q(data),
        out = q(out),
        mb = t.micro_batch,
        lr = t.lr,
        min_lr = t.min_lr,
        warmup = t.warmup_steps,
        b = t.prompts_per_step,
        steps = t.steps,
    )
}

/// `trainer sft` from `init` on `train` with `dir/sft.toml` (written here), checkpoints and the
/// final model under `dir/run/`; returns the trainer's JSON summary.
fn sft_run(
    dir: &Path,
    init: &Path,
    train: &Path,
    t: &TrainSpec,
    seed: u64,
    k: usize,
) -> Result<serde_json::Value> {
    let cfg = dir.join("sft.toml");
    // `trainer sft` ignores `[teacher]`; a placeholder URL keeps the file in the shared format.
    let text = config_text(
        init,
        train,
        &dir.join("run"),
        t,
        "http://unused.invalid",
        "",
        t.steps,
        seed,
        k,
    );
    std::fs::write(&cfg, text).with_context(|| format!("writing {}", cfg.display()))?;
    run_trainer("sft", &cfg, &[])
}

/// Writes the task files: the standard splits plus `train_demo.jsonl` / `test_demo.jsonl`, whose
/// completions end with the blank line every method learns to stop at.
fn write_task(dir: &Path, cfg: &TaskConfig) -> Result<(PathBuf, PathBuf)> {
    let splits = task::make_splits(cfg)?;
    task::write_splits(dir, cfg, &splits)?;
    let write = |name: &str, records: &[task::TaskRecord]| -> Result<PathBuf> {
        let path = dir.join(name);
        let mut text = String::new();
        for r in records {
            let mut r = r.clone();
            r.completion.push_str("\n\n");
            text.push_str(&serde_json::to_string(&r)?);
            text.push('\n');
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    };
    Ok((
        write("train_demo.jsonl", &splits.train)?,
        write("test_demo.jsonl", &splits.test)?,
    ))
}

/// Greedy held-out accuracy of a model directory.
fn accuracy(dir: &Path, records: &[EvalRecord], max_new_tokens: usize) -> Result<f64> {
    let (model, tok) = eval::load_model(dir, &candle_core::Device::Cpu, DType::F32)?;
    let cfg = EvalConfig {
        max_new_tokens,
        samples: 0,
        progress: false,
        ..Default::default()
    };
    Ok(eval::evaluate(&model, &tok, records, &cfg)?.greedy_accuracy)
}

/// Measures a model's KL to the teacher on held-out records, as the off-policy trainer's
/// validation does (chunk-level P-KL across tokenizers, forward KL over the top-k with a tail
/// bucket on a shared one).
pub struct KlProbe {
    setup: off_policy::Setup,
    records: Vec<Record>,
}

impl KlProbe {
    pub fn new(config_path: &Path, records: Vec<Record>) -> Result<KlProbe> {
        let cfg = Config::load(&OffPolicyArgs {
            config: config_path.to_path_buf(),
            ..Default::default()
        })?;
        Ok(KlProbe {
            setup: off_policy::setup(cfg)?,
            records,
        })
    }

    /// Mean KL per unit of `model_dir` (whose tokenizer must be the probe's student tokenizer).
    pub fn kl(&self, model_dir: &Path) -> Result<f64> {
        let s = &self.setup;
        let (model, _) = eval::load_model(model_dir, &s.device, DType::F32)?;
        let sums = off_policy::kl_to_teacher(s, &model, &self.records, 8)?;
        Ok(sums.kl / sums.kl_units.max(1.0))
    }
}

/// Evaluates `OUTPUT/<run>/step_N/` checkpoints (then removes them: they hold optimizer state)
/// and `final/`: the accuracy curve, starting from the initial student's point.
fn curve(
    run_dir: &Path,
    steps: u64,
    init: f64,
    records: &[EvalRecord],
    max_new_tokens: usize,
) -> Result<Vec<(u64, f64)>> {
    let mut points = vec![(0, init)];
    let mut ckpts = crate::checkpoint::list(run_dir)?;
    ckpts.retain(|(s, _)| *s > 0 && *s < steps);
    let bar = indicatif::ProgressBar::new(ckpts.len() as u64 + 1).with_style(
        indicatif::ProgressStyle::with_template("   evaluating {bar:30} {pos}/{len} checkpoints")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    for (s, dir) in ckpts {
        points.push((s, accuracy(&dir, records, max_new_tokens)?));
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        bar.inc(1);
    }
    points.push((
        steps,
        accuracy(&run_dir.join("final"), records, max_new_tokens)?,
    ));
    bar.finish_and_clear();
    Ok(points)
}

/// Copies a folder tree (the teacher-tokenizer and projection cache; absent source: nothing).
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    if !from.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let dst = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &dst)?;
        } else {
            std::fs::copy(entry.path(), &dst)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

fn seconds_of(v: &serde_json::Value) -> f64 {
    v.get("seconds").and_then(|s| s.as_f64()).unwrap_or(0.0)
}

fn steps_of(v: &serde_json::Value) -> u64 {
    v.get("steps").and_then(|s| s.as_u64()).unwrap_or(0)
}

/// `trainer demo`.
pub fn run(a: DemoArgs) -> Result<()> {
    let mut settings = if a.fast {
        DemoSettings::fast()
    } else {
        DemoSettings::full()
    };
    if let Some(n) = a.steps {
        if n == 0 {
            bail!("--steps must be at least 1");
        }
        settings.student_training.steps = n;
    }
    let summary = run_with(
        &a.output,
        &settings,
        a.rebuild_teacher,
        a.teacher_bin.as_deref(),
    )?;
    println!("\n{}", table(&summary));
    println!(
        "goal (on-policy ≥ 90% of the teacher in ≤ 1/5 of SFT's steps): {}",
        if summary.goal.met { "met" } else { "not met" }
    );
    println!(
        "wrote {} ({:.0} s in all)",
        a.output.join("summary.json").display(),
        summary.wall_seconds
    );
    Ok(())
}

/// The demo with explicit settings (tests use [`DemoSettings::fast`]).
pub fn run_with(
    out: &Path,
    s: &DemoSettings,
    rebuild_teacher: bool,
    teacher_bin: Option<&Path>,
) -> Result<Summary> {
    let t0 = Instant::now();
    let teacher_bin = teacher_binary(teacher_bin)?;
    trainer_binary()?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = &std::path::absolute(out)?;

    stage(1, "task: 2-digit addition with worked steps");
    let task_dir = out.join("task");
    let (train, test) = write_task(&task_dir, &s.task)?;
    let eval_records = eval::load_records(&task_dir.join("test.jsonl"), Some(s.eval_prompts))?;
    eprintln!(
        "   {} training and {} held-out problems in {}",
        s.task.train,
        s.task.test,
        task_dir.display()
    );

    stage(2, "teacher: SFT on the task (cached)");
    let tdir = out.join("teacher").join(s.teacher_key());
    let teacher_model = tdir.join("run").join("final");
    let info_path = tdir.join("teacher.json");
    let cached =
        !rebuild_teacher && info_path.is_file() && teacher_model.join("config.json").is_file();
    let teacher_row: Row = if cached {
        eprintln!("   reusing {}", teacher_model.display());
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&info_path)?)?;
        Row {
            accuracy: v["accuracy"].as_f64().unwrap_or(0.0),
            kl: 0.0,
            steps: steps_of(&v),
            seconds: seconds_of(&v),
            curve: vec![],
        }
    } else {
        if tdir.exists() {
            std::fs::remove_dir_all(&tdir)?;
        }
        let init = tdir.join("init");
        init_model(&s.teacher, &init)?;
        let r = sft_run(&tdir, &init, &train, &s.teacher_training, s.task.seed, s.k)?;
        let acc = accuracy(&teacher_model, &eval_records, s.max_new_tokens)?;
        let row = Row {
            accuracy: acc,
            kl: 0.0,
            steps: steps_of(&r),
            seconds: seconds_of(&r),
            curve: vec![],
        };
        std::fs::write(&info_path, serde_json::to_string_pretty(&row)?)?;
        row
    };
    eprintln!(
        "   teacher ({} tokenizer, hidden {}, {} layers): held-out accuracy {:.3}",
        s.teacher.tokenizer, s.teacher.hidden_size, s.teacher.layers, teacher_row.accuracy
    );

    stage(3, "teacher server on loopback");
    let server = TeacherProcess::start(&teacher_bin, &teacher_model, &[])
        .with_context(|| format!("starting {}", teacher_bin.display()))?;
    eprintln!("   {} serving {}", server.base, teacher_model.display());

    stage(4, "student with a different tokenizer");
    let student_random = out.join("student_random");
    for d in [&student_random, &out.join("student_warmup")] {
        if d.exists() {
            std::fs::remove_dir_all(d)?;
        }
    }
    init_model(&s.student, &student_random)?;
    let mut warmup = serde_json::Value::Null;
    let student_init = if s.student_warmup.steps == 0 {
        student_random
    } else {
        let dir = out.join("student_warmup");
        std::fs::create_dir_all(&dir)?;
        eprintln!(
            "   warm-up: {} SFT steps from the random init (the common starting point)",
            s.student_warmup.steps
        );
        let seed = s.task.seed ^ 0x5717;
        warmup = sft_run(&dir, &student_random, &train, &s.student_warmup, seed, s.k)?;
        dir.join("run").join("final")
    };
    let runs = out.join("runs");
    if runs.exists() {
        std::fs::remove_dir_all(&runs)?;
    }
    std::fs::create_dir_all(&runs)?;
    let kd_loss = format!("kd = {{ type = \"{}\" }}", s.kd);
    let method_cfg = |name: &str, extra: &str| -> Result<PathBuf> {
        let path = runs.join(format!("{name}.toml"));
        let text = config_text(
            &student_init,
            &train,
            &runs.join(name),
            &s.student_training,
            &server.base,
            if name == "sft" { "" } else { &kd_loss },
            s.eval_every,
            s.task.seed,
            s.k,
        ) + extra;
        std::fs::write(&path, text)?;
        Ok(path)
    };
    // KL probe: the off-policy config, validation records from the held-out split.
    let kl_cfg = method_cfg("kl_probe", "")?;
    let kl_records: Vec<Record> = {
        let d = Config::load(&OffPolicyArgs {
            config: kl_cfg.clone(),
            ..Default::default()
        })?
        .data;
        data::Dataset::load(&test, &data::LoadOptions::from_config(&d))?
            .records
            .into_iter()
            .take(s.kl_records)
            .collect()
    };
    let probe = KlProbe::new(&kl_cfg, kl_records)?;
    let init_acc = accuracy(&student_init, &eval_records, s.max_new_tokens)?;
    let student_row = Row {
        accuracy: init_acc,
        kl: probe.kl(&student_init)?,
        steps: steps_of(&warmup),
        seconds: seconds_of(&warmup),
        curve: vec![],
    };
    eprintln!(
        "   student ({} tokenizer, hidden {}, {} layers): accuracy {:.3}, KL to teacher {:.4}",
        s.student.tokenizer, s.student.hidden_size, s.student.layers, init_acc, student_row.kl
    );

    let budget = s.student_training.steps;
    let on_policy_extra = format!(
        r#"[on_policy]
lambda = 1.0
include_prompt = false
[on_policy.generation]
max_new_tokens = {}
temperature = {}
num_generations = 1
stop_strings = ["\n\n", "\nQ:"]
"#,
        s.max_new_tokens, s.rollout_temperature
    );
    let methods = [
        (
            "sft",
            "sft",
            "(a) SFT on the task data".to_string(),
            String::new(),
        ),
        (
            "off_policy",
            "off-policy",
            format!(
                "(b) off-policy distillation (cross-tokenizer {} on the task data)",
                s.kd
            ),
            String::new(),
        ),
        (
            "on_policy",
            "on-policy",
            format!(
                "(c) on-policy distillation (cross-tokenizer {} on the student's own samples)",
                s.kd
            ),
            on_policy_extra,
        ),
    ];
    let mut rows = Vec::new();
    for (i, (name, sub, title, extra)) in methods.iter().enumerate() {
        stage(5 + i, &format!("{title}: {budget} steps"));
        let cfg = method_cfg(name, extra)?;
        if *name != "sft" {
            // The probe already fetched the teacher tokenizer and built the projection map.
            copy_dir(
                &runs.join("kl_probe").join("teacher_tokenizer"),
                &runs.join(name).join("teacher_tokenizer"),
            )?;
        }
        let r = run_trainer(sub, &cfg, &[])?;
        let dir = runs.join(name);
        let c = curve(&dir, budget, init_acc, &eval_records, s.max_new_tokens)?;
        let row = Row {
            accuracy: c.last().map(|p| p.1).unwrap_or(0.0),
            kl: probe.kl(&dir.join("final"))?,
            steps: steps_of(&r),
            seconds: seconds_of(&r),
            curve: c,
        };
        eprintln!(
            "   {name}: accuracy {:.3}, KL {:.4}, {} steps in {:.1}s",
            row.accuracy, row.kl, row.steps, row.seconds
        );
        rows.push(row);
    }
    drop(server);

    stage(8, "summary");
    let on = rows.pop().context("on-policy row")?;
    let off = rows.pop().context("off-policy row")?;
    let sft = rows.pop().context("sft row")?;
    let g = goal(
        teacher_row.accuracy,
        &sft.curve,
        &off.curve,
        &on.curve,
        budget,
    );
    let summary = Summary {
        teacher: teacher_row,
        student_init: student_row,
        sft,
        off_policy: off,
        on_policy: on,
        goal: g,
        settings: s.clone(),
        wall_seconds: t0.elapsed().as_secs_f64(),
        teacher_cached: cached,
    };
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    let curves = serde_json::json!({
        "teacher_accuracy": summary.teacher.accuracy,
        "sft": summary.sft.curve,
        "off_policy": summary.off_policy.curve,
        "on_policy": summary.on_policy.curve,
    });
    std::fs::write(
        out.join("curves.json"),
        serde_json::to_string_pretty(&curves)?,
    )?;
    std::fs::write(
        out.join("curves.svg"),
        svg(
            &[
                ("SFT", &summary.sft.curve),
                ("off-policy", &summary.off_policy.curve),
                ("on-policy", &summary.on_policy.curve),
            ],
            summary.teacher.accuracy,
            budget,
        ),
    )?;
    Ok(summary)
}
