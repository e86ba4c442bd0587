//! The same tokenizer on both sides: a record is encoded once and the teacher scores exactly
//! those ids, so its row p lies against the student's position p. The LM head runs only on
//! trained positions (`[N, H] -> [N, V]`), which is where almost all of a step's time goes with
//! a real vocabulary.

use super::{check_rows, Item, Limits, LossCtx, Purpose, TrainedRows};
use crate::collate::{encode, pad_batch, Encoded};
use crate::data::Record;
use crate::loss::fused_head::FusedKd;
use crate::loss::{
    kd_loss_figures, kl::Divergence, topk_divergence, KdFigures, KdInputs, KdMetrics, Normalizer,
    TailMode, TopkTargets,
};
use crate::train::micro::{Layout, MicroBatch, Part, RowPieces, Units};
use anyhow::{bail, Result};
use candle_core::Tensor;
use tokenizers::Tokenizer;
use xdistill_shared::protocol::SequenceScores;

/// Margin for [`too_long`]'s shortcut: a text of `b` bytes has at most about `b` tokens, plus
/// the special tokens a tokenizer adds (BOS/EOS, a prefix-space piece).
pub(super) const SPECIAL_TOKEN_MARGIN: usize = 16;

/// Whether `r` exceeds the tighter of the two limits (without truncation). Texts short enough in
/// bytes are not tokenized; a record that cannot be tokenized is not "too long" (it is skipped
/// later, when prepared, with its reason).
pub fn too_long(t: &Tokenizer, r: &Record, lim: Limits) -> bool {
    let max = lim.max_student_tokens.min(lim.max_teacher_tokens);
    if r.len_bytes() + SPECIAL_TOKEN_MARGIN <= max {
        return false;
    }
    encode(t, &r.text(), 0, usize::MAX).is_ok_and(|e| e.ids.len() > max)
}

/// Encodes one record (truncated to the limits when `lim.truncate`, else refused over them).
pub fn item(t: &Tokenizer, r: &Record, lim: Limits) -> std::result::Result<Item, String> {
    let max = lim.max_student_tokens.min(lim.max_teacher_tokens);
    let cut = if lim.truncate { max } else { usize::MAX };
    let e = encode(t, &r.text(), r.loss_start_byte(), cut).map_err(|e| e.to_string())?;
    if e.ids.len() > max {
        return Err(format!("{} tokens exceed the limit of {max}", e.ids.len()));
    }
    Ok(Item::Same(e))
}

/// Trained tokens, for the distillation loss and the cross-entropy alike.
pub fn units(e: &Encoded) -> Units {
    let n = e.ids.len().saturating_sub(e.loss_from.max(1)) as f64;
    Units { kd: n, ce: n }
}

/// A same-tokenizer micro-batch: the LM head runs only on trained positions (`[N, H] -> [N, V]`,
/// where almost all of a step's time goes with a real vocabulary), each against the teacher's
/// top-k row at the same position.
pub struct SameBatch<'a> {
    ctx: LossCtx<'a>,
    rows: TrainedRows<TopkRows>,
    layout: RowPieces,
    /// Every trained position's teacher top-k `[1, N, k]` and cross-entropy target and mask
    /// `[1, N]`, checked and moved to the device once per micro-batch (`None`: no trained
    /// rows). A head piece takes views of them: no host work and no copy per piece (on a GPU a
    /// copy from pageable host memory waits until the device has run what was queued before it,
    /// so one per piece would stall the head's loop).
    on_device: Option<(TopkTargets, Tensor, Tensor)>,
}

impl<'a> SameBatch<'a> {
    pub fn new(
        ctx: LossCtx<'a>,
        items: &[Item],
        scores: &[&SequenceScores],
        purpose: Purpose,
    ) -> Result<SameBatch<'a>> {
        let enc = same_encodings(items, scores, ctx.k)?;
        let tb = pad_batch(&enc, 0, ctx.vocab(), ctx.device)?;
        let (rows, layout) = TrainedRows::lay_out(&ctx, &tb, purpose, |r, p, t: &mut TopkRows| {
            t.ids.extend_from_slice(scores[r].ids_row(p));
            t.lps.extend_from_slice(scores[r].values_row(p));
            Ok(())
        })?;
        let n = rows.targets.len();
        let on_device = if n == 0 {
            None
        } else {
            let ones = vec![1f32; n];
            let topk = TopkTargets::from_host(
                1,
                n,
                ctx.k,
                &rows.teacher.ids,
                &rows.teacher.lps,
                &ones,
                ctx.model.lm_head().dim(0)?,
                ctx.device,
            )?;
            let ce = Tensor::from_vec(rows.targets.clone(), (1, n), ctx.device)?;
            let mask = topk.mask.clone();
            Some((topk, ce, mask))
        };
        Ok(SameBatch {
            ctx,
            rows,
            layout,
            on_device,
        })
    }

    /// The device tensors of every trained position, or an error where there are none.
    fn on_device(&self) -> Result<&(TopkTargets, Tensor, Tensor)> {
        self.on_device
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("a loss asked of a micro-batch with no trained tokens"))
    }

    /// The teacher's top-k rows of `part` (views of [`SameBatch::on_device`]'s): `[1, n, k]`.
    fn targets(&self, part: Part) -> Result<TopkTargets> {
        let r = self.layout.range(part);
        if r.is_empty() {
            let (k, v) = (self.ctx.k, self.ctx.model.lm_head().dim(0)?);
            return Ok(TopkTargets::from_host(
                1,
                0,
                k,
                &[],
                &[],
                &[],
                v,
                self.ctx.device,
            )?);
        }
        let all = &self.on_device()?.0;
        let rows = |t: &Tensor| t.narrow(1, r.start, r.len());
        Ok(TopkTargets {
            ids: rows(&all.ids)?,
            logprobs: rows(&all.logprobs)?,
            mask: rows(&all.mask)?,
            distinct: all.distinct,
            count: r.len() as f64,
        })
    }
}

impl MicroBatch for SameBatch<'_> {
    fn layout(&self) -> &Layout {
        &self.layout.layout
    }

    fn kd(
        &self,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)> {
        let tk = self.targets(part)?;
        Ok(kd_loss_figures(
            self.ctx.loss,
            logits,
            KdInputs::Topk(&tk),
            normalizer,
        )?)
    }

    fn fused_kd(&self, part: Part, normalizer: Normalizer) -> Result<Option<FusedKd>> {
        if self.layout.range(part).is_empty() {
            return Ok(None);
        }
        let head = self.ctx.model.lm_head();
        Ok(FusedKd::topk(
            self.ctx.loss,
            self.targets(part)?,
            normalizer,
            head,
        )?)
    }

    /// Forward KL to the teacher over its top-k with a tail bucket.
    fn val_kd(&self, part: Part, logits: &Tensor) -> Result<Option<(Tensor, KdMetrics)>> {
        let tk = self.targets(part)?;
        let tau = self.ctx.loss.temperature;
        let kl = topk_divergence(
            logits,
            &tk,
            Divergence::Forward,
            TailMode::Bucket,
            tau,
            None,
        )?;
        Ok(Some(kl))
    }

    fn ce(&self, part: Part) -> Result<(Tensor, Tensor, usize)> {
        let r = self.layout.range(part);
        if r.is_empty() {
            return self.layout.ce(part, &self.rows.targets, self.ctx.device);
        }
        let (_, targets, mask) = self.on_device()?;
        Ok((
            targets.narrow(1, r.start, r.len())?,
            mask.narrow(1, r.start, r.len())?,
            r.len(),
        ))
    }
}

/// A same-tokenizer answer's top-k rows at the trained positions: `[N, k]` ids and log-probs.
#[derive(Default)]
struct TopkRows {
    ids: Vec<u32>,
    lps: Vec<f32>,
}

/// The student side of same-tokenizer items, each checked against its teacher answer.
pub(crate) fn same_encodings(
    items: &[Item],
    scores: &[&SequenceScores],
    k: usize,
) -> Result<Vec<Encoded>> {
    items
        .iter()
        .zip(scores)
        .map(|(i, s)| match i {
            Item::Same(e) => {
                check_rows(s, e.ids.len(), k)?;
                Ok(e.clone())
            }
            Item::Cross { .. } => bail!("an aligned item in a same-tokenizer run"),
        })
        .collect()
}
