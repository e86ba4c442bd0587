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
//! - `teacher.transport = "hidden"`: the samples are scored by hidden states, and the loss is the
//!   exact divergence over the teacher's whole distribution (`reverse_kl`, the on-policy
//!   objective, or `forward_kl`/`jsd`; across tokenizers `first_kl`/`pkl`); the teacher's
//!   log-probs of the sampled tokens, for the sample figures, come from its head (`scoring`).
//! - `[on_policy] lambda`: the share of steps that sample; the others train off-policy on the
//!   data's own prompt + completion, so one run can mix both (TRL GKD's λ).
//!
//! Files: `rollout` (prompts, sampling, samples as items), `scoring` (each source's samples
//! scored together on the teacher pool), `loss` (the on- and off-policy step paths), `stats`
//! (figures of the samples), `validation` (the held-out pass).

mod loss;
mod rollout;
mod scoring;
mod stats;
mod validation;

use super::distill::{distill_filter, finish_teacher_parts, Setup, Summary};
use super::runner::{
    self, Objective, RecordFilter, RunOptions, StepCtx, StepReport, Steps, ValReport,
};
use crate::config::{DistillArgs, ObjectiveKind};
use crate::data::Record;
use crate::dist::StepShards;
use crate::loss::LossConfig;
use crate::student::Student;
use anyhow::{bail, Result};
use loss::off_policy_loss;
use rand::Rng;
use std::collections::BTreeMap;
use validation::validation_pass;

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
    /// Checks the on-policy settings (`lambda`, generation, prompts-only data) for a run.
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
}

impl Objective for OnPolicy<'_> {
    type Input = StepShards;

    fn open(&mut self, _: &Student) -> Result<Option<RecordFilter<'_>>> {
        Ok(distill_filter(self.s))
    }

    fn feed(&mut self, steps: Steps) -> Box<dyn Iterator<Item = Result<StepShards>>> {
        Box::new(steps.map(Ok))
    }

    fn step(&mut self, ctx: &mut StepCtx, step: StepShards) -> Result<StepReport> {
        let op = &self.s.cfg.on_policy;
        // The run's RNG is the same on every rank: so is the draw.
        let on = op.lambda >= 1.0 || ctx.rng.random::<f64>() < op.lambda;
        let mut r = StepReport {
            epoch: step.epoch(),
            next: step.next,
            ..Default::default()
        };
        if on {
            self.on_step(ctx, &step, &mut r)?;
        } else {
            self.off_step(ctx, &step, &mut r)?;
        }
        finish_teacher_parts(&mut r.loss_parts);
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
