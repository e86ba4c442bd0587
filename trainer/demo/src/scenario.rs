//! One scenario of the demo: what the student has (labels, prompts), a warm-up SFT on its labels
//! as the common starting point, then the same budget under SFT, off-policy and on-policy
//! distillation, each evaluated along the way.

use crate::files::TaskFiles;
use crate::measure::{accuracy, curve, KlProbe};
use crate::report::{goal, Curves, Row, Scenario};
use crate::runs::{
    run_trainer, seconds_of, sft_run, stage, steps_of, Distill, Rollouts, RunConfig,
};
use crate::settings::DemoSettings;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use xdistill_trainer::config::Config;
use xdistill_trainer::data::{self, Record};
use xdistill_trainer::eval::EvalRecord;

/// What the student has in one scenario.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    /// The key in `summary.json` and the folder under the output (`scarce`, `control`).
    pub key: &'static str,
    pub title: &'static str,
    /// Worked solutions: the warm-up, SFT and off-policy train on them.
    pub labelled: &'a Path,
    pub labelled_records: usize,
    /// What on-policy samples from.
    pub prompts: &'a Path,
    pub prompts_count: usize,
    /// `prompts` holds prompts only (no completion for the student to read).
    pub prompts_only: bool,
    /// Final-accuracy ratio over SFT the goal asks of on-policy (1: none).
    pub min_ratio: f64,
}

impl<'a> Plan<'a> {
    /// The headline: a few worked solutions, every training prompt without its answer.
    pub fn scarce(f: &'a TaskFiles, s: &DemoSettings) -> Plan<'a> {
        Plan {
            key: "scarce",
            title: "scarce labels",
            labelled: &f.labelled,
            labelled_records: s.scarce.labelled,
            prompts: &f.prompts,
            prompts_count: f.train_records,
            prompts_only: true,
            min_ratio: 2.0,
        }
    }

    /// The control: every training problem with its worked solution.
    pub fn control(f: &'a TaskFiles) -> Plan<'a> {
        Plan {
            key: "control",
            title: "all labels",
            labelled: &f.train,
            labelled_records: f.train_records,
            prompts: &f.train,
            prompts_count: f.train_records,
            prompts_only: false,
            min_ratio: 1.0,
        }
    }
}

/// What every scenario shares.
pub struct Ctx<'a> {
    pub out: &'a Path,
    pub settings: &'a DemoSettings,
    pub teacher_url: &'a str,
    pub student_random: &'a Path,
    pub eval_records: &'a [EvalRecord],
    /// Held-out records with solutions (the KL probe's).
    pub test: &'a Path,
    pub teacher_accuracy: f64,
}

/// One method of a scenario.
struct Method {
    /// Key in the summary and folder under `runs/`.
    name: &'static str,
    /// `trainer` subcommand.
    sub: &'static str,
    title: String,
}

/// The scenario's common starting point: the warm-up SFT of the random student on the
/// scenario's labels (steps 0: the random student itself), and the warm-up's trainer summary.
fn warm_up(ctx: &Ctx, plan: &Plan, dir: &Path) -> Result<(PathBuf, serde_json::Value)> {
    let s = ctx.settings;
    if s.student_warmup.steps == 0 {
        return Ok((ctx.student_random.to_path_buf(), serde_json::Value::Null));
    }
    let wdir = dir.join("student_warmup");
    std::fs::create_dir_all(&wdir).with_context(|| format!("creating {}", wdir.display()))?;
    eprintln!(
        "   warm-up: {} SFT steps on the {} labelled problems (the common starting point)",
        s.student_warmup.steps, plan.labelled_records
    );
    let seed = s.task.seed ^ 0x5717;
    let r = sft_run(
        &wdir,
        ctx.student_random,
        plan.labelled,
        &s.student_warmup,
        seed,
    )?;
    Ok((wdir.join("run").join("final"), r))
}

/// Held-out records for the KL probe, read as the methods' configs read data.
fn kl_records(probe_cfg: &Path, test: &Path, n: usize) -> Result<Vec<Record>> {
    let d = Config::from_file(probe_cfg)?.data;
    Ok(
        data::Dataset::load(test, &data::LoadOptions::from_config(&d))?
            .records
            .into_iter()
            .take(n)
            .collect(),
    )
}

/// Runs one scenario: warm-up, then SFT, off-policy and on-policy with the same budget.
pub fn run(ctx: &Ctx, plan: &Plan) -> Result<Scenario> {
    let s = ctx.settings;
    let dir = ctx.out.join(plan.key);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let runs = dir.join("runs");
    std::fs::create_dir_all(&runs).with_context(|| format!("creating {}", runs.display()))?;
    stage(
        &format!("{} 0/3", plan.key),
        &format!(
            "{}: {} labelled problems, on-policy on {} prompts{}",
            plan.title,
            plan.labelled_records,
            plan.prompts_count,
            if plan.prompts_only {
                " (without answers)"
            } else {
                ""
            }
        ),
    );
    let (student_init, warmup) = warm_up(ctx, plan, &dir)?;
    let method_cfg = |name: &str, on_policy: bool| -> Result<PathBuf> {
        let path = runs.join(format!("{name}.toml"));
        RunConfig {
            model: &student_init,
            data: if on_policy {
                plan.prompts
            } else {
                plan.labelled
            },
            out: &runs.join(name),
            train: &s.student_training,
            save_period: s.eval_every,
            seed: s.task.seed,
            distill: (name != "sft").then_some(Distill {
                teacher_url: ctx.teacher_url,
                k: s.k,
                kd: &s.kd,
                cache_dir: &runs.join("teacher_cache"),
            }),
            rollouts: on_policy.then_some(Rollouts {
                max_new_tokens: s.max_new_tokens,
                temperature: s.rollout_temperature,
            }),
            prompts_only: on_policy && plan.prompts_only,
        }
        .write(&path)?;
        Ok(path)
    };
    // KL probe: the off-policy config, validation records from the held-out split.
    let kl_cfg = method_cfg("kl_probe", false)?;
    let probe = KlProbe::new(&kl_cfg, kl_records(&kl_cfg, ctx.test, s.kl_records)?)?;
    let init_acc = accuracy(&student_init, ctx.eval_records, s.max_new_tokens)?;
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
    let methods = [
        Method {
            name: "sft",
            sub: "sft",
            title: format!("(a) SFT on the {} labelled problems", plan.labelled_records),
        },
        Method {
            name: "off_policy",
            sub: "off-policy",
            title: format!(
                "(b) off-policy distillation (cross-tokenizer {}) on the {} labelled problems",
                s.kd, plan.labelled_records
            ),
        },
        Method {
            name: "on_policy",
            sub: "on-policy",
            title: format!(
                "(c) on-policy distillation (cross-tokenizer {}) on the student's own samples of {} prompts",
                s.kd, plan.prompts_count
            ),
        },
    ];
    let budget = s.student_training.steps;
    let mut rows = Vec::new();
    for (i, m) in methods.iter().enumerate() {
        stage(
            &format!("{} {}/3", plan.key, i + 1),
            &format!("{}: {budget} steps", m.title),
        );
        let cfg = method_cfg(m.name, m.name == "on_policy")?;
        let r = run_trainer(m.sub, &cfg, &[])?;
        let mdir = runs.join(m.name);
        let c = curve(&mdir, budget, init_acc, ctx.eval_records, s.max_new_tokens)?;
        let row = Row {
            accuracy: c.last().map(|p| p.1).unwrap_or(0.0),
            kl: probe.kl(&mdir.join("final"))?,
            steps: steps_of(&r),
            seconds: seconds_of(&r),
            curve: c,
        };
        eprintln!(
            "   {}: accuracy {:.3}, KL {:.4}, {} steps in {:.1}s",
            m.name, row.accuracy, row.kl, row.steps, row.seconds
        );
        rows.push(row);
    }
    let mut rows = rows.into_iter();
    let (sft, off, on) = (
        rows.next().context("sft row")?,
        rows.next().context("off-policy row")?,
        rows.next().context("on-policy row")?,
    );
    let g = goal(
        ctx.teacher_accuracy,
        &Curves {
            sft: &sft.curve,
            off_policy: &off.curve,
            on_policy: &on.curve,
        },
        budget,
        plan.min_ratio,
    );
    let sc = Scenario {
        labelled_records: plan.labelled_records,
        prompts: plan.prompts_count,
        prompts_only: plan.prompts_only,
        student_init: student_row,
        sft,
        off_policy: off,
        on_policy: on,
        goal: g,
    };
    Ok(sc)
}
