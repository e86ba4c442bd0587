//! Data-parallel training through the real `trainer` binary: N processes on loopback with
//! torchrun's environment (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, and
//! the rendezvous port in `XDISTILL_DIST_PORT`), a real `teacher` process, a tiny student on the
//! CPU.
//!
//! - A step's gradient is a pairwise tree over `policy.data_parallel.virtual_shards` slices of
//!   its records (by default, `"auto"`: 8 for the 8 records of these steps), so 1, 2 and 4
//!   processes (and ZeRO-1) write the same final weights bit for bit, for off-policy (the shipped
//!   `configs/off_policy.toml`), SFT and on-policy runs; rank 0 alone writes the checkpoint
//!   directory, and the teacher scores each record once whatever the process count.
//! - A killed rank stops the others with an error naming it; `--resume` continues from the last
//!   checkpoint with another number of processes and ends on the uninterrupted run's weights.
//! - Ranks with different configs are refused (config hash) and every process exits non-zero.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use xdistill_demo::task::{make_splits, write_splits, TaskConfig};
use xdistill_testkit::models::model;
use xdistill_testkit::models::token_driven_teacher;
use xdistill_testkit::{free_port, get_body, teacher_binary, trainer_binary, TeacherProcess};

/// How long a whole job (every rank) may take before its stragglers are killed.
const JOB_BOUND: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------------
// Launching N ranks
// ---------------------------------------------------------------------------------------------

/// The launcher variables a rank must not inherit from the test's own environment.
fn scrub(cmd: &mut Command) {
    for v in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "XDISTILL_DIST_PORT",
        "TORCHELASTIC_RUN_ID",
    ] {
        cmd.env_remove(v);
    }
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("SLURM_") {
            cmd.env_remove(&k);
        }
    }
}

/// One running rank: its process, its (initially empty) working directory and its log files.
struct Rank {
    rank: usize,
    child: Child,
    cwd: PathBuf,
    stderr: PathBuf,
}

/// How a rank ended.
struct Outcome {
    rank: usize,
    /// `None`: killed by the job's wall-clock bound (or by the test).
    status: Option<ExitStatus>,
    /// When it exited, from the job's start.
    elapsed: Duration,
    stderr: String,
}

impl Outcome {
    fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
}

/// N trainer processes of one job (`configs.len()` ranks, rank r running `configs[r]`).
struct Job {
    name: String,
    ranks: Vec<Rank>,
    started: Instant,
}

impl Job {
    /// Starts `trainer SUBCOMMAND --config configs[r] EXTRA…` for every rank r. One config:
    /// a plain single process (no launcher variables at all). Several: torchrun's environment
    /// with rank 0's rendezvous on 127.0.0.1 at a free port. Each rank runs in its own empty
    /// directory `dir/NAME/cwd-R` and logs to `dir/NAME/rank-R.{out,err}`.
    fn start(dir: &Path, name: &str, subcommand: &str, configs: &[PathBuf], extra: &[&str]) -> Job {
        let n = configs.len();
        let base = dir.join(name);
        std::fs::create_dir_all(&base).unwrap();
        let (master_port, dist_port) = (free_port(), free_port());
        let started = Instant::now();
        let ranks = configs
            .iter()
            .enumerate()
            .map(|(rank, config)| {
                let cwd = base.join(format!("cwd-{rank}"));
                std::fs::create_dir_all(&cwd).unwrap();
                let stderr = base.join(format!("rank-{rank}.err"));
                let mut cmd = Command::new(trainer_binary());
                cmd.arg(subcommand)
                    .arg("--config")
                    .arg(config)
                    .args(extra)
                    .current_dir(&cwd)
                    .stdin(Stdio::null())
                    .stdout(File::create(base.join(format!("rank-{rank}.out"))).unwrap())
                    .stderr(File::create(&stderr).unwrap());
                scrub(&mut cmd);
                // Two cores here: one compute thread per process keeps N = 4 from thrashing
                // (every run of a comparison gets the same setting).
                cmd.env("RAYON_NUM_THREADS", "1")
                    .env("RUST_LOG", "info")
                    .env("NO_COLOR", "1");
                if n > 1 {
                    cmd.env("RANK", rank.to_string())
                        .env("LOCAL_RANK", rank.to_string())
                        .env("WORLD_SIZE", n.to_string())
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", master_port.to_string())
                        .env("XDISTILL_DIST_PORT", dist_port.to_string());
                }
                let child = cmd
                    .spawn()
                    .unwrap_or_else(|e| panic!("{name}: starting rank {rank}: {e}"));
                Rank {
                    rank,
                    child,
                    cwd,
                    stderr,
                }
            })
            .collect();
        Job {
            name: name.into(),
            ranks,
            started,
        }
    }

    /// Waits for every rank for at most `bound` from the job's start, killing what is left then.
    fn wait(mut self, bound: Duration) -> Vec<Outcome> {
        let mut done: Vec<Option<(Option<ExitStatus>, Duration)>> =
            self.ranks.iter().map(|_| None).collect();
        loop {
            for (r, d) in self.ranks.iter_mut().zip(done.iter_mut()) {
                if d.is_none() {
                    if let Some(s) = r.child.try_wait().unwrap() {
                        *d = Some((Some(s), self.started.elapsed()));
                    }
                }
            }
            if done.iter().all(Option::is_some) {
                break;
            }
            if self.started.elapsed() > bound {
                for (r, d) in self.ranks.iter_mut().zip(done.iter_mut()) {
                    if d.is_none() {
                        let _ = r.child.kill();
                        let _ = r.child.wait();
                        *d = Some((None, self.started.elapsed()));
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let outcomes: Vec<Outcome> = self
            .ranks
            .iter()
            .zip(done)
            .map(|(r, d)| {
                let (status, elapsed) = d.unwrap();
                Outcome {
                    rank: r.rank,
                    status,
                    elapsed,
                    stderr: strip_ansi(&std::fs::read_to_string(&r.stderr).unwrap_or_default()),
                }
            })
            .collect();
        eprintln!(
            "{}: {} rank(s): {}",
            self.name,
            outcomes.len(),
            outcomes
                .iter()
                .map(|o| format!(
                    "rank {} {} after {:.1}s",
                    o.rank,
                    match o.status {
                        Some(s) => s.to_string(),
                        None => "killed at the bound".into(),
                    },
                    o.elapsed.as_secs_f64()
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.ranks.clear();
        outcomes
    }

    /// Waits for every rank and asserts that all succeeded and left their working directories
    /// empty (rank 0 writes only to the absolute checkpoint_dir of the config).
    fn succeed(self) {
        let name = self.name.clone();
        let cwds: Vec<PathBuf> = self.ranks.iter().map(|r| r.cwd.clone()).collect();
        let outcomes = self.wait(JOB_BOUND);
        if !outcomes.iter().all(Outcome::ok) {
            panic!("{name} failed:\n{}", report(&outcomes));
        }
        // Several ranks really formed one group (not N independent runs).
        let n = outcomes.len();
        if n > 1 {
            for o in &outcomes {
                assert!(
                    o.stderr.contains(&format!("world_size={n}")),
                    "{name}: rank {} did not join a group of {n}:\n{}",
                    o.rank,
                    report(&outcomes)
                );
            }
        }
        for (rank, cwd) in cwds.iter().enumerate() {
            let left: Vec<_> = std::fs::read_dir(cwd)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert!(
                left.is_empty(),
                "{name}: rank {rank} wrote {left:?} into its working directory"
            );
        }
    }
}

impl Drop for Job {
    /// A test that panics with ranks still running does not leave them behind.
    fn drop(&mut self) {
        for r in &mut self.ranks {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

/// `text` without ANSI escape sequences (`ESC [ … letter`): log lines searched for words.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The error lines of a rank's stderr (`Error: …` and `ERROR` log lines), one string.
fn errors(stderr: &str) -> String {
    stderr
        .lines()
        .filter(|l| l.contains("Error") || l.contains("ERROR") || l.contains("WARN"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Every rank's status and stderr.
fn report(outcomes: &[Outcome]) -> String {
    outcomes
        .iter()
        .map(|o| {
            format!(
                "----- rank {} ({}, {:.1}s) stderr:\n{}",
                o.rank,
                match o.status {
                    Some(s) => s.to_string(),
                    None => "killed at the bound".into(),
                },
                o.elapsed.as_secs_f64(),
                o.stderr
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs a job of `n` ranks on one config to success.
fn run(dir: &Path, name: &str, subcommand: &str, config: &Path, n: usize, extra: &[&str]) {
    let configs = vec![config.to_path_buf(); n];
    Job::start(dir, name, subcommand, &configs, extra).succeed();
}

// ---------------------------------------------------------------------------------------------
// Configs, models, data
// ---------------------------------------------------------------------------------------------

/// What a test's configs vary.
#[derive(Clone)]
struct Run<'a> {
    student: &'a Path,
    /// `None`: an SFT config (no `[teacher]`, no `[loss]`).
    teacher: Option<&'a str>,
    data: &'a Path,
    steps: u64,
    save_period: u64,
    lr: f64,
    zero: bool,
    /// Appended (an `[on_policy]` section).
    extra: &'a str,
}

const OFF_POLICY_LOSS: &str = "kd = { type = \"forward_kl\" }\ntail = \"bucket\"";

const ON_POLICY: &str = r#"
[on_policy]
lambda = 1.0
[on_policy.generation]
max_new_tokens = 6
temperature = 1.0
stop_strings = []
"#;

/// Writes `dir/NAME.toml` for a run into `out`; returns its path.
fn write_config(dir: &Path, name: &str, out: &Path, r: &Run) -> PathBuf {
    let teacher = match r.teacher {
        Some(url) => format!(
            "[teacher]\nurls = [\"{url}\"]\nk = 16\nmax_wait_s = 60.0\n[loss]\n{OFF_POLICY_LOSS}\n"
        ),
        None => String::new(),
    };
    let text = format!(
        r#"
[policy]
model_name = "{student}"
max_total_sequence_length = 96
train_micro_batch_size = 2
[policy.optimizer]
lr = {lr:e}
min_lr = 1e-3
weight_decay = 0.0
warmup_steps = 1
schedule = "cosine"
max_grad_norm = 1.0
[policy.data_parallel]
zero = {zero}
timeout_s = 30
{teacher}
[data]
train_path = "{data}"
prompt_field = "prompt"
completion_field = "completion"
val_count = 4
truncate = true
[distillation]
num_prompts_per_step = 8
max_num_steps = {steps}
max_num_epochs = 50
seed = 3
val_period = 0
val_at_start = false
val_at_end = true
[checkpointing]
enabled = true
checkpoint_dir = "{out}"
save_period = {save_period}
[logger]
log_every = 1
progress_bar = false
{extra}
"#,
        student = r.student.display(),
        lr = r.lr,
        zero = r.zero,
        data = r.data.display(),
        steps = r.steps,
        out = out.display(),
        save_period = r.save_period,
        extra = r.extra,
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// The arithmetic task's training split (40 short records) in `dir/task`.
fn task_data(dir: &Path) -> PathBuf {
    let task = TaskConfig {
        train: 40,
        test: 4,
        seed: 1,
        ..Default::default()
    };
    write_splits(&dir.join("task"), &task, &make_splits(&task).unwrap()).unwrap();
    dir.join("task/train.jsonl")
}

/// A tiny student (Qwen3 layout, Llama 2 tokenizer).
fn student(dir: &Path) -> PathBuf {
    model(dir, "student", "qwen3", "llama2", 32, 2, 0.02, 2)
}

fn start_teacher(dir: &Path) -> TeacherProcess {
    let teacher = token_driven_teacher(dir, "llama", "llama2", 1);
    TeacherProcess::start(&teacher_binary(), &teacher, &[]).expect("starting the teacher")
}

/// The sequences the teacher has scored so far (its `/metrics` counter).
fn teacher_sequences(t: &TeacherProcess) -> u64 {
    let name = "xdistill_request_sequences_total";
    let m = get_body(&format!("{}/metrics", t.base));
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the teacher's /metrics:\n{m}"))
}

fn final_bytes(out: &Path) -> Vec<u8> {
    let f = out.join("final/model.safetensors");
    std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
}

/// Asserts two runs' final models are the same bytes (naming the first tensor that differs).
fn assert_same_model(a: &Path, b: &Path, what: &str) {
    if final_bytes(a) == final_bytes(b) {
        return;
    }
    let (wa, wb) = (
        xdistill_testkit::models::model_weights(&a.join("final")),
        xdistill_testkit::models::model_weights(&b.join("final")),
    );
    for ((na, va), (nb, vb)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb, "{what}: tensor names");
        if va != vb {
            let diff = va
                .iter()
                .zip(vb)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            panic!("{what}: final weights differ: {na} (max |diff| {diff:e})");
        }
    }
    panic!("{what}: final/model.safetensors differ in bytes but not in tensors");
}

/// The `step` of every training line of `out/metrics.jsonl`.
fn train_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["split"] == "train")
        .map(|v| v["step"].as_u64().unwrap())
        .collect()
}

/// The names directly in `dir`.
fn entries(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// Every file under `dir`, relative, sorted.
fn tree(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, d: &Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.insert(p.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(dir, dir, &mut out);
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let t = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &t);
        } else {
            std::fs::copy(&p, &t).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

/// The shipped `configs/off_policy.toml` at its data-parallel defaults (no `virtual_shards`
/// anywhere), on 1, 2 and 4 processes (and 2 with ZeRO-1): the same final model, bit for bit;
/// one metrics line per step; the teacher asked for each sequence once; checkpoints written
/// once, by rank 0 alone.
#[test]
fn off_policy_weights_do_not_depend_on_the_number_of_processes() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (student, data) = (student(d), task_data(d));
    let t = start_teacher(d);
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/off_policy.toml");
    let text = std::fs::read_to_string(&shipped).unwrap();
    assert!(
        !text.contains("data_parallel") && !text.contains("virtual_shards"),
        "{} sets data-parallel keys: this test is about their defaults",
        shipped.display()
    );
    let mut outs = Vec::new();
    let mut scored = Vec::new();
    for (name, n, zero) in [
        ("n1", 1, false),
        ("n2", 2, false),
        ("n4", 4, false),
        ("n2_zero", 2, true),
    ] {
        let out = d.join(format!("out_{name}"));
        // Paths, the run's length and the test data's fields; a learning rate that makes a
        // rounding difference show in the weights; nothing about data parallelism but ZeRO.
        let flags = [
            format!("--student={}", student.display()),
            format!("--data={}", data.display()),
            format!("--output={}", out.display()),
            format!("--teacher-url={}", t.base),
            "--max-steps=3".into(),
            "--set=data.prompt_field=prompt".into(),
            "--set=data.completion_field=completion".into(),
            "--set=checkpointing.save_period=2".into(),
            "--set=distillation.val_at_start=false".into(),
            "--set=policy.optimizer.lr=1e-2".into(),
            "--set=policy.optimizer.warmup_steps=1".into(),
            format!("--set=policy.data_parallel.zero={zero}"),
        ];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let before = teacher_sequences(&t);
        run(d, name, "off-policy", &shipped, n, &flags);
        scored.push((name, teacher_sequences(&t) - before));
        assert_eq!(train_steps(&out), vec![1, 2, 3], "{name}: metrics.jsonl");
        outs.push((name, out));
    }
    // 3 steps of 8 records (and the validation's) scored once, not once per process.
    let (_, want) = scored[0];
    assert!(want >= 24, "n1: the teacher scored {want} sequences");
    for (name, got) in &scored {
        assert_eq!(
            *got, want,
            "{name}: sequences the teacher scored (n1: {want})"
        );
    }
    let (_, first) = &outs[0];
    let layout = entries(first);
    assert!(
        layout.contains("step_2") && layout.contains("final") && layout.contains("metrics.jsonl"),
        "n1: {layout:?}"
    );
    let files = tree(first);
    for (name, out) in &outs[1..] {
        // The same checkpoint directory as a single process: nothing per rank, nothing twice.
        assert_eq!(entries(out), layout, "{name}: checkpoint_dir");
        assert_eq!(tree(out), files, "{name}: files under checkpoint_dir");
        assert_same_model(first, out, &format!("off-policy n1 vs {name}"));
    }
    eprintln!(
        "off-policy N = 1, 2, 4, 2+ZeRO (shipped config): {:.1}s",
        t0.elapsed().as_secs_f64()
    );
}

/// SFT (no teacher): 1 and 2 processes end on the same bytes.
#[test]
fn sft_weights_do_not_depend_on_the_number_of_processes() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (student, data) = (student(d), task_data(d));
    let r = Run {
        student: &student,
        teacher: None,
        data: &data,
        steps: 3,
        save_period: 2,
        lr: 1e-2,
        zero: false,
        extra: "",
    };
    let (o1, o2) = (d.join("out_n1"), d.join("out_n2"));
    let c1 = write_config(d, "n1", &o1, &r);
    let c2 = write_config(d, "n2", &o2, &r);
    run(d, "sft_n1", "sft", &c1, 1, &[]);
    run(d, "sft_n2", "sft", &c2, 2, &[]);
    assert_eq!(train_steps(&o1), vec![1, 2, 3], "n1: metrics.jsonl");
    assert_eq!(train_steps(&o2), vec![1, 2, 3], "n2: metrics.jsonl");
    assert_eq!(tree(&o1), tree(&o2), "files under checkpoint_dir");
    assert_same_model(&o1, &o2, "sft n1 vs n2");
    eprintln!("sft N = 1, 2: {:.1}s", t0.elapsed().as_secs_f64());
}

/// On-policy (λ = 1: every record is the student's own sample, scored by the teacher): 1 and 2
/// processes end on the same bytes.
#[test]
fn on_policy_weights_do_not_depend_on_the_number_of_processes() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (student, data) = (student(d), task_data(d));
    let t = start_teacher(d);
    let r = Run {
        student: &student,
        teacher: Some(&t.base),
        data: &data,
        steps: 3,
        save_period: 2,
        lr: 1e-2,
        zero: false,
        extra: ON_POLICY,
    };
    let (o1, o2) = (d.join("out_n1"), d.join("out_n2"));
    let c1 = write_config(d, "n1", &o1, &r);
    let c2 = write_config(d, "n2", &o2, &r);
    run(d, "on_n1", "on-policy", &c1, 1, &[]);
    run(d, "on_n2", "on-policy", &c2, 2, &[]);
    assert_eq!(train_steps(&o1), vec![1, 2, 3], "n1: metrics.jsonl");
    assert_eq!(train_steps(&o2), vec![1, 2, 3], "n2: metrics.jsonl");
    assert_eq!(tree(&o1), tree(&o2), "files under checkpoint_dir");
    assert_same_model(&o1, &o2, "on-policy n1 vs n2");
    eprintln!("on-policy N = 1, 2: {:.1}s", t0.elapsed().as_secs_f64());
}

/// Rank 1 killed after step 2: rank 0 stops with an error naming rank 1; `--resume` from the
/// last checkpoint with 1 (and with 2) processes ends on the uninterrupted run's bytes.
#[test]
fn a_killed_rank_stops_the_job_and_resume_with_any_world_size_is_exact() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (student, data) = (student(d), task_data(d));
    let t = start_teacher(d);
    let steps = 8;
    let r = Run {
        student: &student,
        teacher: Some(&t.base),
        data: &data,
        steps,
        save_period: 1,
        lr: 1e-2,
        zero: false,
        extra: "",
    };

    // The uninterrupted run.
    let straight = d.join("out_straight");
    let c = write_config(d, "straight", &straight, &r);
    run(d, "straight", "off-policy", &c, 2, &[]);
    let want: Vec<u64> = (1..=steps).collect();
    assert_eq!(train_steps(&straight), want, "straight: metrics.jsonl");

    // The interrupted one: kill rank 1 once step 2 is logged.
    let cut = d.join("out_cut");
    let c = write_config(d, "cut", &cut, &r);
    let mut job = Job::start(d, "cut", "off-policy", &[c.clone(), c.clone()], &[]);
    let poll = Instant::now();
    loop {
        if train_steps(&cut).contains(&2) {
            break;
        }
        let exited: Vec<_> = job
            .ranks
            .iter_mut()
            .filter_map(|r| r.child.try_wait().unwrap().map(|s| (r.rank, s)))
            .collect();
        if !exited.is_empty() || poll.elapsed() > JOB_BOUND {
            let outcomes = job.wait(Duration::ZERO);
            panic!(
                "cut: step 2 never logged (exited: {exited:?}):\n{}",
                report(&outcomes)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    job.ranks[1].child.kill().unwrap();
    let killed_at = job.started.elapsed();
    let outcomes = job.wait(killed_at + Duration::from_secs(60));
    let r0 = &outcomes[0];
    eprintln!(
        "cut: rank 1 killed at {:.1}s (after step {:?}), rank 0 ended {:.1}s later",
        killed_at.as_secs_f64(),
        train_steps(&cut).last(),
        r0.elapsed.saturating_sub(killed_at).as_secs_f64()
    );
    assert!(
        r0.status.is_some(),
        "rank 0 still running 60 s after rank 1 died:\n{}",
        report(&outcomes)
    );
    assert!(
        !r0.ok(),
        "rank 0 succeeded without rank 1:\n{}",
        report(&outcomes)
    );
    assert!(
        r0.stderr.contains("rank 1"),
        "rank 0's error does not name rank 1:\n{}",
        report(&outcomes)
    );
    eprintln!("cut: rank 0 says: {}", errors(&r0.stderr));
    let logged = train_steps(&cut);
    assert!(
        (logged.len() as u64) < steps && !cut.join("final").exists(),
        "cut: the run finished before rank 1 was killed (steps {logged:?}); make it longer"
    );
    let checkpoints: Vec<_> = entries(&cut)
        .into_iter()
        .filter(|e| e.starts_with("step_"))
        .collect();
    assert!(
        !checkpoints.is_empty(),
        "cut: no checkpoint: {:?}",
        entries(&cut)
    );

    // Resume with 1 process, and (from a copy of the same checkpoints) with 2.
    let cut2 = d.join("out_cut2");
    copy_dir(&cut, &cut2);
    run(d, "resume_n1", "off-policy", &c, 1, &["--resume"]);
    assert!(cut.join("final").exists());
    assert_same_model(&straight, &cut, "uninterrupted vs resumed with N = 1");
    let c2 = write_config(d, "cut2", &cut2, &r);
    run(d, "resume_n2", "off-policy", &c2, 2, &["--resume"]);
    assert_same_model(&straight, &cut2, "uninterrupted vs resumed with N = 2");
    for (name, out) in [("resume_n1", &cut), ("resume_n2", &cut2)] {
        let s = train_steps(out);
        assert_eq!(s.last(), Some(&steps), "{name}: {s:?}");
    }
    eprintln!("killed rank + resumes: {:.1}s", t0.elapsed().as_secs_f64());
}

/// Rank 1 runs another learning rate: refused on the config hash, every process exits non-zero.
#[test]
fn ranks_with_different_configs_are_refused() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (student, data) = (student(d), task_data(d));
    let t = start_teacher(d);
    let r = Run {
        student: &student,
        teacher: Some(&t.base),
        data: &data,
        steps: 3,
        save_period: 2,
        lr: 1e-2,
        zero: false,
        extra: "",
    };
    let out = d.join("out");
    let c0 = write_config(d, "rank0", &out, &r);
    let c1 = write_config(
        d,
        "rank1",
        &out,
        &Run {
            lr: 2e-2,
            ..r.clone()
        },
    );
    let job = Job::start(d, "mismatch", "off-policy", &[c0, c1], &[]);
    let outcomes = job.wait(Duration::from_secs(60));
    let all = report(&outcomes);
    for o in &outcomes {
        assert!(
            o.status.is_some(),
            "rank {} still running after 60 s:\n{all}",
            o.rank
        );
        assert!(!o.ok(), "rank {} succeeded:\n{all}", o.rank);
    }
    assert!(
        outcomes
            .iter()
            .any(|o| o.stderr.contains("config") && o.stderr.contains("differ")),
        "no rank says the config differs:\n{all}"
    );
    assert!(
        outcomes[0].stderr.contains("rank 1"),
        "rank 0's error does not name rank 1:\n{all}"
    );
    for o in &outcomes {
        eprintln!("mismatch: rank {} says: {}", o.rank, errors(&o.stderr));
    }
    assert!(!out.join("final").exists(), "a model was written");
    eprintln!("mismatched configs: {:.1}s", t0.elapsed().as_secs_f64());
}
