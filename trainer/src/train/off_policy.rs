//! `trainer off-policy`: distil a student from a teacher server on dataset text.
//!
//! Per step: `num_prompts_per_step` records are tokenized for both sides (and aligned when the
//! tokenizers differ) and scored by the teacher on the prefetch thread while the previous step
//! trains; the step runs micro-batches of `train_micro_batch_size`, accumulating gradients
//! normalised by the whole step's count. The loop itself (clip, schedule, AdamW, validation,
//! checkpoints) is [`runner::run`]; what it shares with `on-policy` ([`Setup`], the record
//! filter, the group loss, held-out KL) is in [`super::distill`].

use super::distill::{distill_filter, kl_to_teacher, GroupLoss, Setup, Summary};
use super::prepare::{prepare, Prepared};
use super::runner::{
    self, Batches, Objective, RecordFilter, RunOptions, StepCtx, StepReport, ValReport,
};
use crate::client::{Fetched, Prefetcher};
use crate::config::{DistillArgs, ObjectiveKind};
use crate::data::Record;
use crate::student::Student;
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use xdistill_shared::protocol::SequenceScores;

/// Off-policy distillation on the data's own text; owns the teacher prefetcher.
pub struct OffPolicy<'a> {
    s: &'a Setup,
}

impl<'a> OffPolicy<'a> {
    pub fn new(s: &'a Setup) -> Result<OffPolicy<'a>> {
        if s.loss.kd.is_sampled() || s.loss_cross.kd.is_sampled() {
            bail!("loss.kd = sampled_kl scores the student's own samples: run `trainer on-policy`, or pick a top-k loss for off-policy training");
        }
        if s.cfg.data.prompts_only {
            bail!("data.prompts_only = true: off-policy distillation scores the data's completions, and a prompts-only file has none (run `trainer on-policy` with lambda = 1)");
        }
        Ok(OffPolicy { s })
    }
}

impl Objective for OffPolicy<'_> {
    type Input = Fetched<Prepared, Vec<Vec<SequenceScores>>>;

    fn open(&mut self, _: &Student) -> Result<Option<RecordFilter<'_>>> {
        Ok(distill_filter(self.s))
    }

    fn check_records(&self, records: &[Record], what: &str) -> Result<()> {
        self.s.teachers.check_records(records, what)
    }

    fn feed(&mut self, batches: Batches) -> Box<dyn Iterator<Item = Result<Self::Input>>> {
        let teachers = self.s.teachers.clone();
        let depth = teachers
            .list
            .iter()
            .map(|t| t.cfg.prefetch)
            .max()
            .unwrap_or(1);
        let t = teachers.clone();
        let batches = batches.map(move |b| prepare(b, &t));
        // Every group's teacher is asked at once: the step waits for the slowest, not the sum.
        let mut prefetch = Prefetcher::spawn(batches, depth.max(1), move |p: &Prepared| {
            teachers.score_all(&p.groups.iter().collect::<Vec<_>>())
        });
        Box::new(std::iter::from_fn(move || {
            Some(
                prefetch
                    .next()?
                    .map_err(|e| anyhow::anyhow!("teacher: {e}")),
            )
        }))
    }

    fn step(&mut self, ctx: &mut StepCtx, fetched: Self::Input) -> Result<StepReport> {
        let (s, p) = (self.s, fetched.batch);
        if p.groups.is_empty() {
            tracing::warn!("step {}: every record of the batch was skipped", ctx.step);
        }
        let groups: Vec<_> = p
            .groups
            .iter()
            .zip(&fetched.result)
            .map(|(g, a)| (g.source, g.items.as_slice(), a.as_slice()))
            .collect();
        let mut parts = BTreeMap::new();
        let gl = GroupLoss {
            s,
            same: &s.loss,
            cross: &s.loss_cross,
        };
        let (sums, norm) = gl.accumulate(ctx.student.model(), ctx.acc, &groups, &mut parts)?;
        let kd_mean = sums.kd_mean(norm);
        parts.insert("kd".to_string(), kd_mean);
        if let Some(ce) = sums.ce_mean() {
            parts.insert("ce".to_string(), ce);
        }
        parts.insert("kd_scale".to_string(), sums.kd_scale);
        Ok(StepReport {
            epoch: p.batch.start.epoch,
            next: p.batch.next,
            loss: kd_mean * sums.kd_scale + sums.ce_mean().unwrap_or(0.0),
            loss_parts: parts,
            kl: Some(kd_mean / (s.loss.temperature * s.loss.temperature)),
            tokens: p.items().map(|i| i.teacher_ids().len() as u64).sum(),
            loss_tokens: norm.ce as u64,
            teacher_latency_s: fetched.fetch_time.as_secs_f64(),
            teacher_wait_s: fetched.wait_time.as_secs_f64(),
            skipped: p.skipped,
        })
    }

    fn validation(&mut self, student: &Student, val: &[Record]) -> Result<Option<ValReport>> {
        if val.is_empty() {
            return Ok(None);
        }
        let mb = self.s.cfg.policy.train_micro_batch_size;
        let (v, per) = kl_to_teacher(self.s, student.model(), val, mb)?;
        let (kl, ce) = (v.kl / v.kl_units.max(1.0), v.ce / v.ce_tokens.max(1.0));
        let mut parts = BTreeMap::from([("ce".to_string(), ce)]);
        if per.len() > 1 {
            for (name, v) in per {
                parts.insert(format!("teacher/{name}/kl"), v.kl / v.kl_units.max(1.0));
            }
        }
        Ok(Some(ValReport {
            loss: kl,
            kl: Some(kl),
            parts,
            records: val.len() as u64,
            loss_tokens: v.ce_tokens as u64,
            metric: "val_kl",
            summary: format!("kl {kl:.4} ce {ce:.4}"),
        }))
    }
}

/// `trainer off-policy`.
pub fn run(args: DistillArgs) -> Result<()> {
    super::distill::run_command(&args, ObjectiveKind::OffPolicy, train)
}

/// The off-policy run (also used by tests and the demo with a ready [`Setup`]); `stop_after`
/// as in [`RunOptions`].
pub fn train(s: &Setup, resume: bool, stop_after: Option<u64>) -> Result<Summary> {
    let mut objective = OffPolicy::new(s)?;
    let opts = RunOptions { resume, stop_after };
    let o = runner::run(&s.cfg, &s.device, &mut objective, opts)?;
    Ok(Summary::from_outcome(&o))
}
