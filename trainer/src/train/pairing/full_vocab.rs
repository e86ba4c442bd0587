//! The same tokenizer with the teacher's **whole** distribution (`teacher.transport =
//! "hidden"`): the teacher sends its final hidden states per position, and the loss applies the
//! teacher's own LM head ([`TeacherHead`]) chunk by chunk beside the student's
//! ([`crate::loss::full_vocab`]): exact forward KL, reverse KL or JSD(β) over every token, no
//! top-k set and no tail bucket. Records are encoded as in [`super::same`]; position `p` of the
//! teacher's answer lies against the student's position `p`.

use super::same::same_encodings;
use super::{finish, trained_positions, val_ce, wants_ce, Collation, Item};
use crate::collate::{pad_batch, TokenBatch};
use crate::loss::full_vocab::{
    full_vocab_divergence, teacher_token_logprobs, TeacherHead, DEFAULT_CHUNK_ROWS,
};
use crate::loss::kl::Divergence;
use crate::loss::{cross_entropy, LossError, Normalizer, Temperature};
use crate::train::head::{self, ChunkLoss, HeadSums, Mix};
use crate::train::step::{LossCtx, MicroOut, Units, ValSums};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use xdistill_shared::protocol::SequenceScores;

/// Positions per teacher-head chunk inside one student head chunk: `[64, V]` f32 is 39 MB for
/// Qwen3's vocabulary.
const TEACHER_CHUNK_ROWS: usize = crate::loss::full_vocab::DEFAULT_CHUNK_ROWS;

/// The full-vocabulary pairing over the teacher's head.
pub struct FullVocab<'a> {
    pub head: &'a TeacherHead,
}

impl Collation for FullVocab<'_> {
    fn loss(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(Tensor, MicroOut)> {
        let (model, device) = (ctx.model, ctx.device);
        let tb = self.batch(ctx, items, scores)?;
        let rows = TrainedRows::new(&tb, scores, self.head.hidden_size())?;
        let (b, t) = tb.ids.dims2()?;
        let n = rows.sel.len();
        // Student: hidden [B, T, H] -> trained rows [1, N, H] -> logits [1, N, V].
        let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
        let h = hidden.dim(2)?;
        let sel = Tensor::from_vec(rows.sel.clone(), n, device)?;
        let st = hidden
            .reshape((b * t, h))?
            .index_select(&sel, 0)?
            .unsqueeze(0)?;
        let logits = model.logits(&st)?;
        let kd = self.divergence(ctx, &logits, &rows, 0..n, Some(norm.kd_normalizer()?))?;
        let ce = wants_ce(ctx.loss)
            .then(|| -> Result<_> {
                let tg = Tensor::from_vec(rows.targets.clone(), (1, n), device)?;
                Ok((tg, Tensor::ones((1, n), DType::F32, device)?, n))
            })
            .transpose()?;
        finish(ctx.loss, &logits, kd, ce, norm)
    }

    fn grads(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(GradStore, HeadSums)> {
        let (model, device) = (ctx.model, ctx.device);
        let tb = self.batch(ctx, items, scores)?;
        let rows = TrainedRows::new(&tb, scores, self.head.hidden_size())?;
        let pass = ctx.head.forward(model, &tb.ids)?;
        let per = ctx.head.rows(model.lm_head().dim(0)?);
        let pieces = head::row_pieces(&rows.sel, per);
        let loss = |i: usize, logits: &Tensor| -> Result<ChunkLoss> {
            let (a, n) = (i * per, pieces[i].rows.len());
            let kd = self.divergence(ctx, logits, &rows, a..a + n, Some(norm.kd_normalizer()?))?;
            let ce = if wants_ce(ctx.loss) {
                let tg = Tensor::from_vec(rows.targets[a..a + n].to_vec(), (1, n), device)?;
                let mask = Tensor::ones((1, n), DType::F32, device)?;
                Some(cross_entropy(
                    logits,
                    &tg,
                    &mask,
                    Some(norm.ce_normalizer()?),
                )?)
            } else {
                None
            };
            Ok(ChunkLoss { kd: Some(kd), ce })
        };
        let out = head::run(model, pass.hidden(), &pieces, Mix::of(ctx.loss), loss)?;
        out.finish(pass)
    }

    /// Exact forward KL to the teacher over the whole vocabulary (τ² removed), and the
    /// student's CE.
    fn validation(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums> {
        let (model, device) = (ctx.model, ctx.device);
        let mut out = ValSums::default();
        let tb = self.batch(ctx, items, scores)?;
        if tb.n_targets == 0 {
            return Ok(out);
        }
        let rows = TrainedRows::new(&tb, scores, self.head.hidden_size())?;
        let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
        let per = ctx.head.rows(model.lm_head().dim(0)?);
        let pieces = head::row_pieces(&rows.sel, per);
        head::forward_only(model, &hidden, &pieces, |i, logits| {
            let (a, n) = (i * per, pieces[i].rows.len());
            let (kl, m) = self.forward_kl(ctx, logits, &rows, a..a + n)?;
            let tau2 = ctx.loss.temperature.get() * ctx.loss.temperature.get();
            out.kl += kl * m / tau2;
            out.kl_units += m;
            let tg = Tensor::from_vec(rows.targets[a..a + n].to_vec(), (1, n), device)?;
            let mask = Tensor::ones((1, n), DType::F32, device)?;
            val_ce(&mut out, logits, tg, mask)
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
        let tb = self.batch(ctx, items, scores)?;
        let rows = TrainedRows::new(&tb, scores, self.head.hidden_size())?;
        let (b, t) = tb.ids.dims2()?;
        let logits = ctx.model.forward(&tb.ids)?;
        let v = logits.dim(2)?;
        let sel = Tensor::from_vec(rows.sel.clone(), rows.sel.len(), ctx.device)?;
        let picked = logits
            .reshape((b * t, v))?
            .index_select(&sel, 0)?
            .unsqueeze(0)?;
        let (kl, m) = self.forward_kl(ctx, &picked, &rows, 0..rows.sel.len())?;
        let tau2 = ctx.loss.temperature.get() * ctx.loss.temperature.get();
        let (ce, n) = cross_entropy(&logits, &tb.targets, &tb.mask, None)?;
        let ce = ce.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok(ValSums {
            kl: kl * m / tau2,
            kl_units: m,
            ce: ce * n,
            ce_tokens: n,
        })
    }
}

impl FullVocab<'_> {
    /// The padded batch of `items`, each checked against its teacher answer (hidden rows, no
    /// top-k: `k` = 0).
    fn batch(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<TokenBatch> {
        let enc = same_encodings(items, scores, 0)?;
        Ok(pad_batch(&enc, 0, ctx.device)?)
    }

    /// `ctx.loss`'s divergence of the student logits `[1, n, V_s]` against the teacher's full
    /// distribution at trained rows `range`, divided by `normalizer`.
    fn divergence(
        &self,
        ctx: &LossCtx,
        logits: &Tensor,
        rows: &TrainedRows,
        range: std::ops::Range<usize>,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, crate::loss::KdMetrics)> {
        let Some(div) = ctx.loss.divergence() else {
            bail!(
                "teacher.transport = \"hidden\" trains with forward_kl, reverse_kl or jsd, not {:?}",
                ctx.loss.kd
            );
        };
        self.against_teacher(ctx, logits, rows, range, div, normalizer)
    }

    /// Mean forward KL (τ² included) over the rows `range` and their count.
    fn forward_kl(
        &self,
        ctx: &LossCtx,
        logits: &Tensor,
        rows: &TrainedRows,
        range: std::ops::Range<usize>,
    ) -> Result<(f64, f64)> {
        let (kl, m) = self.against_teacher(ctx, logits, rows, range, Divergence::Forward, None)?;
        Ok((kl.to_dtype(DType::F64)?.to_scalar::<f64>()?, m.count))
    }

    fn against_teacher(
        &self,
        ctx: &LossCtx,
        logits: &Tensor,
        rows: &TrainedRows,
        range: std::ops::Range<usize>,
        div: Divergence,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, crate::loss::KdMetrics)> {
        let n = range.len();
        let hsz = self.head.hidden_size();
        let vocab = self.head.vocab();
        let v = logits.dim(2)?;
        if v < vocab {
            bail!("the student has {v} logits per position, the teacher {vocab} tokens");
        }
        // Rows past the teacher's vocabulary (the student's padding) are not tokens.
        let logits = if v > vocab {
            logits.narrow(2, 0, vocab)?
        } else {
            logits.clone()
        };
        let hid = Tensor::from_slice(
            &rows.hidden[range.start * hsz..range.end * hsz],
            (1, n, hsz),
            ctx.device,
        )?;
        let mask = Tensor::ones((1, n), DType::F32, ctx.device)?;
        full_vocab_divergence(
            &logits,
            self.head,
            &hid,
            &mask,
            div,
            ctx.loss.temperature,
            TEACHER_CHUNK_ROWS,
            normalizer,
        )
        .map_err(|e: LossError| e.into())
    }
}

/// The trained positions of a batch (row-major over `[B, T]`) with their targets and the
/// teacher's hidden state at each.
struct TrainedRows {
    /// `[N]` flat indices into `[B·T]`.
    sel: Vec<u32>,
    /// `[N]` the token each trained position predicts.
    targets: Vec<u32>,
    /// `[N, H]` the teacher's final-norm hidden states.
    hidden: Vec<f32>,
}

impl TrainedRows {
    fn new(tb: &TokenBatch, scores: &[&SequenceScores], hsz: usize) -> Result<TrainedRows> {
        let t = tb.ids.dim(1)?;
        let (sel, targets) = trained_positions(tb)?;
        for (r, s) in scores.iter().enumerate() {
            if s.hidden.len() != s.rows * hsz * 4 {
                bail!(
                    "teacher answer {r}: {} bytes of hidden states for {} rows of H = {hsz} \
                     (expected f32 rows: was the teacher asked with transport = \"hidden\"?)",
                    s.hidden.len(),
                    s.rows
                );
            }
        }
        let mut hidden = Vec::with_capacity(sel.len() * hsz);
        for &i in &sel {
            let (r, p) = (i as usize / t, i as usize % t);
            hidden.extend(hidden_row(scores[r], r, p, hsz)?);
        }
        Ok(TrainedRows {
            sel,
            targets,
            hidden,
        })
    }
}

/// Row `p` of answer `r`'s hidden states (`[rows, H]` little-endian f32, as the client widens
/// them), or an error naming what is missing.
pub(crate) fn hidden_row(
    sc: &SequenceScores,
    r: usize,
    p: usize,
    h: usize,
) -> Result<impl Iterator<Item = f32> + '_> {
    let bytes = sc.hidden.get(p * h * 4..(p + 1) * h * 4).ok_or_else(|| {
        anyhow::anyhow!(
            "teacher answer {r}: no hidden state at row {p} ({} bytes for {} rows of H = {h}; \
             was the teacher asked with transport = \"hidden\"?)",
            sc.hidden.len(),
            sc.rows
        )
    })?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
}

/// The teacher's log-prob of one token at each `(answer, row, target)` of `want`, from the
/// answers' hidden states and the teacher's head at `temperature` (what the top-k transport
/// sends as `target_logprobs`): one head pass over the entries on `device`, in chunks of
/// [`DEFAULT_CHUNK_ROWS`] positions.
fn token_logprobs_from_hidden(
    head: &TeacherHead,
    temperature: Temperature,
    device: &Device,
    scores: &[&SequenceScores],
    want: &[(usize, usize, u32)],
) -> Result<Vec<f32>> {
    let h = head.hidden_size();
    let n = want.len();
    let mut hidden = Vec::with_capacity(n * h);
    for &(r, p, _) in want {
        hidden.extend(hidden_row(scores[r], r, p, h)?);
    }
    let targets: Vec<u32> = want.iter().map(|w| w.2).collect();
    let hid = Tensor::from_vec(hidden, (n, h), device)?;
    let tg = Tensor::from_vec(targets, n, device)?;
    let lp = teacher_token_logprobs(head, &hid, &tg, temperature, DEFAULT_CHUNK_ROWS)?;
    Ok(lp.to_dtype(DType::F32)?.to_vec1()?)
}

/// Each answer's `target_logprobs` (one per row, what the top-k transport sends) with the rows of
/// `want` filled by `token_logprobs_from_hidden` and every other row 0: for a loss or a figure
/// that needs only the teacher's log-probs of actual tokens (ALM, the on-policy sample figures).
pub fn target_logprobs_from_hidden(
    head: &TeacherHead,
    temperature: Temperature,
    device: &Device,
    scores: &[&SequenceScores],
    want: &[(usize, usize, u32)],
) -> Result<Vec<Vec<f32>>> {
    let lp = token_logprobs_from_hidden(head, temperature, device, scores, want)?;
    let mut out: Vec<Vec<f32>> = scores.iter().map(|sc| vec![0.0; sc.rows]).collect();
    for (&(r, p, _), v) in want.iter().zip(lp) {
        out[r][p] = v;
    }
    Ok(out)
}
