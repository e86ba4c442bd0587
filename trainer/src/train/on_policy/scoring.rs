//! Scoring a step's samples: grouped by their prompt's source, each group asked as its pairing
//! needs (same tokenizer: the student's ids with `starts` at the completion; otherwise the
//! aligned text), every group awaited together on the teacher pool. A teacher on the hidden-state
//! transport answers hidden states; the teacher's log-prob of each sampled token (the sample
//! figures' input) is then computed here from them and the head the trainer holds.

use super::rollout::{prompt_of, same_items, same_samples};
use crate::client::join_in_order;
use crate::data::{Content, Record};
use crate::generate::Generation;
use crate::loss::Temperature;
use crate::train::distill::Setup;
use crate::train::micro::Units;
use crate::train::pairing::cross::trained_teacher_rows;
use crate::train::pairing::full_vocab::target_logprobs_from_hidden;
use crate::train::pairing::sampled::Sample;
use crate::train::pairing::units;
use crate::train::pairing::Limits;
use crate::train::prepare::prepare_group;
use crate::train::teachers::Group;
use crate::train::teachers::Source;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use xdistill_shared::protocol::{SequenceScores, TopkRequest};

/// One source's scored samples of a step.
pub(super) struct ScoredGroup {
    pub(super) source: Source,
    pub(super) samples: Scored,
    /// `start = 0` rows (same tokenizer: prompt rows zero, never trained on).
    pub(super) scores: Vec<SequenceScores>,
    /// Samples that could not be tokenized for the teacher (cross tokenizer).
    pub(super) dropped: u64,
}

/// What a source's teacher is asked to score, by its pairing.
pub(super) enum Scored {
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
    pub(super) fn units(&self, s: &Setup) -> Units {
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
pub(super) fn score_samples(
    s: &Setup,
    records: &[Record],
    gens: &[Generation],
) -> Result<Vec<ScoredGroup>> {
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
    let answers = t.pool().block_on(join_in_order(jobs.iter().map(
        |(source, job, _)| async move {
            match job {
                Scored::Same { req, .. } => t.score_async(*source, req).await,
                Scored::Cross { group, .. } => t.score_group_async(group).await,
            }
        },
    )))?;
    let mut groups = vec![];
    for ((source, samples, dropped), scores) in jobs.into_iter().zip(answers) {
        let mut scores = match &samples {
            // Lay the rows out as a `start = 0` answer so the shared step code can be used.
            Scored::Same { req, .. } => (scores.into_iter().enumerate())
                .map(|(i, sc)| pad_front(sc, req.start_of(i)))
                .collect(),
            Scored::Cross { .. } => scores,
        };
        if t.of(source).head.is_some() {
            sample_logprobs_from_hidden(s, source, &samples, &mut scores)?;
        }
        groups.push(ScoredGroup {
            source,
            samples,
            scores,
            dropped,
        });
    }
    Ok(groups)
}

/// Prepends `start` zero rows, turning a `start = st` answer into a `start = 0` one (hidden
/// states too: `start` rows of zeros).
fn pad_front(sc: SequenceScores, start: usize) -> SequenceScores {
    if start == 0 {
        return sc;
    }
    let k = sc.k;
    let row_bytes = sc.hidden.len().checked_div(sc.rows).unwrap_or(0);
    let mut out = SequenceScores {
        rows: sc.rows + start,
        k,
        topk_ids: vec![0; start * k],
        topk_values: vec![0.0; start * k],
        target_logprobs: vec![0.0; start],
        logsumexp: vec![0.0; start],
        hidden: vec![0; start * row_bytes],
        ..Default::default()
    };
    out.topk_ids.extend(sc.topk_ids);
    out.topk_values.extend(sc.topk_values);
    out.target_logprobs.extend(sc.target_logprobs);
    out.logsumexp.extend(sc.logsumexp);
    out.hidden.extend(sc.hidden);
    out
}

/// Hidden-state transport: fills each answer's `target_logprobs` (what the top-k transport
/// sends) at the rows the sample figures read, from the hidden states and the teacher's head at
/// the teacher's temperature: every completion token (same tokenizer), every trained teacher
/// row (across tokenizers). Other rows stay 0. One head pass over the group's scored rows, on
/// the student's device.
fn sample_logprobs_from_hidden(
    s: &Setup,
    source: Source,
    samples: &Scored,
    scores: &mut [SequenceScores],
) -> Result<()> {
    let teacher = s.teachers.of(source);
    let Some(head) = teacher.head.as_ref() else {
        return Ok(());
    };
    // (answer, row, target) of every row to score.
    let mut want: Vec<(usize, usize, u32)> = vec![];
    match samples {
        Scored::Same { samples, .. } => {
            for (i, x) in samples.iter().enumerate() {
                want.extend((x.completion_from - 1..x.ids.len() - 1).map(|p| (i, p, x.ids[p + 1])));
            }
        }
        Scored::Cross { group, .. } => {
            for (i, it) in group.items.iter().enumerate() {
                if let Some((pair, loss_start)) = it.aligned() {
                    let ids = &pair.teacher_ids;
                    want.extend(trained_teacher_rows(pair, loss_start).map(|p| (i, p, ids[p + 1])));
                }
            }
        }
    }
    let refs: Vec<&SequenceScores> = scores.iter().collect();
    let temperature = Temperature::new(f64::from(teacher.cfg.temperature))?;
    let filled = target_logprobs_from_hidden(head, temperature, &s.device, &refs, &want)
        .with_context(|| format!("teacher {:?}", teacher.name))?;
    for (sc, t) in scores.iter_mut().zip(filled) {
        sc.target_logprobs = t;
    }
    Ok(())
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
    let lim = Limits {
        truncate: true,
        ..s.teachers.limits(source)
    };
    let refs: Vec<&Record> = texts.iter().collect();
    let (group, used) = prepare_group(&s.teachers, source, &refs, lim);
    let used = used.into_iter().map(|u| from[u]).collect();
    (group, used)
}
