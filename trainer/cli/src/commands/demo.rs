//! `trainer demo`: the flags, their checks against the chosen task and the printed results of
//! [`xdistill_demo`]'s two demos (the pretrained teacher by default, `--task arithmetic`).

use anyhow::{bail, Result};
use std::path::PathBuf;
use xdistill_demo::{
    pretrained, run_with, table, DemoSettings, RunOptions, Scenarios, TeacherData,
};

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
    /// The longer run. Pretrained: 48 steps × 8 problems instead of 5 × 4. Arithmetic: the
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
        p.keep_layers = Some(xdistill_trainer::prune::parse_layers(list)?);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(out: &std::path::Path) -> DemoArgs {
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
                pretrained(DemoArgs {
                    teacher_gguf: Some(PathBuf::from("/dev/null")),
                    ..args(&out)
                }),
                "/dev/null: not a GGUF file",
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
