//! `trainer demo --task arithmetic`: the end-to-end comparison on the synthetic arithmetic task
//! ([`crate::task`]), in two scenarios, described below.
//!
//! 1. Writes the task (seeded) and the files each side may see ([`crate::files`]).
//! 2. Builds a teacher by SFT on the whole task (optionally fine-tuned on corrected-prefix
//!    records, `--teacher-data corrected`, see [`crate::mistakes`]), cached under
//!    `OUTPUT/teacher/<hash of the teacher settings>/` and reused by later runs; measures its
//!    advice after a mistake.
//! 3. Starts the real `teacher` binary on loopback (port 0).
//! 4. Initialises a smaller student, **with a different tokenizer** in the full preset
//!    (`--full`); the quick default preset gives both the Llama 2 tokenizer to stay within a
//!    few minutes (the LM head over Qwen3's 152k-token vocabulary dominates every step).
//! 5. Runs each scenario (`crate::scenario`): a warm-up SFT on the scenario's labels gives the
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

use crate::files;
use crate::measure::accuracy;
use crate::mistakes;
use crate::report::{svg, Row, Scenario, Summary};
use crate::runs::{
    init_model, seconds_of, sft_run, stage, steps_of, teacher_binary, trainer_binary,
};
use crate::scenario;
use crate::settings::{DemoSettings, TeacherData};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;
use xdistill_shared::process::TeacherProcess;
use xdistill_trainer::eval::{self, EvalRecord};

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
    /// Whether the scarce-label scenario runs.
    pub fn scarce(self) -> bool {
        matches!(self, Scenarios::Both | Scenarios::Scarce)
    }
    /// Whether the full-label control runs.
    pub fn control(self) -> bool {
        matches!(self, Scenarios::Both | Scenarios::Control)
    }
}

/// How [`run_with`] runs, besides the settings.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions<'a> {
    pub rebuild_teacher: bool,
    pub teacher_bin: Option<&'a Path>,
    pub scenarios: Scenarios,
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
