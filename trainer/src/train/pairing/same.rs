//! The same tokenizer on both sides: a record is encoded once and the teacher scores exactly
//! those ids, so its row p lies against the student's position p. The LM head runs only on
//! trained positions (`[N, H] -> [N, V]`), which is where almost all of a step's time goes with
//! a real vocabulary.

use super::{check_rows, finish, trained_positions, val_ce, wants_ce, Collation, Item, Limits};
use crate::collate::{encode, pad_batch, Encoded, TokenBatch};
use crate::data::Record;
use crate::loss::{
    cross_entropy, kd_loss, kl::Divergence, topk_divergence, KdInputs, TailMode, TopkTargets,
};
use crate::train::head::{self, ChunkLoss, HeadSums, Mix};
use crate::train::step::{LossCtx, MicroOut, Units, ValSums};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
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

/// The same-tokenizer pairing.
pub struct Same;

impl Collation for Same {
    fn loss(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(Tensor, MicroOut)> {
        same_tokenizer(ctx, items, scores, norm)
    }

    fn grads(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        norm: Units,
    ) -> Result<(GradStore, HeadSums)> {
        same_tokenizer_grads(ctx, items, scores, norm)
    }

    /// Forward KL to the teacher over its top-k with a tail bucket, and the student's CE.
    fn validation(
        &self,
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
    ) -> Result<ValSums> {
        let (model, k, device, temperature) = (ctx.model, ctx.k, ctx.device, ctx.loss.temperature);
        let tau2 = temperature.get() * temperature.get();
        let vocab = model.lm_head().dim(0)?;
        let per = ctx.head.rows(vocab);
        let mut out = ValSums::default();
        let enc = same_encodings(items, scores, k)?;
        let tb = pad_batch(&enc, 0, device)?;
        if tb.n_targets == 0 {
            return Ok(out);
        }
        let rows = TrainedRows::new(&tb, scores, k)?;
        let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
        let pieces = head::row_pieces(&rows.sel, per);
        let ones = vec![1f32; per];
        head::forward_only(model, &hidden, &pieces, |i, logits| {
            let (a, n) = (i * per, pieces[i].rows.len());
            let tk = TopkTargets::from_host(
                1,
                n,
                k,
                &rows.ids[a * k..(a + n) * k],
                &rows.lps[a * k..(a + n) * k],
                &ones[..n],
                vocab,
                device,
            )?;
            let (kl, m) = topk_divergence(
                logits,
                &tk,
                Divergence::Forward,
                TailMode::Bucket,
                temperature,
                None,
            )?;
            out.kl += kl.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? / tau2 * m.count;
            out.kl_units += m.count;
            let tg = Tensor::from_vec(rows.targets[a..a + n].to_vec(), (1, n), device)?;
            let mask = Tensor::ones((1, n), candle_core::DType::F32, device)?;
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
        let (model, k, device, temperature) = (ctx.model, ctx.k, ctx.device, ctx.loss.temperature);
        let enc = same_encodings(items, scores, k)?;
        let tb = pad_batch(&enc, 0, device)?;
        let (b, t) = tb.ids.dims2()?;
        let logits = model.forward(&tb.ids)?;
        let mut ids = vec![0u32; b * t * k];
        let mut lps = vec![0f32; b * t * k];
        for (r, s) in scores.iter().enumerate() {
            for p in 0..s.rows.min(t) {
                let dst = (r * t + p) * k;
                ids[dst..dst + k].copy_from_slice(s.ids_row(p));
                lps[dst..dst + k].copy_from_slice(s.values_row(p));
            }
        }
        let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
        let tk = TopkTargets::from_host(b, t, k, &ids, &lps, &mask, logits.dim(2)?, device)?;
        let (kl, m) = topk_divergence(
            &logits,
            &tk,
            Divergence::Forward,
            TailMode::Bucket,
            temperature,
            None,
        )?;
        super::whole_sums(temperature, &kl, m.count, &logits, &tb)
    }
}

/// Same tokenizer, chunked: the trained rows in chunks of `ctx.head.rows(V)`.
fn same_tokenizer_grads(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(GradStore, HeadSums)> {
    let (model, k, device) = (ctx.model, ctx.k, ctx.device);
    let enc = same_encodings(items, scores, k)?;
    let tb = pad_batch(&enc, 0, device)?;
    let rows = TrainedRows::new(&tb, scores, k)?;
    let pass = ctx.head.forward(model, &tb.ids)?;
    let vocab = model.lm_head().dim(0)?;
    let per = ctx.head.rows(vocab);
    let pieces = head::row_pieces(&rows.sel, per);
    let ones = vec![1f32; per];
    let loss = |i: usize, logits: &Tensor| -> Result<ChunkLoss> {
        let (a, n) = (i * per, pieces[i].rows.len());
        let tk = TopkTargets::from_host(
            1,
            n,
            k,
            &rows.ids[a * k..(a + n) * k],
            &rows.lps[a * k..(a + n) * k],
            &ones[..n],
            logits.dim(2)?,
            device,
        )?;
        let kd = kd_loss(
            ctx.loss,
            logits,
            KdInputs::Topk(&tk),
            Some(norm.kd_normalizer()?),
        )?;
        let ce = if wants_ce(ctx.loss) {
            let tg = Tensor::from_vec(rows.targets[a..a + n].to_vec(), (1, n), device)?;
            let mask = Tensor::ones((1, n), candle_core::DType::F32, device)?;
            let (ce, count) = cross_entropy(logits, &tg, &mask, Some(norm.ce_normalizer()?))?;
            Some((ce, count))
        } else {
            None
        };
        Ok(ChunkLoss { kd: Some(kd), ce })
    };
    let out = head::run(model, pass.hidden(), &pieces, Mix::of(ctx.loss), loss)?;
    out.finish(pass)
}

/// The trained positions of a same-tokenizer batch (row-major over `[B, T]`) with their
/// targets and teacher top-k rows.
struct TrainedRows {
    /// `[N]` flat indices into `[B·T]`.
    sel: Vec<u32>,
    /// `[N]` the token each trained position predicts.
    targets: Vec<u32>,
    /// `[N, k]` teacher top-k ids and log-probs.
    ids: Vec<u32>,
    lps: Vec<f32>,
}

impl TrainedRows {
    fn new(tb: &TokenBatch, scores: &[&SequenceScores], k: usize) -> Result<TrainedRows> {
        let t = tb.ids.dim(1)?;
        let (sel, targets) = trained_positions(tb)?;
        let mut ids = Vec::with_capacity(sel.len() * k);
        let mut lps = Vec::with_capacity(sel.len() * k);
        for &i in &sel {
            let (r, p) = (i as usize / t, i as usize % t);
            ids.extend_from_slice(scores[r].ids_row(p));
            lps.extend_from_slice(scores[r].values_row(p));
        }
        Ok(TrainedRows {
            sel,
            targets,
            ids,
            lps,
        })
    }
}

/// Same tokenizer: the LM head runs only on trained positions (`[N, H] -> [N, V]`), which is
/// where almost all of a step's time goes with a real vocabulary.
fn same_tokenizer(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(Tensor, MicroOut)> {
    let (model, k, device) = (ctx.model, ctx.k, ctx.device);
    let enc = same_encodings(items, scores, k)?;
    let tb = pad_batch(&enc, 0, device)?;
    let (b, t) = tb.ids.dims2()?;
    // 1. Trained positions (row-major over [B, T]) and their teacher rows.
    let trained = TrainedRows::new(&tb, scores, k)?;
    let n = trained.sel.len();
    // 2. Student: hidden [B, T, H] -> trained rows [1, N, H] -> logits [1, N, V].
    let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
    let h = hidden.dim(2)?;
    let sel_t = Tensor::from_vec(trained.sel.clone(), n, device)?;
    let rows = hidden
        .reshape((b * t, h))?
        .index_select(&sel_t, 0)?
        .unsqueeze(0)?;
    let logits = model.logits(&rows)?;
    let vocab = logits.dim(2)?;
    let ones = vec![1f32; n];
    let tk = TopkTargets::from_host(1, n, k, &trained.ids, &trained.lps, &ones, vocab, device)?;
    let kd = kd_loss(
        ctx.loss,
        &logits,
        KdInputs::Topk(&tk),
        Some(norm.kd_normalizer()?),
    )?;
    let ce_inputs = if wants_ce(ctx.loss) {
        let tg = Tensor::from_vec(trained.targets, (1, n), device)?;
        Some((
            tg,
            Tensor::ones((1, n), candle_core::DType::F32, device)?,
            n,
        ))
    } else {
        None
    };
    finish(ctx.loss, &logits, kd, ce_inputs, norm)
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
