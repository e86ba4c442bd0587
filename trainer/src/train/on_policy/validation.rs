//! The on-policy validation pass: the student samples the held-out prompts with a fixed seed,
//! and the teachers score the samples.

use super::rollout::sample;
use super::scoring::{score_samples, Scored};
use super::stats::SampleStats;
use crate::data::Record;
use crate::student::Student;
use crate::train::distill::{answer_k, Setup};
use crate::train::micro::ValSums;
use crate::train::step::validation_sums;
use anyhow::Result;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use xdistill_shared::protocol::SequenceScores;

/// Validation on held-out prompts: samples with a fixed seed, teacher log-prob of the samples and
/// the reverse KL estimate (same tokenizer), or P-KL on the samples (when every teacher has a
/// different tokenizer).
pub(super) fn validation_pass(
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
