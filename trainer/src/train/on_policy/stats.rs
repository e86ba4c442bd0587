//! Figures of the student's samples in a step or a validation pass: the teacher's and the
//! student's log-probs of them (and the reverse-KL estimate from both), completion length and
//! the share that ended at EOS.

use crate::generate::Generation;
use crate::train::pairing::cross::trained_teacher_rows;
use crate::train::pairing::sampled::Sample;
use crate::train::pairing::Item;
use std::collections::BTreeMap;
use xdistill_shared::protocol::SequenceScores;

/// Figures of the samples of one step or one validation pass.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SampleStats {
    /// Sum of the teacher's log-probs of the sampled text, over `tokens` teacher tokens.
    teacher_lp: f64,
    /// Sum of the student's log-probs of its samples, over `student_tokens` student tokens
    /// (the two counts differ across tokenizers).
    student_lp: f64,
    pub(super) tokens: f64,
    student_tokens: f64,
    pub(super) completions: usize,
    pub(super) eos: usize,
    completion_tokens: usize,
}

impl SampleStats {
    pub(super) fn add_generation(&mut self, g: &Generation) {
        self.completions += 1;
        self.eos += g.hit_eos as usize;
        self.completion_tokens += g.completion_ids.len();
    }
    pub(super) fn mean_teacher_lp(&self) -> f64 {
        self.teacher_lp / self.tokens.max(1.0)
    }
    pub(super) fn mean_student_lp(&self) -> f64 {
        self.student_lp / self.student_tokens.max(1.0)
    }
    /// Same tokenizer: both sides' log-probs of each completion token.
    pub(super) fn add_same(&mut self, samples: &[Sample], scores: &[SequenceScores]) {
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
    pub(super) fn add_teacher_scores(&mut self, items: &[Item], scores: &[&SequenceScores]) {
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
    pub(super) fn add_student_lps<'a>(&mut self, gens: impl IntoIterator<Item = &'a Generation>) {
        for g in gens {
            self.student_lp += g.sampled_logprobs.iter().map(|&x| x as f64).sum::<f64>();
            self.student_tokens += g.sampled_logprobs.len() as f64;
        }
    }
    /// Monte-Carlo reverse KL per student token, `(Σ lp_S − Σ lp_T) / student tokens` over the
    /// scored samples: the mean of `lp_S − lp_T` per sampled token with one tokenizer; across
    /// tokenizers each side sums its own tokens of the same text, so the difference is the
    /// sequence-level `log p_S(text) − log p_T(text)`.
    pub(super) fn reverse_kl(&self) -> f64 {
        (self.student_lp - self.teacher_lp) / self.student_tokens.max(1.0)
    }
    /// The figures as metrics; the log-prob comparisons only when some teacher scored tokens
    /// (a chunk-level ensemble has no per-token log-probs).
    pub(super) fn into_parts(self, parts: &mut BTreeMap<String, f64>) {
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
