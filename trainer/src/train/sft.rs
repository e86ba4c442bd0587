//! `trainer sft`: plain next-token training on prompt + completion data (loss on the completion
//! and the EOS that ends it), used to build a teacher and as the baseline distillation is
//! compared with.
//!
//! Same configuration file as `trainer off-policy` (`[teacher]` and `[loss]` are ignored: the
//! loss is the student's cross-entropy). Per step: `num_prompts_per_step` records are encoded
//! exactly as evaluation and the distillation trainers encode them (one joint encoding with the
//! tokenizer's special tokens, the completion boundary found from byte offsets), the model
//! config's EOS is appended as the last target, and micro-batches of `train_micro_batch_size`
//! accumulate gradients normalised by the whole step's target count. Validation reports held-out
//! cross-entropy (`[distillation] val_*`) and, with `--eval-prompts`, greedy task accuracy.
//! Checkpoints record the data position after the last trained batch, so `--resume` is exact.

use super::head_chunks::HeadOpts;
use super::micro::{self, Drive, Layout, MicroBatch, Part, RowPieces, Units};
use super::runner::{
    self, EvalCtx, Objective, RecordFilter, RunOptions, StepCtx, StepReport, Steps, ValReport,
};
use crate::collate::{encode, pad_batch, Encoded};
use crate::config::{CommonArgs, Config, ObjectiveKind};
use crate::data::Record;
use crate::dist::StepShards;
use crate::eval::{self, EvalConfig, EvalRecord};
use crate::loss::{CeConfig, KdConfig, KdFigures, KdMetrics, LossConfig, Normalizer, Temperature};
use crate::optim::GradAccumulator;
use crate::student::Student;
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use tokenizers::Tokenizer;
use xdistill_shared::model::Decoder;

/// `trainer sft`: flags override the config file.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(mut_arg("config", |a| a.help(
    "TOML configuration file (the off-policy format; `[teacher]` and `[loss]` are ignored)"
)))]
pub struct SftArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Prompts file (JSONL with `prompt` and `answer`) for periodic greedy task accuracy.
    #[arg(long)]
    pub eval_prompts: Option<PathBuf>,
    /// Task accuracy every this many steps (0: only at the start and the end).
    #[arg(long, default_value_t = 0)]
    pub eval_period: u64,
    /// Evaluate on the first N prompts only.
    #[arg(long)]
    pub eval_limit: Option<usize>,
    #[arg(long, default_value_t = 64)]
    pub eval_max_new_tokens: usize,
}

impl SftArgs {
    /// Reads and validates the configuration (for SFT: no teacher needed).
    pub fn load_config(&self) -> Result<Config> {
        Ok(Config::load(&self.common, &[], ObjectiveKind::Sft)?)
    }

    /// The task-accuracy settings, when `--eval-prompts` is given.
    pub fn task_eval(&self) -> Result<Option<TaskEval>> {
        let Some(path) = &self.eval_prompts else {
            return Ok(None);
        };
        Ok(Some(TaskEval {
            records: eval::load_records(path, self.eval_limit)?,
            period: self.eval_period,
            config: EvalConfig {
                max_new_tokens: self.eval_max_new_tokens,
                samples: 0,
                progress: false,
                ..Default::default()
            },
        }))
    }
}

/// Periodic greedy task accuracy during training.
#[derive(Debug, Clone)]
pub struct TaskEval {
    pub records: Vec<EvalRecord>,
    /// Every this many steps (0: start and end only).
    pub period: u64,
    pub config: EvalConfig,
}

/// A task-accuracy line in `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AccuracyMetrics {
    /// `"eval"`.
    pub split: String,
    pub step: u64,
    pub accuracy: f64,
    pub marker_rate: f64,
    pub eos_rate: f64,
    pub records: u64,
    pub time: f64,
}

/// What a finished run reports (printed as one JSON line).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub seconds: f64,
    pub val_ce_start: Option<f64>,
    pub val_ce_end: Option<f64>,
    pub accuracy_start: Option<f64>,
    pub accuracy_end: Option<f64>,
    pub skipped_records: u64,
    pub final_dir: String,
}

/// Encodes one record for SFT: the joint encoding of prompt + completion, completion-only
/// targets when the record asks for it, and `eos` appended (unless the tokenizer already ended
/// the sequence with it). Errors when the result is longer than `max_len`.
pub fn encode_record(
    tok: &Tokenizer,
    r: &Record,
    eos: Option<u32>,
    max_len: usize,
) -> Result<Encoded> {
    let mut e = encode(tok, &r.text(), r.loss_start_byte(), usize::MAX)?;
    if let Some(eos) = eos {
        if e.ids.last() != Some(&eos) {
            e.ids.push(eos);
        }
    }
    if e.ids.len() > max_len {
        bail!(
            "{} tokens exceed policy.max_total_sequence_length = {max_len}",
            e.ids.len()
        );
    }
    Ok(e)
}

/// A micro-batch of SFT examples laid out for the loss pipeline: only the trained (completion)
/// positions go through the LM head — with a large vocabulary the head dominates the step, and
/// prompt and padding positions need none — and the loss is their cross-entropy alone.
struct SftBatch {
    layout: RowPieces,
    /// `[N]` the token each trained position predicts.
    targets: Vec<u32>,
    device: Device,
}

impl SftBatch {
    fn new(examples: &[Encoded], model: &Decoder, device: &Device, per: usize) -> Result<SftBatch> {
        let tb = pad_batch(examples, 0, model.config().vocab_size, device)?;
        let (rows, targets) = trained_rows(examples, tb.ids.dim(1)?)?;
        Ok(SftBatch {
            layout: RowPieces::new(&tb.ids, rows, per),
            targets,
            device: device.clone(),
        })
    }
}

impl MicroBatch for SftBatch {
    fn layout(&self) -> &Layout {
        &self.layout.layout
    }

    fn distills(&self) -> bool {
        false
    }

    fn kd(&self, _: Part, _: &Tensor, _: Option<Normalizer>) -> Result<(Tensor, KdFigures)> {
        bail!("SFT has no distillation term")
    }

    fn val_kd(&self, _: Part, _: &Tensor) -> Result<Option<(Tensor, KdMetrics)>> {
        Ok(None)
    }

    fn ce(&self, part: Part) -> Result<(Tensor, Tensor, usize)> {
        self.layout.ce(part, &self.targets, &self.device)
    }
}

/// The SFT objective as the pipeline combines terms: the cross-entropy alone, weight 1.
fn sft_terms() -> LossConfig {
    LossConfig {
        kd: KdConfig::ForwardKl {},
        tail: None,
        temperature: Temperature::default(),
        kd_weight: 0.0,
        ce: CeConfig::Weight { weight: 1.0 },
    }
}

/// Every target of a micro-batch as the pipeline's units (SFT normalises by trained tokens).
fn units(normalizer: f64) -> Units {
    Units {
        kd: 0.0,
        ce: normalizer,
    }
}

/// The SFT loss of one micro-batch: cross-entropy over the masked (completion) targets, divided
/// by `normalizer` (the step's target count), as one scalar (the reference of [`sft_grads`]).
/// Returns the loss and the micro-batch's target count.
pub fn sft_loss(
    model: &Decoder,
    examples: &[Encoded],
    normalizer: f64,
    device: &Device,
) -> Result<(Tensor, f64)> {
    let batch = SftBatch::new(examples, model, device, 1)?;
    let terms = sft_terms();
    let drive = Drive {
        model,
        head: HeadOpts::default(),
        loss: &terms,
    };
    let (loss, _) = micro::loss(&drive, &batch, units(normalizer))?;
    Ok((loss, batch.targets.len() as f64))
}

/// Flat indices into `[B·T]` of the trained positions of `examples` padded to `t` (as
/// [`pad_batch`] masks them) and the token each predicts.
fn trained_rows(examples: &[Encoded], t: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let (mut rows, mut targets) = (Vec::new(), Vec::new());
    for (r, e) in examples.iter().enumerate() {
        for p in e.loss_from.max(1) - 1..e.ids.len().saturating_sub(1) {
            rows.push((r * t + p) as u32);
            targets.push(e.ids[p + 1]);
        }
    }
    if rows.is_empty() {
        bail!("a micro-batch has no completion tokens to train on");
    }
    Ok((rows, targets))
}

/// The gradients of the SFT loss (every parameter's) and its value: the decoder through
/// `head`'s training pass, the LM head + cross-entropy in row chunks, so `[N, V]` exists for
/// one chunk at a time.
pub fn sft_grads(
    model: &Decoder,
    examples: &[Encoded],
    normalizer: f64,
    head: HeadOpts,
    acc: Option<&mut GradAccumulator>,
) -> Result<(GradStore, f64)> {
    // The cross-entropy alone: the fused loss where it runs (larger chunks).
    let batch = SftBatch::new(
        examples,
        model,
        model.device(),
        head.fused_rows(model.lm_head())?,
    )?;
    let terms = sft_terms();
    let drive = Drive {
        model,
        head,
        loss: &terms,
    };
    let (g, sums) = micro::grads(&drive, &batch, units(normalizer), acc)?;
    Ok((g, sums.ce.map_or(0.0, |c| c.0)))
}

/// The summed next-token NLL of `examples`' trained positions and their count, without
/// gradients: the head in row chunks of `per` (so `[N, V]` is never whole).
fn nll_sum(
    model: &Decoder,
    examples: &[Encoded],
    device: &Device,
    per: usize,
) -> Result<(f64, f64)> {
    let batch = SftBatch::new(examples, model, device, per)?;
    let terms = sft_terms();
    let drive = Drive {
        model,
        head: HeadOpts::default(),
        loss: &terms,
    };
    let v = micro::validation(&drive, &batch)?;
    Ok((v.ce, v.ce_tokens))
}

/// Number of trained targets of an encoded example (as [`pad_batch`] masks them).
fn targets_of(e: &Encoded) -> usize {
    e.ids.len().saturating_sub(e.loss_from.max(1))
}

/// Held-out mean cross-entropy over `val` (already encoded), no gradients kept.
fn validation_ce(model: &Decoder, val: &[Encoded], mb: usize, device: &Device) -> Result<f64> {
    let (mut sum, mut n) = (0.0, 0.0);
    let per = HeadOpts::default().fused_rows(model.lm_head())?;
    for chunk in val.chunks(mb.max(1)) {
        let (s, k) = nll_sum(model, chunk, device, per)?;
        sum += s;
        n += k;
    }
    Ok(sum / n.max(1.0))
}

/// `trainer sft`.
pub fn run(args: SftArgs) -> Result<()> {
    let cfg = args.load_config()?;
    let task = args.task_eval()?;
    let summary = train(&cfg, task.as_ref(), args.common.resume, None)?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

/// Encodes records, skipping (and counting) the ones that cannot be used.
fn encode_all(
    tok: &Tokenizer,
    records: &[Record],
    eos: Option<u32>,
    max_len: usize,
) -> (Vec<Encoded>, u64) {
    let mut out = Vec::with_capacity(records.len());
    let mut skipped = 0;
    for r in records {
        match encode_record(tok, r, eos, max_len) {
            Ok(e) if targets_of(&e) > 0 => out.push(e),
            Ok(_) => {
                tracing::warn!("record at line {} skipped: no completion tokens", r.line);
                skipped += 1;
            }
            Err(e) => {
                tracing::warn!("record at line {} skipped: {e}", r.line);
                skipped += 1;
            }
        }
    }
    (out, skipped)
}

/// Supervised fine-tuning: the student's cross-entropy on the completions, and periodic task
/// accuracy with `--eval-prompts`.
pub struct Sft<'a> {
    cfg: &'a Config,
    task: Option<&'a TaskEval>,
    tok: Tokenizer,
    device: Device,
    /// The model config's EOS, appended as every record's last target (set when the student
    /// is loaded).
    eos: Option<u32>,
    /// The held-out records, encoded on first use.
    val: Option<Vec<Encoded>>,
    accuracy_start: Option<f64>,
    accuracy_end: Option<f64>,
}

impl<'a> Sft<'a> {
    pub fn new(cfg: &'a Config, task: Option<&'a TaskEval>) -> Result<Sft<'a>> {
        if cfg.data.prompts_only {
            bail!(
                "data.prompts_only = true: SFT trains on completions, and a prompts-only file has \
                 none (name the completion field and drop prompts_only, or run `trainer on-policy`)"
            );
        }
        Ok(Sft {
            cfg,
            task,
            tok: xdistill_shared::hf::load_tokenizer(&cfg.student_tokenizer())?,
            device: crate::dist::device(
                &cfg.policy.device,
                crate::dist::World::from_env()?.as_ref(),
            )?,
            eos: None,
            val: None,
            accuracy_start: None,
            accuracy_end: None,
        })
    }

    fn max_len(&self) -> usize {
        self.cfg.policy.max_total_sequence_length
    }
}

impl Objective for Sft<'_> {
    type Input = StepShards;

    fn open(&mut self, student: &Student) -> Result<Option<RecordFilter<'_>>> {
        self.eos = student.config.eos_ids().first().copied();
        if self.eos.is_none() {
            tracing::warn!(
                "the model config names no eos_token_id: the model will not learn to stop"
            );
        }
        let (tok, eos, max_len) = (&self.tok, self.eos, self.max_len());
        // SFT never truncates: over-long records are skipped whatever `data.truncate` says.
        Ok(Some(RecordFilter {
            too_long: Box::new(move |r: &Record| {
                encode_record(tok, r, eos, usize::MAX).is_ok_and(|e| e.ids.len() > max_len)
            }),
            limits: format!("policy.max_total_sequence_length = {max_len} tokens"),
        }))
    }

    fn feed(&mut self, steps: Steps) -> Box<dyn Iterator<Item = Result<StepShards>>> {
        Box::new(steps.map(Ok))
    }

    fn step(&mut self, ctx: &mut StepCtx, step: StepShards) -> Result<StepReport> {
        let (mut encoded, mut skipped) = (Vec::new(), 0);
        for shard in &step.shards {
            let (enc, s) = encode_all(&self.tok, &shard.records, self.eos, self.max_len());
            encoded.push(enc);
            skipped += s;
        }
        // Every micro-batch's loss is normalised by the step's target count over all ranks.
        let mut n_targets = [encoded.iter().flatten().map(targets_of).sum::<usize>() as f64];
        ctx.sum(&mut n_targets)?;
        let n_targets = n_targets[0];
        if n_targets == 0.0 {
            tracing::warn!("step {}: every record of the batch was skipped", ctx.step);
        }
        let mb = self.cfg.policy.train_micro_batch_size.max(1);
        let head = HeadOpts {
            activations: self.cfg.policy.activation_checkpointing,
            chunk_rows: 0,
        };
        let mut loss_sum = 0.0;
        for enc in &encoded {
            for chunk in enc.chunks(mb) {
                let model = ctx.student.model();
                let (grads, loss) = sft_grads(model, chunk, n_targets, head, Some(ctx.acc))?;
                ctx.acc.add(&grads)?;
                loss_sum += loss;
            }
            ctx.acc.end_shard()?;
        }
        let tokens = encoded.iter().flatten().map(|e| e.ids.len()).sum::<usize>();
        let mut figures = [loss_sum, tokens as f64, skipped as f64];
        ctx.sum(&mut figures)?;
        let [loss, tokens, skipped] = figures;
        Ok(StepReport {
            epoch: step.epoch(),
            next: step.next,
            loss,
            loss_parts: BTreeMap::from([("ce".to_string(), loss)]),
            kl: None,
            tokens: tokens as u64,
            loss_tokens: n_targets as u64,
            skipped: skipped as u64,
            ..Default::default()
        })
    }

    /// Held-out cross-entropy.
    fn validation(&mut self, student: &Student, val: &[Record]) -> Result<Option<ValReport>> {
        let (tok, eos, max_len) = (&self.tok, self.eos, self.max_len());
        let val = self
            .val
            .get_or_insert_with(|| encode_all(tok, val, eos, max_len).0);
        if val.is_empty() {
            return Ok(None);
        }
        let mb = self.cfg.policy.train_micro_batch_size;
        let ce = validation_ce(student.model(), val, mb, &self.device)?;
        Ok(Some(ValReport {
            loss: ce,
            kl: None,
            parts: BTreeMap::from([("ce".to_string(), ce)]),
            records: val.len() as u64,
            loss_tokens: val.iter().map(|e| targets_of(e) as u64).sum(),
            metric: "val_ce",
            summary: format!("ce {ce:.4}"),
        }))
    }

    /// Greedy task accuracy at the start, every `--eval-period` steps and at the end.
    fn evaluate(&mut self, ctx: EvalCtx) -> Result<BTreeMap<String, f64>> {
        let Some(task) = self.task else {
            return Ok(BTreeMap::new());
        };
        let due = ctx.step == 0
            || (task.period > 0 && ctx.step.is_multiple_of(task.period))
            || ctx.at_end;
        if !due {
            return Ok(BTreeMap::new());
        }
        let t0 = Instant::now();
        let r = eval::evaluate(ctx.student.model(), &self.tok, &task.records, &task.config)?;
        ctx.log.append(&AccuracyMetrics {
            split: "eval".into(),
            step: ctx.step,
            accuracy: r.greedy_accuracy,
            marker_rate: r.greedy_marker_rate,
            eos_rate: r.greedy_eos_rate,
            records: r.n as u64,
            time: t0.elapsed().as_secs_f64(),
        })?;
        ctx.progress.println(&format!(
            "task accuracy at step {}: {:.4} on {} prompts ({:.1}s)",
            ctx.step,
            r.greedy_accuracy,
            r.n,
            t0.elapsed().as_secs_f64()
        ));
        if ctx.step == 0 {
            self.accuracy_start = Some(r.greedy_accuracy);
        }
        self.accuracy_end = Some(r.greedy_accuracy);
        Ok(BTreeMap::from([(
            "accuracy".to_string(),
            r.greedy_accuracy,
        )]))
    }
}

/// The SFT run (also used by tests and the demo); `stop_after` as in [`RunOptions`].
pub fn train(
    cfg: &Config,
    task: Option<&TaskEval>,
    resume: bool,
    stop_after: Option<u64>,
) -> Result<Summary> {
    let mut objective = Sft::new(cfg, task)?;
    let device = objective.device.clone();
    let o = runner::run(
        cfg,
        &device,
        &mut objective,
        RunOptions { resume, stop_after },
    )?;
    Ok(Summary {
        steps: o.steps,
        seconds: o.seconds,
        val_ce_start: o.val_start.map(|v| v.loss),
        val_ce_end: o.val_end.map(|v| v.loss),
        accuracy_start: objective.accuracy_start,
        accuracy_end: objective.accuracy_end,
        skipped_records: o.skipped_records,
        final_dir: o.final_dir,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ActivationCheckpointing;
    use crate::train::testutil::{assert_rel, assert_same_grads, ids, tiny};
    use candle_core::DType;
    use rand::SeedableRng;

    /// The chunked SFT gradients ([`sft_grads`]) equal the unchunked loss's (`sft_loss` +
    /// `backward`) for every parameter, and the chunked validation NLL its value: 1- and 3-row
    /// chunks and the budget, kept and checkpointed activations, tied and untied heads; f64 to
    /// 1e-9, f32 to 1e-5. Composed, and through the fused ops (forced in this thread: the CPU
    /// runs their f64 reference), where each head chunk's cross-entropy and its gradient run
    /// by hand (`loss::fused_head`) against the fused loss through autograd.
    #[test]
    fn chunked_sft_equals_the_whole_loss() {
        for fused in [false, true] {
            xdistill_shared::model::device_ops::force_in_this_thread(Some(fused));
            chunked_sft_equals_the_whole_loss_with_these_ops();
        }
        xdistill_shared::model::device_ops::force_in_this_thread(None);
    }

    fn chunked_sft_equals_the_whole_loss_with_these_ops() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let examples: Vec<Encoded> = [(9, 3), (5, 1), (12, 7)]
            .into_iter()
            .map(|(len, loss_from)| Encoded {
                ids: ids(&mut rng, len),
                loss_from,
            })
            .collect();
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 1e-5)] {
            for tied in [false, true] {
                let (model, vm) = tiny(tied, dtype, 11);
                let (l, count) = sft_loss(&model, &examples, 30.0, &dev).unwrap();
                let want = l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
                let want_grads = l.backward().unwrap();
                for activations in [ActivationCheckpointing::Off, ActivationCheckpointing::On] {
                    for chunk_rows in [1, 3, 0] {
                        let head = HeadOpts {
                            activations,
                            chunk_rows,
                        };
                        let case = format!("{dtype:?} tied {tied} {head:?}");
                        let (g, got) = sft_grads(&model, &examples, 30.0, head, None).unwrap();
                        assert_rel(got, want, tol, &case);
                        assert_same_grads(&vm, &g, &want_grads, tol, &case);
                        let (sum, n) = nll_sum(&model, &examples, &dev, head.rows(40)).unwrap();
                        assert_eq!(n, count);
                        assert_rel(sum, want * 30.0, tol, &format!("{case}: validation"));
                    }
                }
            }
        }
    }

    #[test]
    fn a_prompts_only_file_is_refused_before_anything_is_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[policy]\nmodel_name = \"no-such-model\"\n[teacher]\nurls = [\"http://x.invalid\"]\n\
             [data]\ntrain_path = \"p.jsonl\"\nprompt_field = \"prompt\"\nprompts_only = true\n",
        )
        .unwrap();
        let cfg = Config::from_file(&path).unwrap();
        let err = Sft::new(&cfg, None).err().unwrap().to_string();
        assert!(err.contains("data.prompts_only"), "{err}");
    }
}
