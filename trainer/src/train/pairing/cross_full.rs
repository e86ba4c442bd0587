//! Another tokenizer with the teacher's **whole** distribution (`teacher.transport = "hidden"`,
//! `kd = first_kl`, `pkl`, `gold` or `alm`): records are aligned as in [`super::cross`], the
//! teacher sends its hidden states, and at each aligned chunk the teacher's full log-softmax at
//! the chunk's anchor (its head applied on the student's device) is compared with the student's:
//! grouped by first student token ([`crate::loss::xtoken_full::first_kl_full`]), against the
//! chunk's projected student distribution over every teacher id
//! ([`crate::loss::xtoken_full::pkl_full`]), or by gold's exact-pair KL and whole-distribution
//! ULD ([`crate::loss::xtoken_full::gold_full`]). No top-k set. The LM head runs in the same
//! alignment-chunk pieces as [`super::cross`] ([`crate::train::xpieces`]); validation reports
//! the run's own divergence, exactly (P-KL over every teacher id for gold). ALM needs only the
//! teacher's log-probs of its own tokens: they are computed from the hidden states and the head,
//! and [`super::cross`]'s ALM runs on them (validation: P-KL over every teacher id).

use super::cross::{xtoken_batch, Cross, CrossPieces};
use super::full_vocab::{hidden_row, target_logprobs_from_hidden};
use super::{finish, wants_ce, Collation, Item};
use crate::collate::pad_batch;
use crate::loss::full_vocab::{teacher_log_softmax_chunk, TeacherHead};
use crate::loss::xtoken::gold_matched;
use crate::loss::xtoken_full::{first_kl_full, gold_full, pkl_full};
use crate::loss::{
    compute_dtype, cross_entropy, CeConfig, KdConfig, KdMetrics, LossConfig, Normalizer,
    Projection, TailMode, XTokenBatch,
};
use crate::train::head::{self, ChunkLoss, HeadSums, Mix};
use crate::train::step::{LossCtx, MicroOut, Units, ValSums};
use crate::train::xpieces::XPiece;
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use xdistill_shared::protocol::SequenceScores;

/// The cross-tokenizer pairing over the teacher's head.
pub struct CrossFullVocab<'a> {
    pub projection: &'a Projection,
    pub head: &'a TeacherHead,
}

/// One aligned chunk of a (sub-)batch: its row, its student positions (in order) and its first
/// and last teacher positions.
#[derive(Debug, Clone)]
struct Anchor {
    row: usize,
    student: Vec<usize>,
    teacher: (usize, usize),
}

/// The chunks of `x` with both sides non-empty, in row and chunk order.
fn anchors(x: &XTokenBatch) -> Vec<Anchor> {
    let (ts, tt) = (x.student_len, x.teacher_len);
    let mut out = vec![];
    for row in 0..x.batch {
        let n = x.num_chunks[row];
        let mut student: Vec<Vec<usize>> = vec![vec![]; n];
        let mut teacher: Vec<Option<(usize, usize)>> = vec![None; n];
        for p in 0..ts {
            if let Ok(c) = usize::try_from(x.student_chunk[row * ts + p]) {
                student[c].push(p);
            }
        }
        for p in 0..tt {
            if let Ok(c) = usize::try_from(x.teacher_chunk[row * tt + p]) {
                let e = teacher[c].get_or_insert((p, p));
                e.1 = p;
            }
        }
        for (s, t) in student.into_iter().zip(teacher) {
            if let (false, Some(teacher)) = (s.is_empty(), t) {
                out.push(Anchor {
                    row,
                    student: s,
                    teacher,
                });
            }
        }
    }
    out
}

/// Gold's matched flag of each chunk ([`gold_matched`]): one position on each side, the student's
/// target mapping exactly to the teacher's.
fn gold_flags(x: &XTokenBatch, chunks: &[Anchor], proj: &Projection) -> Vec<bool> {
    let (ts, tt) = (x.student_len, x.teacher_len);
    chunks
        .iter()
        .map(|c| {
            let one_to_one = c.student.len() == 1 && c.teacher.0 == c.teacher.1;
            let s = x.student_targets[c.row * ts + c.student[0]];
            let u = x.teacher_targets[c.row * tt + c.teacher.0];
            gold_matched(proj, one_to_one, s, u)
        })
        .collect()
}

impl CrossFullVocab<'_> {
    /// The run's cross-tokenizer loss (`first_kl`, P-KL or gold) of `logits [nb, sl, V]` (the
    /// rows of `x`) against the teacher's whole distribution at each chunk's anchor;
    /// `origin(row, p)` maps a teacher position of `x` to its (batch row, position) in `scores`.
    fn kd(
        &self,
        ctx: &LossCtx,
        x: &XTokenBatch,
        logits: &Tensor,
        scores: &[&SequenceScores],
        origin: &dyn Fn(usize, usize) -> (usize, usize),
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdMetrics)> {
        let chunks = anchors(x);
        let (nb, sl, v) = logits.dims3()?;
        let tau = ctx.loss.temperature;
        // The student rows each loss reads, and (P-KL) the chunk of each.
        let (rows, chunk_of_row): (Vec<u32>, Vec<u32>) = match ctx.loss.kd {
            KdConfig::Pkl { .. } => chunks
                .iter()
                .enumerate()
                .flat_map(|(i, c)| {
                    c.student
                        .iter()
                        .map(move |&p| ((c.row * sl + p) as u32, i as u32))
                })
                .unzip(),
            _ => chunks
                .iter()
                .map(|c| ((c.row * sl + c.student[0]) as u32, 0))
                .unzip(),
        };
        let at = |c: &Anchor| match ctx.loss.kd {
            KdConfig::Pkl {
                anchor: crate::loss::Anchor::Last,
            } => c.teacher.1,
            _ => c.teacher.0,
        };
        let teacher = self.teacher_log_probs(ctx, logits, &chunks, scores, origin, at)?;
        let n = rows.len();
        let student = logits
            .reshape((nb * sl, v))?
            .index_select(&Tensor::from_vec(rows, n, ctx.device)?, 0)?; // [N, V]
        Ok(match ctx.loss.kd {
            KdConfig::Pkl { .. } => pkl_full(
                &student,
                &chunk_of_row,
                &teacher,
                self.projection,
                ctx.loss.tail.unwrap_or(TailMode::Renormalize),
                tau,
                normalizer,
            )?,
            KdConfig::Gold {
                matched_weight,
                unmatched_weight,
            } => {
                let matched = gold_flags(x, &chunks, self.projection);
                gold_full(
                    &student,
                    &teacher,
                    &matched,
                    self.projection,
                    matched_weight,
                    unmatched_weight,
                    tau,
                    normalizer,
                )?
            }
            _ => first_kl_full(&student, &teacher, self.projection, tau, normalizer)?,
        })
    }

    /// The teacher's log-probs `[C, V_t]` at each chunk's anchor teacher position `at(c)`, its
    /// head applied to the hidden states there, in the loss's dtype (f64 for the checks).
    fn teacher_log_probs(
        &self,
        ctx: &LossCtx,
        logits: &Tensor,
        chunks: &[Anchor],
        scores: &[&SequenceScores],
        origin: &dyn Fn(usize, usize) -> (usize, usize),
        at: impl Fn(&Anchor) -> usize,
    ) -> Result<Tensor> {
        let hsz = self.head.hidden_size();
        let mut hid = Vec::with_capacity(chunks.len() * hsz);
        for c in chunks {
            let (r, p) = origin(c.row, at(c));
            hid.extend(hidden_row(scores[r], r, p, hsz)?);
        }
        let n = chunks.len();
        if n == 0 {
            return Ok(Tensor::zeros(
                (0, self.head.vocab()),
                compute_dtype(logits),
                ctx.device,
            )?);
        }
        let hidden =
            Tensor::from_vec(hid, (n, hsz), ctx.device)?.to_dtype(compute_dtype(logits))?;
        Ok(teacher_log_softmax_chunk(
            self.head,
            &hidden,
            ctx.loss.temperature,
        )?)
    }

    /// Every chunk loss works over the whole distribution; the sampled-token loss does not.
    fn check(&self, ctx: &LossCtx) -> Result<()> {
        if !ctx.loss.kd.is_cross_tokenizer() {
            bail!(
                "teacher.transport = \"hidden\" across tokenizers trains with first_kl, pkl, \
                 gold or alm, not {:?}",
                ctx.loss.kd
            );
        }
        Ok(())
    }

    /// ALM reads only the teacher's log-probs of its own next tokens: runs `f`, the top-k
    /// pairing's ALM, on answers carrying them, computed from the hidden states and the head
    /// (what the top-k transport sends as `target_logprobs`).
    fn via_alm<T>(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        f: impl FnOnce(&Cross, &LossCtx, &[&SequenceScores]) -> Result<T>,
    ) -> Result<T> {
        let answers = self.alm_answers(ctx, items, scores)?;
        let refs: Vec<&SequenceScores> = answers.iter().collect();
        f(
            &Cross::new(self.projection),
            &LossCtx { k: 0, ..*ctx },
            &refs,
        )
    }

    /// The answers [`Self::via_alm`] runs on: each row's log-prob of the next teacher token.
    fn alm_answers(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<Vec<SequenceScores>> {
        let mut want = vec![];
        for (r, (it, sc)) in items.iter().zip(scores).enumerate() {
            let ids = it.teacher_ids();
            let rows = sc.rows.min(ids.len().saturating_sub(1));
            want.extend((0..rows).map(|p| (r, p, ids[p + 1])));
        }
        let filled = target_logprobs_from_hidden(
            self.head,
            ctx.loss.temperature,
            ctx.device,
            scores,
            &want,
        )?;
        Ok(scores
            .iter()
            .zip(filled)
            .map(|(sc, target_logprobs)| SequenceScores {
                rows: sc.rows,
                k: 0,
                logsumexp: vec![0.0; sc.rows],
                target_logprobs,
                ..Default::default()
            })
            .collect())
    }
}

fn is_alm(loss: &LossConfig) -> bool {
    matches!(loss.kd, KdConfig::Alm { .. })
}

/// What validation measures for a run's loss: the loss itself (first_kl, P-KL), or for ALM and
/// gold (a chunk likelihood and a KL/L1 hybrid, neither a divergence) P-KL over the teacher's
/// whole distribution, the figure the top-k pairing reports across tokenizers.
fn validation_loss(loss: &LossConfig) -> Option<LossConfig> {
    let divergence = matches!(loss.kd, KdConfig::FirstKl {} | KdConfig::Pkl { .. });
    (!divergence).then(|| LossConfig {
        kd: KdConfig::Pkl {
            anchor: Default::default(),
        },
        tail: None,
        temperature: loss.temperature,
        kd_weight: 1.0,
        ce: CeConfig::None {},
    })
}

/// A piece's teacher position `p` of segment `i` in the whole batch.
fn piece_origin(piece: &XPiece) -> impl Fn(usize, usize) -> (usize, usize) + '_ {
    move |i, p| {
        let seg = &piece.segments[i];
        (seg.row, seg.teacher.start + p)
    }
}

impl Collation for CrossFullVocab<'_> {
    fn loss(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(Tensor, MicroOut)> {
        self.check(ctx)?;
        if is_alm(ctx.loss) {
            return self.via_alm(ctx, items, scores, |c, ctx, refs| {
                c.loss(ctx, items, refs, norm)
            });
        }
        let (xb, enc) = xtoken_batch(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, ctx.device)?;
        let logits = ctx.model.forward(&tb.ids)?; // [B, Ts, V]
        let kd = self.kd(
            ctx,
            &xb,
            &logits,
            scores,
            &|r, p| (r, p),
            Some(norm.kd_normalizer()?),
        )?;
        let ce = wants_ce(ctx.loss).then(|| (tb.targets.clone(), tb.mask.clone(), tb.n_targets));
        finish(ctx.loss, &logits, kd, ce, norm)
    }

    fn grads(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(GradStore, HeadSums)> {
        self.check(ctx)?;
        if is_alm(ctx.loss) {
            return self.via_alm(ctx, items, scores, |c, ctx, refs| {
                c.grads(ctx, items, refs, norm)
            });
        }
        let (model, device) = (ctx.model, ctx.device);
        let ce_on = wants_ce(ctx.loss);
        let cp = CrossPieces::new(ctx, items, scores, 0, ce_on)?;
        let pass = ctx.head.forward(model, &cp.tb.ids)?;
        let loss = |i: usize, logits: &Tensor| -> Result<ChunkLoss> {
            let origin = piece_origin(&cp.plan[i]);
            let kd = self.kd(
                ctx,
                &cp.batch(i),
                logits,
                scores,
                &origin,
                Some(norm.kd_normalizer()?),
            )?;
            let (tg, m, n) = cp.ce_inputs(i, device)?;
            let ce = if ce_on && n > 0 {
                Some(cross_entropy(logits, &tg, &m, Some(norm.ce_normalizer()?))?)
            } else {
                None
            };
            Ok(ChunkLoss { kd: Some(kd), ce })
        };
        let out = head::run(model, pass.hidden(), &cp.pieces, Mix::of(ctx.loss), loss)?;
        out.finish(pass)
    }

    /// The run's divergence over the teacher's whole distribution (P-KL for ALM and gold; τ²
    /// removed), and the student's CE.
    fn validation(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums> {
        let measured = validation_loss(ctx.loss);
        let ctx = &match &measured {
            Some(loss) => LossCtx { loss, ..*ctx },
            None => *ctx,
        };
        let cp = CrossPieces::new(ctx, items, scores, 0, true)?;
        cp.validation(ctx, |i, logits| {
            let origin = piece_origin(&cp.plan[i]);
            self.kd(ctx, &cp.batch(i), logits, scores, &origin, None)
        })
    }

    #[cfg(test)]
    fn validation_whole(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums> {
        let measured = validation_loss(ctx.loss);
        let ctx = &match &measured {
            Some(loss) => LossCtx { loss, ..*ctx },
            None => *ctx,
        };
        let (xb, enc) = xtoken_batch(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, ctx.device)?;
        let logits = ctx.model.forward(&tb.ids)?;
        let (kl, m) = self.kd(ctx, &xb, &logits, scores, &|r, p| (r, p), None)?;
        super::whole_sums(ctx.loss.temperature, &kl, m.count, &logits, &tb)
    }
}
