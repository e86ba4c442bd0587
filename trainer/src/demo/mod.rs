//! `trainer demo`: by default a real pretrained teacher distilled into a depth-pruned copy of
//! itself ([`pretrained`]); with `--task arithmetic`, the end-to-end comparison on the synthetic
//! arithmetic task, in two scenarios, described below.
//!
//! 1. Writes the task (seeded) and the files each side may see ([`files`]).
//! 2. Builds a teacher by SFT on the whole task (optionally fine-tuned on corrected-prefix
//!    records, `--teacher-data corrected`, see [`mistakes`]), cached under `OUTPUT/teacher/<hash of the teacher settings>/` and reused by
//!    later runs; measures its advice after a mistake.
//! 3. Starts the real `teacher` binary on loopback (port 0).
//! 4. Initialises a smaller student, **with a different tokenizer** in the full preset
//!    (`--full`); the quick default preset gives both the Llama 2 tokenizer to stay within a
//!    few minutes (the LM head over Qwen3's 152k-token vocabulary dominates every step).
//! 5. Runs each scenario ([`scenario`]): a warm-up SFT on the scenario's labels gives the
//!    common starting point, then the same budget (steps × prompts per step) under (a) SFT and
//!    (b) off-policy distillation on the labels and (c) on-policy distillation on the
//!    scenario's prompts, each run as a subprocess of this executable (`trainer sft`,
//!    `trainer off-policy`, `trainer on-policy`) with a generated config file, so the demo
//!    exercises the real CLIs. Every checkpoint is evaluated (the curve).
//!    - **scarce** (the headline): worked solutions for a few training problems, every
//!      training prompt without its answer for on-policy;
//!    - **control**: every training problem with its worked solution.
//! 6. Prints a table per scenario and writes `OUTPUT/summary.json`, `OUTPUT/curves.json`,
//!    `OUTPUT/curves.svg` (scarce) and `OUTPUT/curves_control.svg`.
//!
//! The task's completions get a blank line appended (`"\n\n"`, the evaluation's default stop
//! string): every method then learns the same end-of-answer marker, whatever each tokenizer's
//! EOS and however the cross-tokenizer alignment treats special tokens.

use crate::config::Config;
use crate::data::Record;
use crate::eval::{self, EvalConfig, EvalRecord};
use crate::train::distill;
pub mod files;
pub mod mistakes;
pub mod pretrained;
pub mod pypi;
mod report;
mod scenario;
mod settings;
pub mod tokenizers;

pub use report::{
    goal, plot, steps_to, svg, table, Curves, Goal, PlotAxis, Row, Scenario, Summary,
};
pub use settings::{DemoSettings, ModelSpec, ScarceSpec, TeacherData, TrainSpec};

use anyhow::{bail, Context, Result};
use candle_core::DType;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;
use xdistill_shared::process::TeacherProcess;

/// Which scenarios a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenarios {
    /// The scarce-label headline and the full-label control.
    Both,
    /// Only the scarce-label scenario (probe runs).
    Scarce,
    /// Only the full-label control.
    Control,
    /// Neither: build (or reuse) the teacher and measure its advice after a mistake.
    Teacher,
}

impl Scenarios {
    fn scarce(self) -> bool {
        matches!(self, Scenarios::Both | Scenarios::Scarce)
    }
    fn control(self) -> bool {
        matches!(self, Scenarios::Both | Scenarios::Control)
    }
}

/// What the demo distils.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Task {
    /// A real pretrained teacher (SmolLM2-135M-Instruct, GGUF from PyPI) into a depth-pruned
    /// copy of itself, on real text.
    #[default]
    Pretrained,
    /// The synthetic 2-digit-addition task: a teacher trained here, SFT vs off- and on-policy
    /// distillation with scarce labels.
    Arithmetic,
}

/// `trainer demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Output directory (runs, summary.json, curves; the arithmetic task's teacher cache).
    #[arg(long, default_value = "runs/demo")]
    pub output: PathBuf,
    /// What to distil.
    #[arg(long, value_enum, default_value_t = Task::Pretrained)]
    pub task: Task,
    /// The pretrained task's teacher: this GGUF file instead of fetching SmolLM2 (offline).
    #[arg(long)]
    pub teacher_gguf: Option<PathBuf>,
    /// The pretrained task: keep these teacher layers in the student (default `0-1,8-29`:
    /// layers 2–7 dropped).
    #[arg(long)]
    pub keep_layers: Option<String>,
    /// A handful of steps on tiny data (arithmetic: tiny models): checks the whole pipeline
    /// (the numbers mean nothing).
    #[arg(long, conflicts_with = "full")]
    pub fast: bool,
    /// The longer run. Pretrained: 6× the steps, 2× the problems per step. Arithmetic: the
    /// calibrated comparison (docs/demo.md), a teacher with the Qwen3 tokenizer, a student with
    /// Llama 2's (cross-tokenizer), both scenarios — 15–25 min on 2 cores.
    #[arg(long)]
    pub full: bool,
    /// Training steps per method (default: the preset's).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Peak learning rate of every method's training (default: the preset's); the floor of
    /// its cosine decay stays a tenth of it.
    #[arg(long)]
    pub lr: Option<f64>,
    /// SFT steps of the student's warm-up on its labels (default: the preset's; 0 starts every
    /// method from the random student).
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Labelled training problems of the scarce scenario (default: the preset's).
    #[arg(long)]
    pub labelled: Option<usize>,
    /// Seed of the draw of the scarce scenario's labelled problems (default: the preset's).
    #[arg(long)]
    pub label_seed: Option<u64>,
    /// Sampling temperature of the on-policy rollouts (default: the preset's).
    #[arg(long)]
    pub rollout_temperature: Option<f64>,
    /// Which scenarios to run (default: the preset's — `scarce` for the quick preset, `both`
    /// otherwise).
    #[arg(long, value_enum)]
    pub scenario: Option<Scenarios>,
    /// What the teacher is trained on (default: the preset's, `plain`).
    #[arg(long, value_enum)]
    pub teacher_data: Option<TeacherData>,
    /// Build the teacher again even when a cached one matches the settings.
    #[arg(long)]
    pub rebuild_teacher: bool,
    /// The `teacher` server binary (default: beside this executable).
    #[arg(long)]
    pub teacher_bin: Option<PathBuf>,
}

/// How [`run_with`] runs, besides the settings.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions<'a> {
    pub rebuild_teacher: bool,
    pub teacher_bin: Option<&'a Path>,
    pub scenarios: Scenarios,
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

/// A stage heading on stderr.
fn stage(label: &str, text: &str) {
    eprintln!("\n== [{label}] {text}");
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

fn init_model(spec: &ModelSpec, out: &Path) -> Result<()> {
    let tokenizer = tokenizers::tokenizer(&spec.tokenizer)?;
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

/// One generated training config: what `trainer sft` / `off-policy` / `on-policy` is run with.
pub struct RunConfig<'a> {
    pub model: &'a Path,
    pub data: &'a Path,
    pub out: &'a Path,
    pub train: &'a TrainSpec,
    pub teacher_url: &'a str,
    /// The `[loss]` section's body (empty for SFT).
    pub loss: &'a str,
    pub save_period: u64,
    pub seed: u64,
    pub k: usize,
    /// The data file holds prompts only (`data.prompts_only`, on-policy with `lambda = 1`).
    pub prompts_only: bool,
}

impl RunConfig<'_> {
    /// The config file text shared by the methods (and the teacher's SFT).
    pub fn text(&self) -> String {
        let q = |p: &Path| toml::Value::String(p.display().to_string()).to_string();
        let t = self.train;
        let fields = if self.prompts_only {
            "prompt_field = \"prompt\"\nprompts_only = true"
        } else {
            "prompt_field = \"prompt\"\ncompletion_field = \"completion\""
        };
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
{fields}
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
            model = q(self.model),
            data = q(self.data),
            out = q(self.out),
            mb = t.micro_batch,
            lr = t.lr,
            min_lr = t.min_lr,
            warmup = t.warmup_steps,
            teacher_url = self.teacher_url,
            k = self.k,
            loss = self.loss,
            b = t.prompts_per_step,
            steps = t.steps,
            seed = self.seed,
            save_period = self.save_period,
        )
    }
}

/// `trainer sft` from `init` on `train` with `dir/sft.toml` (written here), checkpoints and the
/// final model under `dir/run/`; returns the trainer's JSON summary.
fn sft_run(
    dir: &Path,
    init: &Path,
    train: &Path,
    t: &TrainSpec,
    seed: u64,
) -> Result<serde_json::Value> {
    let cfg = dir.join("sft.toml");
    // `trainer sft` ignores `[teacher]`; a placeholder URL keeps the file in the shared format.
    let text = RunConfig {
        model: init,
        data: train,
        out: &dir.join("run"),
        train: t,
        teacher_url: "http://unused.invalid",
        loss: "",
        save_period: t.steps,
        seed,
        k: 1,
        prompts_only: false,
    }
    .text();
    std::fs::write(&cfg, text).with_context(|| format!("writing {}", cfg.display()))?;
    run_trainer("sft", &cfg, &[])
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
    setup: distill::Setup,
    records: Vec<Record>,
}

impl KlProbe {
    pub fn new(config_path: &Path, records: Vec<Record>) -> Result<KlProbe> {
        let cfg = Config::from_file(config_path)?;
        Ok(KlProbe {
            setup: distill::setup(cfg)?,
            records,
        })
    }

    /// Mean KL per unit of `model_dir` (whose tokenizer must be the probe's student tokenizer).
    pub fn kl(&self, model_dir: &Path) -> Result<f64> {
        let (model, _) = eval::load_model(model_dir, &self.setup.device, DType::F32)?;
        let sums = self.sums(&model)?;
        Ok(sums.kl / sums.kl_units.max(1.0))
    }

    /// KL and cross-entropy sums of a loaded `model` on the probe's records.
    pub fn sums(
        &self,
        model: &xdistill_shared::model::Decoder,
    ) -> Result<crate::train::step::ValSums> {
        Ok(distill::kl_to_teacher(&self.setup, model, &self.records, 8)?.0)
    }

    /// The device models are measured on.
    pub fn device(&self) -> &candle_core::Device {
        &self.setup.device
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
    match a.task {
        Task::Pretrained => run_pretrained(a),
        Task::Arithmetic => run_arithmetic(a),
    }
}

/// `trainer demo` on the pretrained teacher.
fn run_pretrained(a: DemoArgs) -> Result<()> {
    let arithmetic_only = [
        ("--warmup-steps", a.warmup_steps.is_some()),
        ("--labelled", a.labelled.is_some()),
        ("--label-seed", a.label_seed.is_some()),
        ("--rollout-temperature", a.rollout_temperature.is_some()),
        ("--scenario", a.scenario.is_some()),
        ("--teacher-data", a.teacher_data.is_some()),
        ("--rebuild-teacher", a.rebuild_teacher),
    ];
    if let Some((flag, _)) = arithmetic_only.iter().find(|(_, set)| *set) {
        bail!("{flag} belongs to the arithmetic task: add --task arithmetic");
    }
    let mut p = if a.fast {
        pretrained::Preset::fast()
    } else if a.full {
        pretrained::Preset::full()
    } else {
        pretrained::Preset::quick()
    };
    if let Some(n) = a.steps {
        if n == 0 {
            bail!("--steps must be at least 1");
        }
        p.steps = n;
    }
    if let Some(lr) = a.lr {
        if !(lr.is_finite() && lr > 0.0) {
            bail!("--lr must be a positive number, got {lr}");
        }
        p.lr = lr;
    }
    if let Some(list) = &a.keep_layers {
        p.keep_layers = Some(crate::prune::parse_layers(list)?);
    }
    let o = pretrained::Options {
        teacher_gguf: a.teacher_gguf.as_deref(),
        teacher_bin: a.teacher_bin.as_deref(),
    };
    let s = pretrained::run(&a.output, &p, &o)?;
    println!(
        "\n{} problems per step × {} steps for each method, the same records in the same order; \
         measured on {} held-out problems:\n\n{}",
        p.prompts_per_step,
        p.steps,
        p.held_out,
        pretrained::table(&s)
    );
    println!(
        "wrote {} (curves.svg, perplexity.svg, answers.md beside it; {:.0} s in all)",
        a.output.join("summary.json").display(),
        s.wall_seconds
    );
    Ok(())
}

/// `trainer demo --task arithmetic`.
fn run_arithmetic(a: DemoArgs) -> Result<()> {
    if a.teacher_gguf.is_some() || a.keep_layers.is_some() {
        bail!("--teacher-gguf and --keep-layers belong to the pretrained task (the default)");
    }
    let (mut settings, default_scenarios) = if a.fast {
        (DemoSettings::fast(), Scenarios::Both)
    } else if a.full {
        (DemoSettings::full(), Scenarios::Both)
    } else {
        (DemoSettings::quick(), Scenarios::Scarce)
    };
    if let Some(n) = a.steps {
        if n == 0 {
            bail!("--steps must be at least 1");
        }
        settings.student_training.steps = n;
    }
    if let Some(lr) = a.lr {
        if !(lr.is_finite() && lr > 0.0) {
            bail!("--lr must be a positive number, got {lr}");
        }
        settings.student_training.lr = lr;
        settings.student_training.min_lr = lr / 10.0;
    }
    if let Some(n) = a.warmup_steps {
        settings.student_warmup.steps = n;
    }
    if let Some(n) = a.labelled {
        settings.scarce.labelled = n;
    }
    if let Some(seed) = a.label_seed {
        settings.scarce.seed = seed;
    }
    if let Some(t) = a.rollout_temperature {
        if !(t.is_finite() && t > 0.0) {
            bail!("--rollout-temperature must be a positive number, got {t}");
        }
        settings.rollout_temperature = t;
    }
    if let Some(d) = a.teacher_data {
        settings.teacher_data = d;
    }
    let opts = RunOptions {
        rebuild_teacher: a.rebuild_teacher,
        teacher_bin: a.teacher_bin.as_deref(),
        scenarios: a.scenario.unwrap_or(default_scenarios),
    };
    let settings_steps = settings.student_training.steps;
    let summary = run_with(&a.output, &settings, opts)?;
    let m = &summary.teacher_after_mistake;
    println!(
        "\nteacher: accuracy {:.3}; top-1 on the computed digits after a mistake {:.3} \
         (same digits without it {:.3}; {} digits)",
        summary.teacher.accuracy, m.after_mistake_top1, m.clean_top1, m.digits
    );
    for (name, sc, ask) in [
        (
            "scarce labels (headline)",
            &summary.scarce,
            "on-policy ≥ 90% of the teacher in ≤ 1/5 of SFT's steps and ≥ 2× SFT's accuracy",
        ),
        (
            "all labels (control)",
            &summary.control,
            "on-policy ≥ 90% of the teacher in ≤ 1/5 of SFT's steps",
        ),
    ] {
        let Some(sc) = sc else { continue };
        println!(
            "\n{name}: {} labelled problems, on-policy on {} prompts\n{}goal ({ask}): {}",
            sc.labelled_records,
            sc.prompts,
            table(&summary.teacher, sc),
            if sc.goal.met { "met" } else { "not met" }
        );
    }
    println!(
        "wrote {} ({:.0} s in all)",
        a.output.join("summary.json").display(),
        summary.wall_seconds
    );
    if !a.fast && !a.full {
        println!(
            "\nThis was the quick preset: one tokenizer and {} steps per method, a budget too small \
             for the students to catch up with the teacher. `trainer demo --task arithmetic --full` runs the \
             calibrated comparison (cross-tokenizer, both scenarios, 15–25 min on 2 cores; \
             docs/demo.md).",
            settings_steps
        );
    }
    Ok(())
}

/// A built (or cached) teacher.
struct Teacher {
    row: Row,
    model: PathBuf,
    cached: bool,
}

/// The teacher: from the cache when its settings match, else trained by SFT: the plain teacher
/// on the task (`files.train`), the corrected one by a short SFT of the plain one (itself from
/// the cache or trained first) on `files.teacher_corrected`. Its row counts both stages.
fn teacher(
    out: &Path,
    s: &DemoSettings,
    f: &files::TaskFiles,
    rebuild: bool,
    eval_records: &[EvalRecord],
) -> Result<Teacher> {
    let tdir = out.join("teacher").join(s.teacher_key());
    let model = tdir.join("run").join("final");
    let info_path = tdir.join("teacher.json");
    if !rebuild && info_path.is_file() && model.join("config.json").is_file() {
        eprintln!("   reusing {}", model.display());
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&info_path)?)
            .with_context(|| format!("reading {}", info_path.display()))?;
        let row = Row {
            accuracy: v["accuracy"].as_f64().unwrap_or(0.0),
            kl: 0.0,
            steps: steps_of(&v),
            seconds: seconds_of(&v),
            curve: vec![],
        };
        return Ok(Teacher {
            row,
            model,
            cached: true,
        });
    }
    if tdir.exists() {
        std::fs::remove_dir_all(&tdir)?;
    }
    let (init, data, spec, before) = match s.teacher_data {
        TeacherData::Plain => {
            let init = tdir.join("init");
            init_model(&s.teacher, &init)?;
            (init, &f.train, &s.teacher_training, None)
        }
        TeacherData::Corrected => {
            let plain = teacher(out, &s.plain_teacher(), f, rebuild, eval_records)?;
            eprintln!(
                "   plain teacher: held-out accuracy {:.3}; fine-tuning it on corrected prefixes",
                plain.row.accuracy
            );
            (
                plain.model,
                &f.teacher_corrected,
                &s.teacher_correction,
                Some(plain.row),
            )
        }
    };
    std::fs::create_dir_all(&tdir)?;
    let r = sft_run(&tdir, &init, data, spec, s.task.seed)?;
    let row = Row {
        accuracy: accuracy(&model, eval_records, s.max_new_tokens)?,
        kl: 0.0,
        steps: steps_of(&r) + before.as_ref().map_or(0, |b| b.steps),
        seconds: seconds_of(&r) + before.as_ref().map_or(0.0, |b| b.seconds),
        curve: vec![],
    };
    std::fs::write(&info_path, serde_json::to_string_pretty(&row)?)?;
    Ok(Teacher {
        row,
        model,
        cached: false,
    })
}

/// The demo with explicit settings (tests use [`DemoSettings::fast`]).
pub fn run_with(out: &Path, s: &DemoSettings, o: RunOptions) -> Result<Summary> {
    let t0 = Instant::now();
    let teacher_bin = teacher_binary(o.teacher_bin)?;
    trainer_binary()?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = &std::path::absolute(out)?;

    stage("task", "2-digit addition with worked steps");
    let task_dir = out.join("task");
    let f = files::write(&task_dir, &s.task, &s.scarce)?;
    let eval_records = eval::load_records(&task_dir.join("test.jsonl"), Some(s.eval_prompts))?;
    eprintln!(
        "   {} training and {} held-out problems in {}; {} labelled for the scarce scenario",
        s.task.train,
        s.task.test,
        task_dir.display(),
        s.scarce.labelled
    );

    stage("teacher", "SFT on the whole task (cached)");
    let Teacher {
        row: teacher_row,
        model: teacher_model,
        cached,
    } = teacher(out, s, &f, o.rebuild_teacher, &eval_records)?;
    let mistake_records: Vec<_> = f
        .test_records
        .iter()
        .take(s.mistake_records)
        .cloned()
        .collect();
    let after = mistakes::after_mistake(&teacher_model, &mistake_records, s.task.seed ^ 0x3157)?;
    eprintln!(
        "   teacher ({} tokenizer, hidden {}, {} layers, {:?} data): held-out accuracy {:.3}; \
         top-1 on computed digits after a mistake {:.3} (without it {:.3})",
        s.teacher.tokenizer,
        s.teacher.hidden_size,
        s.teacher.layers,
        s.teacher_data,
        teacher_row.accuracy,
        after.after_mistake_top1,
        after.clean_top1
    );

    stage("server", "teacher server on loopback");
    let server = TeacherProcess::start(&teacher_bin, &teacher_model, &[])
        .with_context(|| format!("starting {}", teacher_bin.display()))?;
    eprintln!("   {} serving {}", server.base, teacher_model.display());

    let student_tokenizer = if s.student.tokenizer == s.teacher.tokenizer {
        format!("the teacher's tokenizer ({})", s.student.tokenizer)
    } else {
        format!(
            "another tokenizer ({}; the teacher's is {})",
            s.student.tokenizer, s.teacher.tokenizer
        )
    };
    stage(
        "student",
        &format!("random student with {student_tokenizer}"),
    );
    let student_random = out.join("student_random");
    if student_random.exists() {
        std::fs::remove_dir_all(&student_random)?;
    }
    init_model(&s.student, &student_random)?;
    let ctx = scenario::Ctx {
        out,
        settings: s,
        teacher_url: &server.base,
        student_random: &student_random,
        eval_records: &eval_records,
        test: &f.test,
        teacher_accuracy: teacher_row.accuracy,
    };
    let scarce = if o.scenarios.scarce() {
        Some(scenario::run(&ctx, &scenario::Plan::scarce(&f, s))?)
    } else {
        None
    };
    let control = if o.scenarios.control() {
        Some(scenario::run(&ctx, &scenario::Plan::control(&f))?)
    } else {
        None
    };
    drop(server);

    stage("summary", "summary.json, curves.json, curves.svg");
    let summary = Summary {
        teacher: teacher_row,
        teacher_after_mistake: after,
        scarce,
        control,
        settings: s.clone(),
        wall_seconds: t0.elapsed().as_secs_f64(),
        teacher_cached: cached,
    };
    write_outputs(out, &summary)?;
    Ok(summary)
}

/// `summary.json`, `curves.json` and one SVG per scenario (`curves.svg`: the headline).
fn write_outputs(out: &Path, summary: &Summary) -> Result<()> {
    let write = |name: &str, text: String| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    write("summary.json", serde_json::to_string_pretty(summary)?)?;
    let curves_of = |sc: &Option<Scenario>| {
        sc.as_ref().map(|sc| {
            serde_json::json!({
                "sft": sc.sft.curve,
                "off_policy": sc.off_policy.curve,
                "on_policy": sc.on_policy.curve,
            })
        })
    };
    let curves = serde_json::json!({
        "teacher_accuracy": summary.teacher.accuracy,
        "scarce": curves_of(&summary.scarce),
        "control": curves_of(&summary.control),
    });
    write("curves.json", serde_json::to_string_pretty(&curves)?)?;
    let budget = summary.settings.student_training.steps;
    for (name, sc) in [
        ("curves.svg", &summary.scarce),
        ("curves_control.svg", &summary.control),
    ] {
        let Some(sc) = sc else { continue };
        let c = sc.curves();
        write(
            name,
            svg(
                &[
                    ("SFT", c.sft),
                    ("off-policy", c.off_policy),
                    ("on-policy", c.on_policy),
                ],
                summary.teacher.accuracy,
                budget,
            ),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(out: &Path) -> DemoArgs {
        DemoArgs {
            output: out.to_path_buf(),
            task: Task::Arithmetic,
            teacher_gguf: None,
            keep_layers: None,
            fast: true,
            full: false,
            steps: None,
            lr: None,
            warmup_steps: None,
            labelled: None,
            label_seed: None,
            rollout_temperature: None,
            scenario: None,
            teacher_data: None,
            rebuild_teacher: false,
            teacher_bin: None,
        }
    }

    /// Bad values of the probe flags are refused before anything runs, naming the flag.
    #[test]
    fn bad_flag_values_are_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("demo");
        for (a, flag) in [
            (
                DemoArgs {
                    steps: Some(0),
                    ..args(&out)
                },
                "--steps",
            ),
            (
                DemoArgs {
                    lr: Some(0.0),
                    ..args(&out)
                },
                "--lr",
            ),
            (
                DemoArgs {
                    lr: Some(f64::NAN),
                    ..args(&out)
                },
                "--lr",
            ),
            (
                DemoArgs {
                    rollout_temperature: Some(-1.0),
                    ..args(&out)
                },
                "--rollout-temperature",
            ),
        ] {
            let err = run(a).unwrap_err().to_string();
            assert!(err.contains(flag), "{err}");
        }
        assert!(!out.exists(), "nothing was written");
    }

    /// Each task refuses the other's flags, and the pretrained task its own bad values, before
    /// anything runs.
    #[test]
    fn flags_of_the_other_task_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("demo");
        let pretrained = |a: DemoArgs| DemoArgs {
            task: Task::Pretrained,
            ..a
        };
        for (a, says) in [
            (
                pretrained(DemoArgs {
                    labelled: Some(3),
                    ..args(&out)
                }),
                "--labelled belongs to the arithmetic task",
            ),
            (
                pretrained(DemoArgs {
                    keep_layers: Some("3,1".into()),
                    ..args(&out)
                }),
                "strictly increasing",
            ),
            (
                pretrained(DemoArgs {
                    teacher_gguf: Some(dir.path().join("missing.gguf")),
                    ..args(&out)
                }),
                "missing.gguf: no such file",
            ),
            (
                DemoArgs {
                    teacher_gguf: Some(dir.path().join("x.gguf")),
                    ..args(&out)
                },
                "belong to the pretrained task",
            ),
        ] {
            let err = run(a).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }
}
