//! The loss paths of a step: the student's own samples (the sampled-token loss, or a top-k loss
//! on them; cross-tokenizer samples through their alignment), and the off-policy steps of a
//! mixed run (`lambda < 1`) on the data's own prompt + completion.

use super::rollout::{same_items, sample};
use super::scoring::{score_samples, Scored, ScoredGroup};
use super::stats::SampleStats;
use super::OnPolicy;
use crate::dist::StepShards;
use crate::generate::Generation;
use crate::loss::{KdConfig, LossConfig};
use crate::train::distill::{answer_k, teacher_parts, GroupLoss, TeacherFigures};
use crate::train::micro::Units;
use crate::train::pairing::sampled::sampled_grads;
use crate::train::prepare::prepare;
use crate::train::runner::{StepCtx, StepReport};
use crate::train::step::accumulate;
use anyhow::Result;
use std::time::Instant;
use xdistill_shared::protocol::SequenceScores;

impl OnPolicy<'_> {
    /// Samples completions of this rank's shards' prompts, scores them (each prompt's samples
    /// by its teacher) and accumulates the loss shard by shard.
    ///
    /// Every row's sampler is seeded from the run's RNG by the row's place in the *global*
    /// batch (the RNG's word position: one `u64` per row, in row order), so the samples, and
    /// the RNG after the step, are the same whatever the number of processes.
    pub(super) fn on_step(
        &self,
        ctx: &mut StepCtx,
        step: &StepShards,
        r: &mut StepReport,
    ) -> Result<()> {
        let s = self.s;
        let mut stats = SampleStats::default();
        let per_prompt = s.cfg.on_policy.generation.num_generations as u128;
        let base = ctx.rng.get_word_pos();
        // 1. Sample with the current weights (fused kernels, same vars), and score: each shard
        // on its own, so the batches (and their numerics) do not depend on the process count.
        let model = ctx.student.inference_model()?;
        let (mut gen_s, mut score_s) = (0.0, 0.0);
        let mut shards = Vec::with_capacity(step.shards.len());
        for shard in &step.shards {
            let t0 = Instant::now();
            let mut rng = ctx.rng.clone();
            rng.set_word_pos(base + 2 * per_prompt * shard.offset as u128);
            let gens = sample(s, &model, &self.tok, &shard.records, &mut rng)?;
            gen_s += t0.elapsed().as_secs_f64();
            gens.iter().for_each(|g| stats.add_generation(g));
            let t1 = Instant::now();
            let scored = score_samples(s, &shard.records, &gens)?;
            score_s += t1.elapsed().as_secs_f64();
            shards.push((gens, scored));
        }
        ctx.rng
            .set_word_pos(base + 2 * per_prompt * step.len as u128);
        r.teacher_latency_s = score_s;
        // 2. The step's units over every source, shard and rank.
        let mut norm = Units::default();
        for (_, scored) in &shards {
            for g in scored {
                norm += g.units(s);
            }
        }
        let mut v = [norm.kd, norm.ce];
        ctx.sum(&mut v)?;
        let norm = Units { kd: v[0], ce: v[1] };
        // 3. Each shard's sources' losses, then the shard's leaf.
        let mut kd_sum = 0.0;
        for (gens, scored) in &shards {
            for g in scored {
                kd_sum += self.source_loss(ctx, g, gens, norm, &mut stats, r)?;
            }
            r.skipped += scored.iter().map(|g| g.dropped).sum::<u64>();
            ctx.acc.end_shard()?;
        }
        stats.into_parts(&mut r.loss_parts);
        r.loss_parts.insert("generation_s".into(), gen_s);
        r.kl = (stats.tokens > 0.0).then(|| stats.reverse_kl());
        self.finish(ctx, r, kd_sum, norm)
    }

    /// One source's samples of a shard: their loss into `ctx.acc`; returns Σ KD × units.
    fn source_loss(
        &self,
        ctx: &mut StepCtx,
        g: &ScoredGroup,
        gens: &[Generation],
        norm: Units,
        stats: &mut SampleStats,
        r: &mut StepReport,
    ) -> Result<f64> {
        let (s, mb) = (self.s, self.s.cfg.policy.train_micro_batch_size.max(1));
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
                        let (g, v) =
                            sampled_grads(&lc, xs, sc, norm.kd.max(1.0), Some(&mut *ctx.acc))?;
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
            kd_sum: sum,
            kd_units: u.kd,
            temperature: loss.temperature.get(),
            sequences,
            tokens,
        };
        teacher_parts(s, source, f, &mut r.loss_parts);
        r.tokens += tokens as u64;
        Ok(sum)
    }

    /// An off-policy step on the data's own prompt + completion.
    pub(super) fn off_step(
        &self,
        ctx: &mut StepCtx,
        step: &StepShards,
        r: &mut StepReport,
    ) -> Result<()> {
        let s = self.s;
        let prepared: Vec<_> = step
            .batches()
            .into_iter()
            .map(|b| prepare(b, &s.teachers))
            .collect();
        r.skipped += prepared.iter().map(|p| p.skipped).sum::<u64>();
        let t1 = Instant::now();
        let groups: Vec<_> = prepared.iter().flat_map(|p| &p.groups).collect();
        let mut answers = s.teachers.score_all(&groups)?.into_iter();
        r.teacher_latency_s = t1.elapsed().as_secs_f64();
        let answers: Vec<Vec<_>> = prepared
            .iter()
            .map(|p| answers.by_ref().take(p.groups.len()).collect())
            .collect();
        let shard_groups: Vec<Vec<_>> = prepared
            .iter()
            .zip(&answers)
            .map(|(p, a)| {
                p.groups
                    .iter()
                    .zip(a)
                    .map(|(g, a)| (g.source, g.items.as_slice(), a.as_slice()))
                    .collect()
            })
            .collect();
        r.tokens = prepared
            .iter()
            .flat_map(|p| p.items())
            .map(|i| i.teacher_ids().len() as u64)
            .sum();
        let gl = GroupLoss {
            s,
            same: &self.off_same,
            cross: &self.off_cross,
        };
        let norm = gl.global_units(ctx, shard_groups.iter().flatten())?;
        let mut kd_sum = 0.0;
        for groups in &shard_groups {
            let sums = gl.accumulate(
                ctx.student.model(),
                ctx.acc,
                groups,
                norm,
                &mut r.loss_parts,
            )?;
            kd_sum += sums.kd_sum;
            ctx.acc.end_shard()?;
        }
        self.finish(ctx, r, kd_sum, norm)
    }

    /// The step's loss figures from this rank's summed KD and the global units; the sums,
    /// token and skip counts become the global ones.
    fn finish(
        &self,
        ctx: &mut StepCtx,
        r: &mut StepReport,
        kd_sum: f64,
        norm: Units,
    ) -> Result<()> {
        let mut v = [kd_sum, r.tokens as f64, r.skipped as f64];
        ctx.sum(&mut v)?;
        let [kd_sum, tokens, skipped] = v;
        r.tokens = tokens as u64;
        r.skipped = skipped as u64;
        let kd_mean = kd_sum / norm.kd.max(1.0);
        r.loss_parts.insert("scoring_s".into(), r.teacher_latency_s);
        r.loss_parts.insert("kd".into(), kd_mean);
        r.loss = kd_mean;
        r.loss_tokens = norm.ce.max(norm.kd) as u64;
        r.teacher_wait_s = r.teacher_latency_s;
        Ok(())
    }
}

/// The loss for off-policy steps of a mixed run: `[loss]` itself, or, when `[loss]` is the
/// sampled-token loss (which needs samples), forward KL over the top-k (same tail and
/// temperature), or `first_kl` across tokenizers.
pub(super) fn off_policy_loss(l: &LossConfig, cross: bool) -> LossConfig {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ActivationCheckpointing;
    use crate::loss::CeConfig;
    use crate::train::head_chunks::HeadOpts;
    use crate::train::pairing::sampled::{sampled_loss, Sample};
    use crate::train::pairing::LossCtx;
    use crate::train::pairing::Pairing;
    use crate::train::testutil::{answer, assert_rel, assert_same_grads, ids, tiny, V};
    use candle_core::{DType, Device};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// The chunked sampled-token gradients ([`sampled_grads`]) equal the unchunked loss's
    /// (`sampled_loss` + `backward`) for every parameter: 1- and 3-row chunks and the budget,
    /// kept and checkpointed activations, tied and untied heads; f64 to 1e-9, f32 to 1e-5.
    #[test]
    fn sampled_chunks_equal_the_whole_loss() {
        check_sampled_chunks();
    }

    /// The same with the fused kernels forced on in this thread (the CPU runs their f64
    /// reference): each head chunk by hand (`loss::fused_head`: the rows' cross-entropy at the
    /// sampled tokens from one kernel pass, the gradient weighted by each row's advantage
    /// written over the logits, the head's gradient summed in place), against the unchunked
    /// loss through autograd and the same kernels.
    #[test]
    fn sampled_chunks_by_hand_equal_the_whole_loss() {
        use xdistill_shared::model::device_ops;
        device_ops::force_in_this_thread(Some(true));
        let probe = candle_core::Tensor::zeros((1, V), DType::F32, &Device::Cpu).unwrap();
        assert!(xdistill_kernels::TopkKd::runs_on(&probe));
        check_sampled_chunks();
        device_ops::force_in_this_thread(None);
    }

    fn check_sampled_chunks() {
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
            temperature: crate::loss::Temperature::new(0.8).expect("0.8 is a temperature"),
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
                        let (g, got) = sampled_grads(&ctx, &samples, &refs, 40.0, None).unwrap();
                        assert_rel(got, want, tol, &case);
                        assert_same_grads(&vm, &g, &want_grads, tol, &case);
                    }
                }
            }
        }
    }
}
