//! Another tokenizer with the teacher's **whole** distribution (`teacher.transport = "hidden"`,
//! `kd = first_kl`): records are aligned as in [`super::cross`], the teacher sends its hidden
//! states, and at each aligned chunk the teacher's full log-softmax at the chunk's first teacher
//! position (its head applied on the student's device) is grouped by first student token
//! ([`crate::loss::xtoken_full::first_kl_full`]): no top-k set, the tail holding only teacher
//! tokens no student token starts. The LM head runs in the same alignment-chunk pieces as
//! [`super::cross`] ([`crate::train::xpieces`]).

use super::cross::xtoken_batch;
use super::{finish, val_ce, wants_ce, Collation, Item};
use crate::collate::pad_batch;
use crate::loss::full_vocab::{teacher_log_softmax_chunk, TeacherHead};
use crate::loss::xtoken_full::first_kl_full;
use crate::loss::{compute_dtype, cross_entropy, KdConfig, KdMetrics, Projection, XTokenBatch};
use crate::train::head::{self, ChunkLoss, HeadSums, Mix};
use crate::train::step::{LossCtx, MicroOut, Units, ValSums};
use crate::train::xpieces::{self, XPiece};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use xdistill_shared::protocol::SequenceScores;

/// The cross-tokenizer pairing over the teacher's head.
pub struct CrossFullVocab<'a> {
    pub projection: &'a Projection,
    pub head: &'a TeacherHead,
}

/// One aligned chunk of a (sub-)batch: its row, first student and first teacher position.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    row: usize,
    student: usize,
    teacher: usize,
}

/// The chunks of `x` with both sides non-empty, in row and chunk order.
fn anchors(x: &XTokenBatch) -> Vec<Anchor> {
    let (ts, tt) = (x.student_len, x.teacher_len);
    let mut out = vec![];
    for row in 0..x.batch {
        let n = x.num_chunks[row];
        let (mut s0, mut t0) = (vec![None; n], vec![None; n]);
        for p in (0..ts).rev() {
            if let Ok(c) = usize::try_from(x.student_chunk[row * ts + p]) {
                s0[c] = Some(p);
            }
        }
        for p in (0..tt).rev() {
            if let Ok(c) = usize::try_from(x.teacher_chunk[row * tt + p]) {
                t0[c] = Some(p);
            }
        }
        for c in 0..n {
            if let (Some(student), Some(teacher)) = (s0[c], t0[c]) {
                out.push(Anchor {
                    row,
                    student,
                    teacher,
                });
            }
        }
    }
    out
}

impl CrossFullVocab<'_> {
    /// First-token KL of `logits [nb, sl, V]` (the rows of `x`) against the teacher's whole
    /// distribution at each chunk's anchor; `origin(row, p)` maps a teacher position of `x` to
    /// its (batch row, position) in `scores`.
    fn kd(
        &self,
        ctx: &LossCtx,
        x: &XTokenBatch,
        logits: &Tensor,
        scores: &[&SequenceScores],
        origin: &dyn Fn(usize, usize) -> (usize, usize),
        normalizer: Option<f64>,
    ) -> Result<(Tensor, KdMetrics)> {
        let a = anchors(x);
        let (nb, sl, v) = logits.dims3()?;
        let hsz = self.head.hidden_size();
        let rows: Vec<u32> = a.iter().map(|c| (c.row * sl + c.student) as u32).collect();
        let mut hid = Vec::with_capacity(a.len() * hsz);
        for c in &a {
            let (r, p) = origin(c.row, c.teacher);
            let s = scores[r];
            let bytes = s
                .hidden
                .get(p * hsz * 4..(p + 1) * hsz * 4)
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "teacher answer {r}: no hidden state at position {p} ({} bytes for \
                         H = {hsz}; was the teacher asked with transport = \"hidden\"?)",
                        s.hidden.len()
                    )
                })?;
            hid.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        let n = a.len();
        let dev = ctx.device;
        let student = logits
            .reshape((nb * sl, v))?
            .index_select(&Tensor::from_vec(rows, n, dev)?, 0)?; // [C, V]
                                                                 // The teacher's log-softmax in the loss's dtype (f64 for the gradient checks).
        let hidden = Tensor::from_vec(hid, (n, hsz), dev)?.to_dtype(compute_dtype(logits))?;
        let teacher = if n == 0 {
            Tensor::zeros((0, self.head.vocab()), DType::F32, dev)?
        } else {
            teacher_log_softmax_chunk(self.head, &hidden, ctx.loss.temperature)?
        };
        Ok(first_kl_full(
            &student,
            &teacher,
            self.projection,
            ctx.loss.temperature,
            normalizer,
        )?)
    }

    fn check(&self, ctx: &LossCtx) -> Result<()> {
        if !matches!(ctx.loss.kd, KdConfig::FirstKl {}) {
            bail!(
                "teacher.transport = \"hidden\" across tokenizers trains with first_kl, not {:?}",
                ctx.loss.kd
            );
        }
        Ok(())
    }
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
        let (xb, enc) = xtoken_batch(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, ctx.device)?;
        let logits = ctx.model.forward(&tb.ids)?; // [B, Ts, V]
        let kd = self.kd(ctx, &xb, &logits, scores, &|r, p| (r, p), Some(norm.kd))?;
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
        let (model, device) = (ctx.model, ctx.device);
        let (xb, enc) = xtoken_batch(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, device)?;
        let ts = tb.ids.dim(1)?;
        let targets: Vec<u32> = tb.targets.flatten_all()?.to_vec1()?;
        let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
        let ce_on = wants_ce(ctx.loss);
        let wanted: Vec<bool> = (0..mask.len())
            .map(|i| xb.student_chunk[i] != -1 || (ce_on && mask[i] > 0.0))
            .collect();
        let pass = ctx.head.forward(model, &tb.ids)?;
        let per = ctx.head.rows(model.lm_head().dim(0)?);
        let plan = xpieces::plan(&xb, per, &wanted);
        let pieces: Vec<head::Piece> = plan
            .iter()
            .map(|p| head::Piece {
                rows: p.rows(ts),
                shape: (p.segments.len(), p.student_len),
            })
            .collect();
        let loss = |i: usize, logits: &Tensor| -> Result<ChunkLoss> {
            let sub = xpieces::batch(&xb, &plan[i]);
            let origin = piece_origin(&plan[i]);
            let kd = self.kd(ctx, &sub, logits, scores, &origin, Some(norm.kd))?;
            let rows = &pieces[i].rows;
            let n = rows.iter().filter(|&&r| mask[r as usize] > 0.0).count();
            let ce = if ce_on && n > 0 {
                let shape = pieces[i].shape;
                let tg: Vec<u32> = rows.iter().map(|&r| targets[r as usize]).collect();
                let m: Vec<f32> = rows.iter().map(|&r| mask[r as usize]).collect();
                let tg = Tensor::from_vec(tg, shape, device)?;
                let m = Tensor::from_vec(m, shape, device)?;
                Some(cross_entropy(logits, &tg, &m, Some(norm.ce))?)
            } else {
                None
            };
            Ok(ChunkLoss { kd: Some(kd), ce })
        };
        let out = head::run(model, pass.hidden(), &pieces, Mix::of(ctx.loss), loss)?;
        out.finish(pass)
    }

    /// The exact first-token KL over the teacher's whole distribution (τ² removed), and the
    /// student's CE.
    fn validation(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums> {
        let (model, device) = (ctx.model, ctx.device);
        let tau2 = ctx.loss.temperature * ctx.loss.temperature;
        let per = ctx.head.rows(model.lm_head().dim(0)?);
        let mut out = ValSums::default();
        let (xb, enc) = xtoken_batch(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, device)?;
        let ts = tb.ids.dim(1)?;
        let targets: Vec<u32> = tb.targets.flatten_all()?.to_vec1()?;
        let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
        let wanted: Vec<bool> = (0..mask.len())
            .map(|i| xb.student_chunk[i] != -1 || mask[i] > 0.0)
            .collect();
        let plan = xpieces::plan(&xb, per, &wanted);
        let pieces: Vec<head::Piece> = plan
            .iter()
            .map(|p| head::Piece {
                rows: p.rows(ts),
                shape: (p.segments.len(), p.student_len),
            })
            .collect();
        let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
        head::forward_only(model, &hidden, &pieces, |i, logits| {
            let sub = xpieces::batch(&xb, &plan[i]);
            let origin = piece_origin(&plan[i]);
            let (kl, m) = self.kd(ctx, &sub, logits, scores, &origin, None)?;
            if m.count > 0.0 {
                out.kl += kl.to_dtype(DType::F64)?.to_scalar::<f64>()? / tau2 * m.count;
                out.kl_units += m.count;
            }
            let rows = &pieces[i].rows;
            let shape = pieces[i].shape;
            let tg: Vec<u32> = rows.iter().map(|&r| targets[r as usize]).collect();
            let m: Vec<f32> = rows.iter().map(|&r| mask[r as usize]).collect();
            let tg = Tensor::from_vec(tg, shape, device)?;
            let m = Tensor::from_vec(m, shape, device)?;
            val_ce(&mut out, logits, tg, m)
        })?;
        Ok(out)
    }

    #[cfg(test)]
    fn validation_whole(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums> {
        let (xb, enc) = xtoken_batch(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, ctx.device)?;
        let logits = ctx.model.forward(&tb.ids)?;
        let (kl, m) = self.kd(ctx, &xb, &logits, scores, &|r, p| (r, p), None)?;
        super::whole_sums(ctx.loss.temperature, &kl, m.count, &logits, &tb)
    }
}
