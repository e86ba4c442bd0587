//! `trainer on-policy`: the student samples completions of the data's prompts, the teacher scores
//! them, and the student is trained on its own samples.
//!
//! - Same tokenizer: prompt + completion goes to the teacher in one request with `starts` at the
//!   completion, so only completion positions come back. With `kd = sampled_kl` the loss is the
//!   sampled-token reverse KL with the teacher's log-prob of each sampled token as advantage
//!   (field notes §3); a top-k loss (`forward_kl`, `jsd`, …) uses the teacher's top-k there.
//! - Different tokenizers: each completion is decoded to text, prompt + completion is tokenized
//!   once for both sides (no spurious space at the join), aligned, and trained with the
//!   cross-tokenizer loss of `[loss]`; `sampled_kl` becomes the chunk-level sampled reverse KL
//!   (`loss::chunk_sampled_loss`, the teacher's log-probs of each chunk's tokens summed).
//! - `[on_policy] lambda`: the share of steps that sample; the others train off-policy on the
//!   data's own prompt + completion, so one run can mix both (TRL GKD's λ).

use super::distill::{answer_k, teacher_parts, GroupLoss, Setup, Summary, TeacherFigures};
use super::off_policy::distill_filter;
use super::pairing::cross::trained_teacher_rows;
use super::pairing::sampled::{sampled_grads, Sample};
use super::pairing::{units, Item};
use super::prepare::{prepare, Group};
use super::runner::{
    self, Batches, Objective, RecordFilter, RunOptions, StepCtx, StepReport, ValReport,
};
use super::step::{accumulate, validation_sums, Units, ValSums};
use super::teachers::{in_parallel, Source};
use crate::collate::Encoded;
use crate::config::{DistillArgs, ObjectiveKind};
use crate::data::{Batch, Content, Record};
use crate::generate::{generate, Generation};
use crate::loss::{KdConfig, LossConfig};
use crate::student::Student;
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::time::Instant;
use xdistill_shared::protocol::{SequenceScores, TopkRequest};

/// `trainer on-policy` (the off-policy flags; `--prompts` is an alias of `--data`).
pub fn run(args: DistillArgs) -> Result<()> {
    super::distill::run_command(&args, ObjectiveKind::OnPolicy, train)
}

/// The on-policy run (also used by tests and the demo); `stop_after` as in [`RunOptions`].
pub fn train(s: &Setup, resume: bool, stop_after: Option<u64>) -> Result<Summary> {
    let mut objective = OnPolicy::new(s)?;
    let opts = RunOptions { resume, stop_after };
    let o = runner::run(&s.cfg, &s.device, &mut objective, opts)?;
    Ok(Summary::from_outcome(&o))
}

/// On-policy distillation, mixed with off-policy steps by `[on_policy] lambda`: owns generation
/// and the λ draws.
pub struct OnPolicy<'a> {
    s: &'a Setup,
    /// The loss of the off-policy steps, for same- and cross-tokenizer teachers.
    off_same: LossConfig,
    off_cross: LossConfig,
    tok: tokenizers::Tokenizer,
}

impl<'a> OnPolicy<'a> {
    pub fn new(s: &'a Setup) -> Result<OnPolicy<'a>> {
        let op = &s.cfg.on_policy;
        if !(0.0..=1.0).contains(&op.lambda) {
            bail!("on_policy.lambda = {} must be in [0, 1]", op.lambda);
        }
        op.generation.validate()?;
        if s.cfg.data.prompts_only && op.lambda < 1.0 {
            bail!(
                "on_policy.lambda = {} trains some steps on the data's completions, and \
                 data.prompts_only = true has none: set lambda = 1",
                op.lambda
            );
        }
        Ok(OnPolicy {
            s,
            off_same: off_policy_loss(&s.loss, false),
            off_cross: off_policy_loss(&s.loss_cross, true),
            tok: s.student_tokenizer().clone(),
        })
    }

    /// Samples completions of `batch`'s prompts, scores them (each prompt's samples by its
    /// teacher) and accumulates the loss.
    fn on_step(&self, ctx: &mut StepCtx, batch: &Batch, r: &mut StepReport) -> Result<()> {
        let (s, mb) = (self.s, self.s.cfg.policy.train_micro_batch_size.max(1));
        let mut stats = SampleStats::default();
        // 1. Sample with the current weights (fused kernels, same vars).
        let t0 = Instant::now();
        let model = ctx.student.inference_model()?;
        let gens = sample(s, &model, &self.tok, &batch.records, ctx.rng)?;
        let gen_s = t0.elapsed().as_secs_f64();
        gens.iter().for_each(|g| stats.add_generation(g));
        // 2. Every source's samples scored at once.
        let t1 = Instant::now();
        let scored = score_samples(s, &batch.records, &gens)?;
        r.teacher_latency_s = t1.elapsed().as_secs_f64();
        // 3. The step's units over every source, then each source's loss.
        let mut norm = Units::default();
        for g in &scored {
            norm += g.units(s);
        }
        let mut kd_sum = 0.0;
        for g in &scored {
            let (source, scores) = (g.source, &g.scores);
            let refs: Vec<&SequenceScores> = scores.iter().collect();
            let loss = s.loss_of(source);
            let lc = s.loss_ctx(
                source,
                answer_k(s, source, scores),
                ctx.student.model(),
                loss,
            );
            let (sum, tokens, sequences) = match &g.samples {
                Scored::Same { samples, .. } => {
                    stats.add_same(samples, scores);
                    let tokens = samples.iter().map(|x| x.ids.len()).sum::<usize>();
                    let sum = if s.loss.kd.is_sampled() {
                        let mut sum = 0.0;
                        for (xs, sc) in samples.chunks(mb).zip(refs.chunks(mb)) {
                            let (g, v) = sampled_grads(&lc, xs, sc, norm.kd.max(1.0))?;
                            ctx.acc.add(&g)?;
                            sum += v * norm.kd;
                        }
                        sum
                    } else {
                        accumulate(&lc, ctx.acc, &same_items(s, samples), &refs, norm)?.kd_sum
                    };
                    (sum, tokens, samples.len())
                }
                Scored::Cross { group, used } => {
                    let items = &group.items;
                    // A chunk-level ensemble has no per-token teacher log-probs to compare.
                    if lc.pairing.scores_tokens() {
                        stats.add_student_lps(used.iter().map(|&i| &gens[i]));
                        stats.add_teacher_scores(items, &refs);
                    }
                    let tokens = items.iter().map(|i| i.teacher_ids().len()).sum::<usize>();
                    let sum = accumulate(&lc, ctx.acc, items, &refs, norm)?.kd_sum;
                    (sum, tokens, items.len())
                }
            };
            let u = g.units(s);
            let f = TeacherFigures {
                kd: sum / u.kd.max(1.0),
                temperature: loss.temperature,
                sequences,
                tokens,
            };
            teacher_parts(s, source, f, &mut r.loss_parts);
            r.tokens += tokens as u64;
            kd_sum += sum;
        }
        r.skipped += scored.iter().map(|g| g.dropped).sum::<u64>();
        stats.into_parts(&mut r.loss_parts);
        r.loss_parts.insert("generation_s".into(), gen_s);
        r.kl = (stats.tokens > 0.0).then(|| stats.reverse_kl());
        self.finish(r, kd_sum, norm);
        Ok(())
    }

    /// An off-policy step on the data's own prompt + completion.
    fn off_step(&self, ctx: &mut StepCtx, batch: &Batch, r: &mut StepReport) -> Result<()> {
        let s = self.s;
        let p = prepare(batch.clone(), &s.teachers);
        r.skipped += p.skipped;
        let t1 = Instant::now();
        let answers = s.teachers.score_all(&p.groups.iter().collect::<Vec<_>>())?;
        r.teacher_latency_s = t1.elapsed().as_secs_f64();
        let groups: Vec<_> = p
            .groups
            .iter()
            .zip(&answers)
            .map(|(g, a)| (g.source, g.items.as_slice(), a.as_slice()))
            .collect();
        r.tokens = p.items().map(|i| i.teacher_ids().len() as u64).sum();
        let gl = GroupLoss {
            s,
            same: &self.off_same,
            cross: &self.off_cross,
        };
        let (sums, norm) =
            gl.accumulate(ctx.student.model(), ctx.acc, &groups, &mut r.loss_parts)?;
        self.finish(r, sums.kd_sum, norm);
        Ok(())
    }

    /// The step's loss figures from the summed KD and its units.
    fn finish(&self, r: &mut StepReport, kd_sum: f64, norm: Units) {
        let kd_mean = kd_sum / norm.kd.max(1.0);
        r.loss_parts.insert("scoring_s".into(), r.teacher_latency_s);
        r.loss_parts.insert("kd".into(), kd_mean);
        r.loss = kd_mean;
        r.loss_tokens = norm.ce.max(norm.kd) as u64;
        r.teacher_wait_s = r.teacher_latency_s;
    }
}

impl Objective for OnPolicy<'_> {
    type Input = Batch;

    fn open(&mut self, _: &Student) -> Result<Option<RecordFilter<'_>>> {
        Ok(distill_filter(self.s))
    }

    fn feed(&mut self, batches: Batches) -> Box<dyn Iterator<Item = Result<Batch>>> {
        Box::new(batches.map(Ok))
    }

    fn step(&mut self, ctx: &mut StepCtx, batch: Batch) -> Result<StepReport> {
        let op = &self.s.cfg.on_policy;
        let on = op.lambda >= 1.0 || ctx.rng.random::<f64>() < op.lambda;
        let mut r = StepReport {
            epoch: batch.start.epoch,
            next: batch.next,
            ..Default::default()
        };
        if on {
            self.on_step(ctx, &batch, &mut r)?;
        } else {
            self.off_step(ctx, &batch, &mut r)?;
        }
        r.loss_parts.insert("on_policy".into(), on as u8 as f64);
        Ok(r)
    }

    fn validation(&mut self, student: &Student, val: &[Record]) -> Result<Option<ValReport>> {
        let Some((kl, st)) = validation_pass(self.s, student, val)? else {
            return Ok(None);
        };
        let mut parts = BTreeMap::new();
        st.into_parts(&mut parts);
        Ok(Some(ValReport {
            loss: kl,
            kl: Some(kl),
            parts,
            records: val.len() as u64,
            loss_tokens: st.tokens as u64,
            metric: "val_kl",
            summary: format!(
                "kl {kl:.4}, teacher log-prob of samples {:.4}, eos {:.0}%",
                st.mean_teacher_lp(),
                100.0 * st.eos as f64 / st.completions.max(1) as f64,
            ),
        }))
    }
}

/// The prompt part of a record (the whole text for plain-text records).
fn prompt_of(r: &Record) -> String {
    match &r.content {
        Content::Pair { prompt, .. } => prompt.clone(),
        Content::Text { text } => text.clone(),
    }
}

/// The loss for off-policy steps of a mixed run: `[loss]` itself, or, when `[loss]` is the
/// sampled-token loss (which needs samples), forward KL over the top-k (same tail and
/// temperature), or `first_kl` across tokenizers.
fn off_policy_loss(l: &LossConfig, cross: bool) -> LossConfig {
    let mut o = l.clone();
    if l.kd.is_sampled() {
        o.kd = if cross {
            KdConfig::FirstKl {}
        } else {
            KdConfig::ForwardKl {}
        };
    }
    o
}

/// Figures of the samples of one step or one validation pass.
#[derive(Debug, Clone, Copy, Default)]
struct SampleStats {
    /// Sum of the teacher's log-probs of the sampled text, over `tokens` teacher tokens.
    teacher_lp: f64,
    /// Sum of the student's log-probs of its samples, over `student_tokens` student tokens
    /// (the two counts differ across tokenizers).
    student_lp: f64,
    tokens: f64,
    student_tokens: f64,
    completions: usize,
    eos: usize,
    completion_tokens: usize,
}

impl SampleStats {
    fn add_generation(&mut self, g: &Generation) {
        self.completions += 1;
        self.eos += g.hit_eos as usize;
        self.completion_tokens += g.completion_ids.len();
    }
    fn mean_teacher_lp(&self) -> f64 {
        self.teacher_lp / self.tokens.max(1.0)
    }
    fn mean_student_lp(&self) -> f64 {
        self.student_lp / self.student_tokens.max(1.0)
    }
    /// Same tokenizer: both sides' log-probs of each completion token.
    fn add_same(&mut self, samples: &[Sample], scores: &[SequenceScores]) {
        for (x, sc) in samples.iter().zip(scores) {
            for (j, p) in (x.completion_from - 1..x.ids.len() - 1).enumerate() {
                self.teacher_lp += sc.target_logprobs[p] as f64;
                self.student_lp += x.old_lp[j] as f64;
                self.student_tokens += 1.0;
                self.tokens += 1.0;
            }
        }
    }
    /// Cross tokenizer: the teacher's log-probs of the trained part of the scored text (the
    /// completion unless `include_prompt`), per teacher token.
    fn add_teacher_scores(&mut self, items: &[Item], scores: &[&SequenceScores]) {
        for (it, sc) in items.iter().zip(scores) {
            let Some((pair, loss_start)) = it.aligned() else {
                continue;
            };
            for p in trained_teacher_rows(pair, loss_start) {
                self.teacher_lp += sc.target_logprobs[p] as f64;
                self.tokens += 1.0;
            }
        }
    }
    /// The student's own log-probs of its samples (cross tokenizer: the teacher side counts
    /// teacher tokens, so the student side is taken from the generations that were scored).
    fn add_student_lps<'a>(&mut self, gens: impl IntoIterator<Item = &'a Generation>) {
        for g in gens {
            self.student_lp += g.sampled_logprobs.iter().map(|&x| x as f64).sum::<f64>();
            self.student_tokens += g.sampled_logprobs.len() as f64;
        }
    }
    /// Monte-Carlo reverse KL per student token, `(Σ lp_S − Σ lp_T) / student tokens` over the
    /// scored samples: the mean of `lp_S − lp_T` per sampled token with one tokenizer; across
    /// tokenizers each side sums its own tokens of the same text, so the difference is the
    /// sequence-level `log p_S(text) − log p_T(text)`.
    fn reverse_kl(&self) -> f64 {
        (self.student_lp - self.teacher_lp) / self.student_tokens.max(1.0)
    }
    /// The figures as metrics; the log-prob comparisons only when some teacher scored tokens
    /// (a chunk-level ensemble has no per-token log-probs).
    fn into_parts(self, parts: &mut BTreeMap<String, f64>) {
        if self.tokens > 0.0 {
            parts.insert("reverse_kl".into(), self.reverse_kl());
            parts.insert("teacher_logprob".into(), self.mean_teacher_lp());
            parts.insert("student_logprob".into(), self.mean_student_lp());
        }
        parts.insert(
            "completion_len".into(),
            self.completion_tokens as f64 / self.completions.max(1) as f64,
        );
        parts.insert(
            "eos_share".into(),
            self.eos as f64 / self.completions.max(1) as f64,
        );
    }
}

/// Generates for `records`, returns the generations and the time it took.
fn sample(
    s: &Setup,
    model: &xdistill_shared::model::Decoder,
    tok: &tokenizers::Tokenizer,
    records: &[Record],
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Generation>> {
    let prompts: Vec<Vec<u32>> = records
        .iter()
        .map(|r| crate::eval::encode_prompt(tok, &prompt_of(r)))
        .collect::<Result<_, _>>()?;
    let gen = &s.cfg.on_policy.generation;
    Ok(generate(model, tok, &prompts, gen, rng)?)
}

/// One source's scored samples of a step.
struct ScoredGroup {
    source: Source,
    samples: Scored,
    /// `start = 0` rows (same tokenizer: prompt rows zero, never trained on).
    scores: Vec<SequenceScores>,
    /// Samples that could not be tokenized for the teacher (cross tokenizer).
    dropped: u64,
}

/// What a source's teacher is asked to score, by its pairing.
enum Scored {
    /// Same tokenizer: the student's own ids, asked with `starts` at their completions.
    Same {
        samples: Vec<Sample>,
        req: TopkRequest,
    },
    /// Different tokenizers (a teacher of another tokenizer, a chunk-level ensemble):
    /// prompt + completion text aligned for both sides, and the generations they came from.
    Cross { group: Group, used: Vec<usize> },
}

impl ScoredGroup {
    /// The group's loss units: sampled tokens for `sampled_kl` on one tokenizer, else the top-k
    /// losses' tokens or chunks.
    fn units(&self, s: &Setup) -> Units {
        match &self.samples {
            Scored::Same { samples, .. } if s.loss.kd.is_sampled() => Units {
                kd: samples
                    .iter()
                    .map(|x| (x.ids.len() - x.completion_from) as f64)
                    .sum(),
                ce: 0.0,
            },
            Scored::Same { samples, .. } => units(&same_items(s, samples)),
            Scored::Cross { group, .. } => units(&group.items),
        }
    }
}

/// Groups the generations by their prompt's source and scores every group at once.
fn score_samples(s: &Setup, records: &[Record], gens: &[Generation]) -> Result<Vec<ScoredGroup>> {
    let t = &s.teachers;
    let mut by: BTreeMap<Source, Vec<usize>> = BTreeMap::new();
    for (i, g) in gens.iter().enumerate() {
        let r = &records[g.prompt_index];
        let src = t
            .source_of(r)
            .map_err(|e| anyhow::anyhow!("record at line {} {e}", r.line))?;
        by.entry(src).or_default().push(i);
    }
    let mut jobs = vec![];
    for (source, idx) in by {
        if t.is_cross(source) {
            let (group, used) = cross_group(s, source, records, gens, &idx);
            let dropped = (idx.len() - used.len()) as u64;
            jobs.push((source, Scored::Cross { group, used }, dropped));
        } else {
            let samples = same_samples(idx.iter().map(|&i| &gens[i]));
            let include_prompt = s.cfg.on_policy.include_prompt;
            let starts = samples
                .iter()
                .map(|x| {
                    if include_prompt {
                        0
                    } else {
                        x.completion_from - 1
                    }
                })
                .collect();
            let seqs = samples.iter().map(|x| x.ids.clone()).collect();
            let req = t.request(source, seqs, Some(starts));
            jobs.push((source, Scored::Same { samples, req }, 0));
        }
    }
    // Every source at once: the step waits for the slowest teacher, not the sum.
    let answers = in_parallel(&jobs, |(source, job, _)| match job {
        Scored::Same { req, .. } => t.score(*source, req),
        Scored::Cross { group, .. } => t.score_group(group),
    })?;
    Ok(jobs
        .into_iter()
        .zip(answers)
        .map(|((source, samples, dropped), scores)| {
            let scores = match &samples {
                // Lay the rows out as a `start = 0` answer so the shared step code can be used.
                Scored::Same { req, .. } => (scores.into_iter().enumerate())
                    .map(|(i, sc)| pad_front(sc, req.start_of(i)))
                    .collect(),
                Scored::Cross { .. } => scores,
            };
            ScoredGroup {
                source,
                samples,
                scores,
                dropped,
            }
        })
        .collect())
}

/// Same tokenizer: the non-empty samples with the student's own ids.
fn same_samples<'a>(gens: impl Iterator<Item = &'a Generation>) -> Vec<Sample> {
    gens.filter(|g| !g.completion_ids.is_empty())
        .map(|g| {
            let mut ids = g.prompt_ids.clone();
            ids.extend_from_slice(&g.completion_ids);
            Sample {
                ids,
                completion_from: g.prompt_ids.len(),
                old_lp: g.sampled_logprobs.clone(),
            }
        })
        .collect()
}

/// Same tokenizer, a top-k loss: the samples as items (completion only unless `include_prompt`).
fn same_items(s: &Setup, samples: &[Sample]) -> Vec<Item> {
    let include_prompt = s.cfg.on_policy.include_prompt;
    samples
        .iter()
        .map(|x| {
            Item::Same(Encoded {
                ids: x.ids.clone(),
                loss_from: if include_prompt { 1 } else { x.completion_from },
            })
        })
        .collect()
}

/// Prepends `start` zero rows, turning a `start = st` answer into a `start = 0` one.
fn pad_front(sc: SequenceScores, start: usize) -> SequenceScores {
    if start == 0 {
        return sc;
    }
    let k = sc.k;
    let mut out = SequenceScores {
        rows: sc.rows + start,
        k,
        topk_ids: vec![0; start * k],
        topk_values: vec![0.0; start * k],
        target_logprobs: vec![0.0; start],
        logsumexp: vec![0.0; start],
        ..Default::default()
    };
    out.topk_ids.extend(sc.topk_ids);
    out.topk_values.extend(sc.topk_values);
    out.target_logprobs.extend(sc.target_logprobs);
    out.logsumexp.extend(sc.logsumexp);
    out
}

/// Validation on held-out prompts: samples with a fixed seed, teacher log-prob of the samples and
/// the reverse KL estimate (same tokenizer), or P-KL on the samples (when every teacher has a
/// different tokenizer).
fn validation_pass(
    s: &Setup,
    student: &Student,
    val: &[Record],
) -> Result<Option<(f64, SampleStats)>> {
    if val.is_empty() {
        return Ok(None);
    }
    let model = student.inference_model()?;
    let tok = s.student_tokenizer();
    let mut rng = ChaCha8Rng::seed_from_u64(s.cfg.distillation.seed ^ 0x5eed);
    let gens = sample(s, &model, tok, val, &mut rng)?;
    let mut st = SampleStats::default();
    gens.iter().for_each(|g| st.add_generation(g));
    let scored = score_samples(s, val, &gens)?;
    let mut pkl = ValSums::default();
    let mut any_same = false;
    for g in &scored {
        let refs: Vec<&SequenceScores> = g.scores.iter().collect();
        match &g.samples {
            Scored::Same { samples, .. } => {
                any_same = true;
                st.add_same(samples, &g.scores);
            }
            Scored::Cross { group, used } => {
                let items = &group.items;
                let k = answer_k(s, g.source, &g.scores);
                let lc = s.loss_ctx(g.source, k, student.model(), s.loss_of(g.source));
                if items.is_empty() {
                    continue;
                }
                if lc.pairing.scores_tokens() {
                    st.add_student_lps(used.iter().map(|&i| &gens[i]));
                    st.add_teacher_scores(items, &refs);
                }
                pkl += validation_sums(&lc, items, &refs)?;
            }
        }
    }
    if any_same {
        return Ok(Some((st.reverse_kl(), st)));
    }
    if pkl.kl_units == 0.0 {
        return Ok(Some((f64::NAN, st)));
    }
    Ok(Some((pkl.kl / pkl.kl_units, st)))
}

/// Different tokenizers: prompt + completion text of the generations `idx`, tokenized for
/// `source` (both sides of its teacher; a chunk-level ensemble: every teacher's), with the
/// indices of the generations they came from (empty or unusable ones are dropped).
fn cross_group(
    s: &Setup,
    source: Source,
    records: &[Record],
    gens: &[Generation],
    idx: &[usize],
) -> (Group, Vec<usize>) {
    let (texts, from): (Vec<Record>, Vec<usize>) = idx
        .iter()
        .map(|&i| (i, &gens[i]))
        .filter(|(_, g)| !g.completion_text.is_empty())
        .map(|(i, g)| {
            let r = Record {
                line: records[g.prompt_index].line,
                content: Content::Pair {
                    prompt: prompt_of(&records[g.prompt_index]),
                    // The stop string is part of the sample: scored, so stopping is learned.
                    completion: format!(
                        "{}{}",
                        g.completion_text,
                        g.matched_stop.as_deref().unwrap_or("")
                    ),
                },
                completion_only_loss: !s.cfg.on_policy.include_prompt,
                teacher: records[g.prompt_index].teacher.clone(),
            };
            (r, i)
        })
        .unzip();
    // Rollouts are not dataset records: one over the limits is truncated, not skipped.
    let lim = super::prepare::Limits {
        truncate: true,
        ..s.teachers.limits(source)
    };
    let refs: Vec<&Record> = texts.iter().collect();
    let (group, used) = s.teachers.prepare_group(source, &refs, lim);
    let used = used.into_iter().map(|u| from[u]).collect();
    (group, used)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ActivationCheckpointing;
    use crate::loss::CeConfig;
    use crate::train::head::HeadOpts;
    use crate::train::pairing::sampled::sampled_loss;
    use crate::train::pairing::Pairing;
    use crate::train::step::LossCtx;
    use crate::train::testutil::{answer, assert_rel, assert_same_grads, ids, tiny, V};
    use candle_core::{DType, Device};

    /// The chunked sampled-token gradients ([`sampled_grads`]) equal the unchunked loss's
    /// (`sampled_loss` + `backward`) for every parameter: 1- and 3-row chunks and the budget,
    /// kept and checkpointed activations, tied and untied heads; f64 to 1e-9, f32 to 1e-5.
    #[test]
    fn sampled_chunks_equal_the_whole_loss() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut samples = vec![];
        let mut scores = vec![];
        for (len, from) in [(10, 4), (7, 2), (12, 6)] {
            samples.push(Sample {
                ids: ids(&mut rng, len),
                completion_from: from,
                old_lp: vec![],
            });
            scores.push(answer(&mut rng, len - 1, 1, V));
        }
        let refs: Vec<&SequenceScores> = scores.iter().collect();
        let loss = LossConfig {
            kd: KdConfig::SampledKl {},
            tail: None,
            temperature: 0.8,
            kd_weight: 0.6,
            ce: CeConfig::None {},
        };
        for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 1e-5)] {
            for tied in [false, true] {
                let (model, vm) = tiny(tied, dtype, 9);
                let mut ctx = LossCtx {
                    model: &model,
                    k: 1,
                    loss: &loss,
                    pairing: Pairing::Same,
                    device: &Device::Cpu,
                    micro_batch: 3,
                    head: HeadOpts::default(),
                };
                let (l, want) = sampled_loss(&ctx, &samples, &refs, 40.0).unwrap();
                let want_grads = l.backward().unwrap();
                for activations in [ActivationCheckpointing::Off, ActivationCheckpointing::On] {
                    for chunk_rows in [1, 3, 0] {
                        ctx.head = HeadOpts {
                            activations,
                            chunk_rows,
                        };
                        let case = format!("{dtype:?} tied {tied} {:?}", ctx.head);
                        let (g, got) = sampled_grads(&ctx, &samples, &refs, 40.0).unwrap();
                        assert_rel(got, want, tol, &case);
                        assert_same_grads(&vm, &g, &want_grads, tol, &case);
                    }
                }
            }
        }
    }
}
