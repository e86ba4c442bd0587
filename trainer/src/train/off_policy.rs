//! `trainer off-policy`: distil a student from a teacher server on dataset text.
//!
//! Per step: `num_prompts_per_step` records are tokenized for both sides (and aligned when the
//! tokenizers differ) and scored by the teacher on the prefetch thread while the previous step
//! trains; the step runs micro-batches of `train_micro_batch_size`, accumulating gradients
//! normalised by the whole step's count. The loop itself (clip, schedule, AdamW, validation,
//! checkpoints) is [`runner::run`]; what it shares with `on-policy` ([`Setup`], the record
//! filter, the group loss, held-out KL) is in [`super::distill`].

use super::distill::{
    distill_filter, finish_teacher_parts, kl_to_teacher, GroupLoss, Setup, Summary,
};
use super::prepare::{prepare, Prepared};
use super::runner::{
    self, Objective, RecordFilter, RunOptions, StepCtx, StepReport, Steps, ValReport,
};
use super::step::StepSums;
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
    /// This rank's shards, each prepared, with every group's answers (`[shard][group][row]`).
    type Input = Fetched<Vec<Prepared>, Vec<Vec<Vec<SequenceScores>>>>;

    fn open(&mut self, _: &Student) -> Result<Option<RecordFilter<'_>>> {
        Ok(distill_filter(self.s))
    }

    fn check_records(&self, records: &[Record], what: &str) -> Result<()> {
        self.s.teachers.check_records(records, what)
    }

    fn feed(&mut self, steps: Steps) -> Box<dyn Iterator<Item = Result<Self::Input>>> {
        let teachers = self.s.teachers.clone();
        let depth = teachers
            .list
            .iter()
            .map(|t| t.cfg.prefetch)
            .max()
            .unwrap_or(1);
        let t = teachers.clone();
        let steps = steps.map(move |st| {
            st.batches()
                .into_iter()
                .map(|b| prepare(b, &t))
                .collect::<Vec<_>>()
        });
        // Every group of every shard is asked at once: the step waits for the slowest teacher,
        // not the sum; each rank asks only for its own shards.
        let mut prefetch = Prefetcher::spawn(steps, depth.max(1), move |ps: &Vec<Prepared>| {
            let groups: Vec<_> = ps.iter().flat_map(|p| &p.groups).collect();
            let mut answers = teachers.score_all(&groups)?.into_iter();
            Ok::<_, crate::train::teachers::ScoreError>(
                ps.iter()
                    .map(|p| answers.by_ref().take(p.groups.len()).collect())
                    .collect(),
            )
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
        let (s, shards) = (self.s, &fetched.batch);
        let Some(first) = shards.first() else {
            bail!("step {}: this rank has no shard", ctx.step);
        };
        let gl = GroupLoss {
            s,
            same: &s.loss,
            cross: &s.loss_cross,
        };
        let shard_groups: Vec<Vec<_>> = shards
            .iter()
            .zip(&fetched.result)
            .map(|(p, answers)| {
                p.groups
                    .iter()
                    .zip(answers)
                    .map(|(g, a)| (g.source, g.items.as_slice(), a.as_slice()))
                    .collect()
            })
            .collect();
        let norm = gl.global_units(ctx, shard_groups.iter().flatten())?;
        if norm.kd == 0.0 {
            tracing::warn!("step {}: every record of the batch was skipped", ctx.step);
        }
        let mut parts = BTreeMap::new();
        let mut sums = StepSums {
            kd_scale: 1.0,
            ..Default::default()
        };
        for groups in &shard_groups {
            sums += gl.accumulate(ctx.student.model(), ctx.acc, groups, norm, &mut parts)?;
            ctx.acc.end_shard()?;
        }
        let tokens: u64 = shards
            .iter()
            .flat_map(|p| p.items())
            .map(|i| i.teacher_ids().len() as u64)
            .sum();
        let skipped: u64 = shards.iter().map(|p| p.skipped).sum();
        let mut figures = [
            sums.kd_sum,
            sums.ce_sum,
            sums.ce_n,
            tokens as f64,
            skipped as f64,
        ];
        ctx.sum(&mut figures)?;
        let [kd_sum, ce_sum, ce_n, tokens, skipped] = figures;
        let sums = StepSums {
            kd_sum,
            ce_sum,
            ce_n,
            kd_scale: sums.kd_scale,
        };
        finish_teacher_parts(&mut parts);
        let kd_mean = sums.kd_mean(norm);
        parts.insert("kd".to_string(), kd_mean);
        if let Some(ce) = sums.ce_mean() {
            parts.insert("ce".to_string(), ce);
        }
        parts.insert("kd_scale".to_string(), sums.kd_scale);
        Ok(StepReport {
            epoch: first.batch.start.epoch,
            next: first.batch.next,
            loss: kd_mean * sums.kd_scale + sums.ce_mean().unwrap_or(0.0),
            loss_parts: parts,
            kl: Some(kd_mean / (s.loss.temperature.get() * s.loss.temperature.get())),
            tokens: tokens as u64,
            loss_tokens: norm.ce as u64,
            teacher_latency_s: fetched.fetch_time.as_secs_f64(),
            teacher_wait_s: fetched.wait_time.as_secs_f64(),
            skipped: skipped as u64,
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
