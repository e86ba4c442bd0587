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
use crate::task::{self, Op, TaskConfig};
use crate::train::off_policy;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// A model to initialise.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSpec {
    pub arch: String,
    /// Name of a tokenizer under the shared tokenizers folder (`qwen3`, `llama2`, ...).
    pub tokenizer: String,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    pub seed: u64,
}

/// How one model is trained.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSpec {
    pub steps: u64,
    pub prompts_per_step: usize,
    pub micro_batch: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
}

/// Everything that determines the demo's result.
#[derive(Debug, Clone, Serialize)]
pub struct DemoSettings {
    pub task: TaskConfig,
    pub teacher: ModelSpec,
    pub teacher_training: TrainSpec,
    pub student: ModelSpec,
    /// A short SFT on the task that turns the random student into the common starting point of
    /// the three methods (`student_init`), as in the published comparisons, which distil a
    /// mid-trained student rather than a random one (steps 0: start from the random init).
    pub student_warmup: TrainSpec,
    /// The budget every method gets.
    pub student_training: TrainSpec,
    /// Teacher top-k per position for the distillation losses.
    pub k: usize,
    /// Distillation loss of the off-policy and on-policy runs (a `[loss] kd` type).
    pub kd: String,
    /// Held-out prompts for accuracy, and evaluation cadence (steps) for the curves.
    pub eval_prompts: usize,
    pub eval_every: u64,
    pub max_new_tokens: usize,
    /// Held-out records for the KL to the teacher.
    pub kl_records: usize,
    /// Sampling temperature of the on-policy rollouts.
    pub rollout_temperature: f64,
}

impl DemoSettings {
    /// The calibrated demo (see docs/demo.md for the measurements behind these numbers).
    pub fn full() -> DemoSettings {
        DemoSettings {
            task: TaskConfig {
                digits: 2,
                ops: vec![Op::Add],
                train: 2000,
                test: 200,
                seed: 0,
            },
            teacher: ModelSpec {
                arch: "qwen3".into(),
                tokenizer: "qwen3".into(),
                hidden_size: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                intermediate_size: 256,
                seed: 1,
            },
            teacher_training: TrainSpec {
                steps: 600,
                prompts_per_step: 16,
                micro_batch: 16,
                lr: 3e-3,
                min_lr: 3e-4,
                warmup_steps: 10,
            },
            student: ModelSpec {
                arch: "llama".into(),
                tokenizer: "llama2".into(),
                hidden_size: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                intermediate_size: 128,
                seed: 2,
            },
            student_warmup: TrainSpec {
                steps: 300,
                prompts_per_step: 16,
                micro_batch: 16,
                lr: 3e-3,
                min_lr: 1e-3,
                warmup_steps: 10,
            },
            student_training: TrainSpec {
                steps: 150,
                prompts_per_step: 16,
                micro_batch: 16,
                lr: 1e-3,
                min_lr: 1e-4,
                warmup_steps: 10,
            },
            k: 16,
            kd: "first_kl".into(),
            eval_prompts: 100,
            eval_every: 20,
            max_new_tokens: 40,
            kl_records: 32,
            rollout_temperature: 0.5,
        }
    }

    /// Tiny models, a few steps: the pipeline end to end in seconds (CI).
    pub fn fast() -> DemoSettings {
        let mut s = DemoSettings::full();
        s.task.train = 64;
        s.task.test = 16;
        for m in [&mut s.teacher, &mut s.student] {
            m.hidden_size = 16;
            m.layers = 1;
            m.intermediate_size = 32;
        }
        s.teacher_training.steps = 3;
        s.teacher_training.prompts_per_step = 4;
        s.teacher_training.micro_batch = 4;
        s.student_warmup.steps = 2;
        s.student_warmup.prompts_per_step = 4;
        s.student_warmup.micro_batch = 4;
        s.student_warmup.warmup_steps = 1;
        s.student_training.steps = 4;
        s.student_training.prompts_per_step = 4;
        s.student_training.micro_batch = 4;
        s.student_training.warmup_steps = 1;
        s.k = 4;
        s.eval_prompts = 4;
        s.eval_every = 2;
        s.max_new_tokens = 6;
        s.kl_records = 4;
        s
    }

    /// Key of the cached teacher: a hash of everything the teacher depends on.
    pub fn teacher_key(&self) -> String {
        let bytes = serde_json::to_vec(&(&self.task, &self.teacher, &self.teacher_training))
            .unwrap_or_default();
        hex::encode(&Sha256::digest(&bytes)[..8])
    }
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub accuracy: f64,
    pub kl: f64,
    pub steps: u64,
    pub seconds: f64,
    /// Greedy held-out accuracy by step (step 0 is the initial student).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<(u64, f64)>,
}

/// Whether the run reached the goal of the issue.
#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    /// 90% of the teacher's accuracy.
    pub target_accuracy: f64,
    /// First evaluated step at which each method reached the target (None: not within budget).
    pub on_policy_steps: Option<u64>,
    pub off_policy_steps: Option<u64>,
    pub sft_steps: Option<u64>,
    /// On-policy reached the target, in at most a fifth of the steps SFT needed (or SFT did not
    /// reach it within the budget and on-policy did within a fifth of it).
    pub met: bool,
}

/// `OUTPUT/summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub teacher: Row,
    pub student_init: Row,
    pub sft: Row,
    pub off_policy: Row,
    pub on_policy: Row,
    pub goal: Goal,
    pub settings: DemoSettings,
    /// Wall time of the whole demo, and whether the teacher came from the cache.
    pub wall_seconds: f64,
    pub teacher_cached: bool,
}

/// A `teacher` server child process, killed when dropped.
pub struct TeacherServer {
    pub url: String,
    child: Child,
}

impl TeacherServer {
    /// Starts `bin --model DIR --port 0` and waits for its `listening on ADDR` line.
    pub fn start(bin: &Path, model: &Path) -> Result<TeacherServer> {
        let mut child = Command::new(bin)
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("teacher stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.trim().strip_prefix("listening on ") {
                    let _ = tx.send(addr.trim().to_string());
                }
            }
        });
        let mut server = TeacherServer {
            url: String::new(),
            child,
        };
        match rx.recv_timeout(Duration::from_secs(300)) {
            Ok(addr) => server.url = format!("http://{addr}"),
            Err(_) => {
                let status = server.child.try_wait().ok().flatten();
                bail!(
                    "the teacher server did not report its address (exit status: {status:?}); \
                     run {} --model {} to see why",
                    bin.display(),
                    model.display()
                );
            }
        }
        Ok(server)
    }
}

impl Drop for TeacherServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// First evaluated step whose accuracy reaches `target`.
pub fn steps_to(curve: &[(u64, f64)], target: f64) -> Option<u64> {
    // The tolerance keeps e.g. 0.72 ≥ 0.9 × 0.8 (= 0.7200000000000001) true.
    curve
        .iter()
        .find(|(_, a)| *a >= target - 1e-9)
        .map(|(s, _)| *s)
}

/// The issue's goal: on-policy reaches 90% of the teacher's accuracy in at most a fifth of the
/// steps SFT needs to get as far (SFT not reaching it within the budget counts as needing more
/// than the budget).
pub fn goal(
    teacher_acc: f64,
    sft: &[(u64, f64)],
    off: &[(u64, f64)],
    on: &[(u64, f64)],
    budget: u64,
) -> Goal {
    let target = 0.9 * teacher_acc;
    let (on_s, sft_s) = (steps_to(on, target), steps_to(sft, target));
    let met = match (on_s, sft_s) {
        (Some(o), Some(s)) => 5 * o <= s,
        (Some(o), None) => 5 * o <= budget,
        _ => false,
    } && target > 0.0;
    Goal {
        target_accuracy: target,
        on_policy_steps: on_s,
        off_policy_steps: steps_to(off, target),
        sft_steps: sft_s,
        met,
    }
}

/// The printed table.
pub fn table(s: &Summary) -> String {
    let mut t = format!(
        "{:<14} {:>9} {:>9} {:>7} {:>9}\n",
        "method", "accuracy", "KL", "steps", "seconds"
    );
    for (name, r) in [
        ("teacher", &s.teacher),
        ("student_init", &s.student_init),
        ("sft", &s.sft),
        ("off_policy", &s.off_policy),
        ("on_policy", &s.on_policy),
    ] {
        t += &format!(
            "{name:<14} {:>9.3} {:>9.4} {:>7} {:>9.1}\n",
            r.accuracy, r.kl, r.steps, r.seconds
        );
    }
    t
}

/// A small SVG line plot of the accuracy curves (no plotting dependency).
pub fn svg(curves: &[(&str, &[(u64, f64)])], teacher_acc: f64, budget: u64) -> String {
    let (w, h, l, r, top, bot) = (560.0, 340.0, 50.0, 130.0, 20.0, 40.0);
    let (pw, ph) = (w - l - r, h - top - bot);
    let x = |s: u64| l + pw * s as f64 / budget.max(1) as f64;
    let y = |a: f64| top + ph * (1.0 - a.clamp(0.0, 1.0));
    let mut o = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for i in 0..=5 {
        let a = i as f64 / 5.0;
        o += &format!(
            "<line x1=\"{l}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{a:.1}</text>\n",
            l + pw,
            l - 6.0,
            y(a) + 4.0,
            y = y(a)
        );
    }
    for i in 0..=4 {
        let s = budget * i / 4;
        o += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{s}</text>\n",
            x(s),
            top + ph + 16.0
        );
    }
    o += &format!(
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">training step</text>\n\
         <text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" text-anchor=\"middle\">held-out accuracy (greedy)</text>\n",
        l + pw / 2.0,
        h - 6.0,
        top + ph / 2.0,
        top + ph / 2.0
    );
    o += &format!(
        "<line x1=\"{l}\" x2=\"{}\" y1=\"{t:.1}\" y2=\"{t:.1}\" stroke=\"black\" stroke-dasharray=\"5,4\"/>\n\
         <text x=\"{}\" y=\"{:.1}\">teacher</text>\n",
        l + pw,
        l + pw + 8.0,
        y(teacher_acc) + 4.0,
        t = y(teacher_acc)
    );
    let colors = ["#1f77b4", "#ff7f0e", "#2ca02c"];
    // The legend sits in the right margin, in the half the teacher's label is not in.
    let legend_top = if y(teacher_acc) < top + ph / 2.0 {
        top + ph / 2.0
    } else {
        top + 20.0
    };
    for (i, (name, c)) in curves.iter().enumerate() {
        let pts: Vec<String> = c
            .iter()
            .map(|(s, a)| format!("{:.1},{:.1}", x(*s), y(*a)))
            .collect();
        let color = colors[i % colors.len()];
        o += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{name}</text>\n",
            pts.join(" "),
            l + pw + 8.0,
            legend_top + 16.0 * i as f64
        );
    }
    o + "</svg>\n"
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
    let server = TeacherServer::start(&teacher_bin, &teacher_model)?;
    eprintln!("   {} serving {}", server.url, teacher_model.display());

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
            &server.url,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goal_compares_steps_to_ninety_percent_of_the_teacher() {
        // Teacher 0.8: target 0.72.
        let on = [(0, 0.0), (10, 0.5), (20, 0.75), (100, 0.8)];
        let sft_slow = [(0, 0.0), (50, 0.3), (100, 0.73)];
        let sft_fast = [(0, 0.0), (50, 0.72), (100, 0.8)];
        let never = [(0, 0.0), (100, 0.7)];
        let g = goal(0.8, &sft_slow, &never, &on, 100);
        assert!((g.target_accuracy - 0.72).abs() < 1e-12);
        assert_eq!(
            (g.on_policy_steps, g.sft_steps, g.off_policy_steps),
            (Some(20), Some(100), None)
        );
        assert!(g.met, "20 * 5 <= 100");
        assert!(!goal(0.8, &sft_fast, &never, &on, 100).met, "20 * 5 > 50");
        // SFT never gets there: judged against the budget.
        assert!(goal(0.8, &never, &never, &on, 100).met);
        assert!(!goal(0.8, &never, &never, &on, 99).met);
        // On-policy never gets there, or a teacher at 0: not met.
        assert!(!goal(0.8, &sft_slow, &never, &never, 100).met);
        assert!(!goal(0.0, &never, &never, &on, 100).met);
    }

    #[test]
    fn svg_has_a_line_per_method_and_the_teacher() {
        let c: Vec<(u64, f64)> = vec![(0, 0.0), (50, 0.5), (100, 1.0)];
        let s = svg(&[("a", &c), ("b", &c)], 0.9, 100);
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains(">teacher<"));
        // Step 100 of 100 at accuracy 1.0 is the plot's top-right corner (x = 50 + 380, y = 20).
        assert!(s.contains("430.0,20.0"), "{s}");
    }

    #[test]
    fn teacher_key_follows_the_teacher_settings_only() {
        let a = DemoSettings::full();
        let mut b = a.clone();
        b.student_training.steps += 1;
        b.student.hidden_size *= 2;
        assert_eq!(a.teacher_key(), b.teacher_key());
        b.teacher_training.lr *= 2.0;
        assert_ne!(a.teacher_key(), b.teacher_key());
    }
}
