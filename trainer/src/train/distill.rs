//! What the two distillation objectives share: the connected teachers ([`Teachers`]: each with
//! its tokenizer relation, decided once), the loss of a step's groups of records (one per
//! teacher, or the ensemble), held-out KL to the teachers, the record filter and the run
//! summary.

use super::micro::{Units, ValSums};
use super::pairing::LossCtx;
use super::pairing::{units, Item};
use super::prepare::prepare;
use super::runner::RecordFilter;
use super::step::{validation_sums, StepSums};
use super::teachers::{Source, Teachers};
use crate::config::Config;
use crate::data::{self, Record};
use crate::loss::LossConfig;
use anyhow::Result;
use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::Arc;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

/// Everything a run needs that does not change while it trains.
pub struct Setup {
    pub cfg: Config,
    /// `[loss]`: the loss of teachers sharing the student's tokenizer (and of the others unless
    /// `[loss_cross]` is set).
    pub loss: LossConfig,
    /// The loss of teachers with a different tokenizer (`[loss_cross]`, else `[loss]`).
    pub loss_cross: LossConfig,
    pub device: Device,
    /// Every teacher, connected, with its tokenizer relation and projection.
    pub teachers: Arc<Teachers>,
}

/// Connects to every teacher (each decides same vs cross tokenizer and builds its projection).
pub fn setup(cfg: Config) -> Result<Setup> {
    let loss: LossConfig = cfg.loss()?.clone();
    loss.validate()?;
    let loss_cross = cfg.loss_cross.clone().unwrap_or_else(|| loss.clone());
    // `cuda` is `cuda:LOCAL_RANK` in a data-parallel job.
    let device = crate::dist::device(&cfg.policy.device, crate::dist::World::from_env()?.as_ref())?;
    let teachers = Arc::new(Teachers::connect(&cfg, &loss, &loss_cross, &device)?);
    Ok(Setup {
        cfg,
        loss,
        loss_cross,
        device,
        teachers,
    })
}

impl Setup {
    /// The loss of `source`'s records: `[loss]`, or `[loss_cross]` for a teacher with a different
    /// tokenizer.
    pub fn loss_of(&self, source: Source) -> &LossConfig {
        if self.teachers.is_cross(source) {
            &self.loss_cross
        } else {
            &self.loss
        }
    }

    /// The loss context of `model` under `loss` (the run's `[loss]`, or an objective's variant
    /// of it) for records scored by `source`, whose answers have `k` entries per row (the
    /// teacher's k; an ensemble's union width).
    pub fn loss_ctx<'a>(
        &'a self,
        source: Source,
        k: usize,
        model: &'a Decoder,
        loss: &'a LossConfig,
    ) -> LossCtx<'a> {
        LossCtx {
            model,
            k,
            loss,
            pairing: self.teachers.pairing(source),
            device: &self.device,
            micro_batch: self.cfg.policy.train_micro_batch_size.max(1),
            head: super::head_chunks::HeadOpts {
                activations: self.cfg.policy.activation_checkpointing,
                chunk_rows: 0,
            },
        }
    }

    /// The student tokenizer.
    pub fn student_tokenizer(&self) -> &tokenizers::Tokenizer {
        self.teachers.student_tokenizer()
    }
}

/// The width of a group's answers (its teacher's k, or an ensemble's union).
pub fn answer_k(s: &Setup, source: Source, scores: &[SequenceScores]) -> usize {
    match source {
        Source::One(i) => s.teachers.list[i].cfg.k,
        Source::Mixture => scores.first().map_or(s.teachers.list[0].cfg.k, |x| x.k),
    }
}

/// The losses of a step's groups (each source's records against its answers), every one
/// normalised by the whole step's units; adds per-teacher figures (`teacher/<name>/kd`, `/kl`,
/// `/tokens`) to `parts` when the run has several teachers.
pub struct GroupLoss<'a> {
    pub s: &'a Setup,
    /// The loss of records whose teacher shares the student's tokenizer, and of the others.
    pub same: &'a LossConfig,
    pub cross: &'a LossConfig,
}

impl GroupLoss<'_> {
    /// The loss for `source`'s records.
    pub fn loss_of(&self, source: Source) -> &LossConfig {
        if self.s.teachers.is_cross(source) {
            self.cross
        } else {
            self.same
        }
    }

    /// The step's units over `groups` (`(source, items, answers)`) and every rank's: what each
    /// micro-batch's loss is divided by.
    pub fn global_units<'g>(
        &self,
        ctx: &mut super::runner::StepCtx,
        groups: impl Iterator<Item = &'g (Source, &'g [Item], &'g [SequenceScores])>,
    ) -> Result<Units> {
        let mut norm = Units::default();
        for (_, items, _) in groups {
            norm += units(items);
        }
        let mut v = [norm.kd, norm.ce];
        ctx.sum(&mut v)?;
        Ok(Units { kd: v[0], ce: v[1] })
    }

    /// Trains `groups` (`(source, items, answers)`) into `acc`, every loss divided by the
    /// step's global units `norm`; returns this rank's sums.
    pub fn accumulate(
        &self,
        model: &Decoder,
        acc: &mut crate::optim::GradAccumulator,
        groups: &[(Source, &[Item], &[SequenceScores])],
        norm: Units,
        parts: &mut BTreeMap<String, f64>,
    ) -> Result<StepSums> {
        let s = self.s;
        let mut total = StepSums {
            kd_scale: 1.0,
            ..Default::default()
        };
        for &(source, items, scores) in groups {
            if items.is_empty() {
                continue;
            }
            let refs: Vec<&SequenceScores> = scores.iter().collect();
            let loss = self.loss_of(source);
            let lc = s.loss_ctx(source, answer_k(s, source, scores), model, loss);
            let sums = super::step::accumulate(&lc, acc, items, &refs, norm)?;
            let u = units(items);
            let tokens: usize = items.iter().map(|i| i.teacher_ids().len()).sum();
            let f = TeacherFigures {
                kd_sum: sums.kd_sum,
                kd_units: u.kd,
                temperature: loss.temperature.get(),
                sequences: items.len(),
                tokens,
            };
            teacher_parts(s, source, f, parts);
            total += sums;
        }
        Ok(total)
    }
}

/// What one teacher did in one group of a step (a step of several shards has a group per shard):
/// its records' summed KD loss and units, and the sequences and tokens sent to it.
pub struct TeacherFigures {
    pub kd_sum: f64,
    pub kd_units: f64,
    pub temperature: f64,
    pub sequences: usize,
    pub tokens: usize,
}

/// Adds a teacher's figures of one group to the step's `parts` (`teacher/<name>/kd`, `/kl` with
/// τ² removed, `/sequences`, `/tokens`), when the run has several teachers. `kd` and `kl` are
/// sums (with the units beside them) until [`finish_teacher_parts`] makes them the step's means.
pub fn teacher_parts(
    s: &Setup,
    source: Source,
    f: TeacherFigures,
    parts: &mut BTreeMap<String, f64>,
) {
    if s.teachers.list.len() > 1 {
        add_teacher_figures(parts, s.teachers.name(source), &f);
    }
}

/// [`teacher_parts`] for the teacher called `name`.
fn add_teacher_figures(parts: &mut BTreeMap<String, f64>, name: &str, f: &TeacherFigures) {
    let mut add = |key: &str, v: f64| {
        *parts.entry(format!("teacher/{name}/{key}")).or_insert(0.0) += v;
    };
    add("kd", f.kd_sum);
    add("kl", f.kd_sum / (f.temperature * f.temperature));
    add(UNITS, f.kd_units);
    add("sequences", f.sequences as f64);
    add("tokens", f.tokens as f64);
}

/// The key of a teacher's KD units while its step's parts are summed.
const UNITS: &str = "kd_units";

/// Ends a step's per-teacher parts: each teacher's `kd` and `kl` sums over the step's groups
/// become means over its units (as one group's `kd_sum / units` before shards), and the units go.
pub fn finish_teacher_parts(parts: &mut BTreeMap<String, f64>) {
    let suffix = format!("/{UNITS}");
    let names: Vec<String> = parts
        .keys()
        .filter_map(|k| {
            Some(
                k.strip_prefix("teacher/")?
                    .strip_suffix(&suffix)?
                    .to_string(),
            )
        })
        .collect();
    for name in names {
        let units = parts
            .remove(&format!("teacher/{name}{suffix}"))
            .unwrap_or(0.0)
            .max(1.0);
        for key in ["kd", "kl"] {
            if let Some(v) = parts.get_mut(&format!("teacher/{name}/{key}")) {
                *v /= units;
            }
        }
    }
}

/// KL to the teacher(s) and cross-entropy of `model` on `records`, in batches of `batch` (sums
/// with their counts; see [`validation_sums`]), overall and per teacher name. Also used by the
/// demo to probe saved models.
pub fn kl_to_teacher(
    s: &Setup,
    model: &Decoder,
    records: &[Record],
    batch: usize,
) -> Result<(ValSums, BTreeMap<String, ValSums>)> {
    let mut sums = ValSums::default();
    let mut per: BTreeMap<String, ValSums> = BTreeMap::new();
    for chunk in records.chunks(batch.max(1)) {
        let batch = data::Batch {
            records: chunk.to_vec(),
            start: Default::default(),
            next: Default::default(),
        };
        let p = prepare(batch, &s.teachers);
        let answers = s.teachers.score_all(&p.groups.iter().collect::<Vec<_>>())?;
        for (g, scores) in p.groups.iter().zip(&answers) {
            let refs: Vec<&SequenceScores> = scores.iter().collect();
            let lc = s.loss_ctx(
                g.source,
                answer_k(s, g.source, scores),
                model,
                s.loss_of(g.source),
            );
            let v = validation_sums(&lc, &g.items, &refs)?;
            sums += v;
            *per.entry(s.teachers.name(g.source).to_string())
                .or_default() += v;
        }
    }
    Ok((sums, per))
}

/// What a finished run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub steps: u64,
    pub seconds: f64,
    pub val_kl_start: Option<f64>,
    pub val_kl_end: Option<f64>,
    pub val_ce_end: Option<f64>,
    pub skipped_records: u64,
    pub final_dir: String,
    /// On-policy runs: mean teacher log-prob of the student's held-out samples.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_teacher_logprob_start: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_teacher_logprob_end: Option<f64>,
}

/// A distillation command (`trainer off-policy`, `trainer on-policy`): loads the config,
/// connects to the teacher, runs `train` and prints its summary as one JSON line.
pub fn run_command(
    args: &crate::config::DistillArgs,
    objective: crate::config::ObjectiveKind,
    train: fn(&Setup, bool, Option<u64>) -> Result<Summary>,
) -> Result<()> {
    use anyhow::Context;
    let cfg = args.load_config(objective)?;
    let out = &cfg.checkpointing.checkpoint_dir;
    // Rank 0 alone writes the output folder of a data-parallel job.
    if crate::dist::World::from_env()?.is_none_or(|w| w.is_main()) {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    }
    let s = setup(cfg)?;
    let summary = train(&s, args.common.resume, None)?;
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

impl Summary {
    /// The summary of a distillation run (on-policy validation also reports the teacher's
    /// log-prob of the student's samples).
    pub fn from_outcome(o: &super::runner::Outcome) -> Summary {
        let part = |v: &Option<super::runner::ValReport>, name: &str| {
            v.as_ref().and_then(|v| v.parts.get(name).copied())
        };
        Summary {
            steps: o.steps,
            seconds: o.seconds,
            val_kl_start: o.val_start.as_ref().map(|v| v.loss),
            val_kl_end: o.val_end.as_ref().map(|v| v.loss),
            val_ce_end: part(&o.val_end, "ce"),
            skipped_records: o.skipped_records,
            final_dir: o.final_dir.clone(),
            val_teacher_logprob_start: part(&o.val_start, "teacher_logprob"),
            val_teacher_logprob_end: part(&o.val_end, "teacher_logprob"),
        }
    }
}

/// The records over their teacher's or the student's token limits (unless `data.truncate` cuts
/// them), for both distillation objectives; also checks that every record has a teacher.
pub fn distill_filter(s: &Setup) -> Option<RecordFilter<'_>> {
    let t = &s.teachers;
    (!s.cfg.data.truncate).then(|| RecordFilter {
        too_long: Box::new(|r: &Record| t.too_long(r)),
        limits: format!(
            "the token limits (policy.max_total_sequence_length = {}, or the teacher's \
             max_seq_len); raise the limit or set data.truncate = true",
            s.cfg.policy.max_total_sequence_length
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A teacher's step over two shards: the means weigh each shard by its units (the mean of
    /// the step's whole sum), the counts add up, and the units do not reach the metrics.
    #[test]
    fn a_teachers_parts_over_shards_are_unit_weighted_means_and_sums() {
        let mut parts = BTreeMap::new();
        // Shard 1: 4 units, KD sum 2.0 at τ = 2; shard 2: 1 unit, KD sum 1.0.
        for (kd_sum, kd_units, sequences) in [(2.0, 4.0, 3), (1.0, 1.0, 1)] {
            let f = TeacherFigures {
                kd_sum,
                kd_units,
                temperature: 2.0,
                sequences,
                tokens: 10 * sequences,
            };
            add_teacher_figures(&mut parts, "a", &f);
        }
        finish_teacher_parts(&mut parts);
        assert_eq!(parts["teacher/a/kd"], 3.0 / 5.0);
        assert_eq!(parts["teacher/a/kl"], 0.75 / 5.0);
        assert_eq!(parts["teacher/a/sequences"], 4.0);
        assert_eq!(parts["teacher/a/tokens"], 40.0);
        assert!(!parts.contains_key("teacher/a/kd_units"));
    }
}
