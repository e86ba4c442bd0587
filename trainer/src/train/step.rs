//! The loss of one micro-batch: student forward, teacher rows laid against it, distillation loss
//! (+ cross-entropy). [`micro_grads`] returns its gradients with the LM head and loss run in row
//! chunks ([`super::head`]); [`micro_loss`] is the same loss as one scalar over the whole
//! micro-batch (every `[N, V]` logit at once), kept as the reference the chunked path is tested
//! against.

use super::head::{self, ChunkLoss, HeadOpts, HeadSums, Mix};
use super::prepare::Item;
use crate::collate::{pad_batch, Encoded, TokenBatch};
use crate::loss::{
    combine, cross_entropy, kd_loss, kl::Divergence, topk_divergence, CeConfig, KdInputs,
    KdMetrics, LossConfig, Projection, TailMode, TopkTargets, XTokenBatch,
};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

/// Counts a step's losses are normalised by (summed over its micro-batches, so accumulated
/// micro-batches add up to the mean over the whole step).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Units {
    /// Tokens (same tokenizer) or chunks (cross tokenizer) of the distillation loss.
    pub kd: f64,
    /// Trained student tokens (cross-entropy).
    pub ce: f64,
}

impl std::ops::AddAssign for Units {
    fn add_assign(&mut self, o: Units) {
        self.kd += o.kd;
        self.ce += o.ce;
    }
}

/// Whether student and teacher share a tokenizer: decided once, when the run connects to its
/// teacher, and carried by [`LossCtx`] (a cross-tokenizer run always has its projection).
#[derive(Clone, Copy)]
pub enum Pairing<'a> {
    Same,
    Cross(&'a Projection),
    /// A chunk-level ensemble's virtual teacher in the student's own tokenization (identity
    /// projection, one chunk per chunk common to every teacher): trained like `Cross`,
    /// validated with first-token KL (its rows exist only at chunk starts).
    Mixture(&'a Projection),
}

/// Everything the loss of a micro-batch needs besides the batch itself.
#[derive(Clone, Copy)]
pub struct LossCtx<'a> {
    pub model: &'a Decoder,
    /// The teacher's top-k per position.
    pub k: usize,
    pub loss: &'a LossConfig,
    pub pairing: Pairing<'a>,
    pub device: &'a Device,
    /// Sequences per forward/backward pass in [`accumulate`].
    pub micro_batch: usize,
    /// Activation checkpointing and the head's chunk size.
    pub head: HeadOpts,
}

/// What a micro-batch's loss evaluation measured (detached).
#[derive(Debug, Clone, Default)]
pub struct MicroOut {
    pub kd: KdMetrics,
    /// Mean cross-entropy over this micro-batch's trained tokens, when computed.
    pub ce: Option<f64>,
    /// Effective KD multiplier (dynamic scaling).
    pub kd_scale: f64,
    pub units: Units,
}

/// The trained units of `items`.
pub fn units(items: &[Item]) -> Units {
    let mut u = Units::default();
    for it in items {
        match it {
            Item::Same(e) => {
                let n = e.ids.len().saturating_sub(e.loss_from.max(1)) as f64;
                u += Units { kd: n, ce: n };
            }
            Item::Cross { pair, loss_start } => {
                let layout = cross_layout(pair, *loss_start);
                u += Units {
                    kd: layout.chunks as f64,
                    ce: layout.student_loss_tokens as f64,
                };
            }
        }
    }
    u
}

/// Per-position chunk ids in the shifted view for one aligned pair.
struct CrossLayout {
    /// `[Ts]` chunk of token t+1 (−1: none).
    student_chunk: Vec<i64>,
    /// `[Tt]`.
    teacher_chunk: Vec<i64>,
    chunks: usize,
    /// First student token index that is trained.
    student_loss_from: usize,
    student_loss_tokens: usize,
}

/// Chunks count when both sides have a logit predicting their first token (not at position 0)
/// and they hold trained bytes (end after `loss_start`). Ids are renumbered densely.
fn cross_layout(pair: &crate::align::TokenizedPair, loss_start: usize) -> CrossLayout {
    let (ts, tt) = (pair.student_ids.len(), pair.teacher_ids.len());
    let mut student_chunk = vec![-1i64; ts];
    let mut teacher_chunk = vec![-1i64; tt];
    let mut next = 0i64;
    let mut student_loss_from = ts;
    for c in &pair.chunks {
        let trained = c.bytes.end > loss_start || (loss_start == 0 && c.bytes.is_empty());
        if !trained {
            continue;
        }
        student_loss_from = student_loss_from.min(c.student.start.max(1));
        if c.student.start == 0 || c.teacher.start == 0 {
            continue;
        }
        for j in c.student.clone() {
            student_chunk[j - 1] = next;
        }
        for j in c.teacher.clone() {
            teacher_chunk[j - 1] = next;
        }
        next += 1;
    }
    let student_loss_tokens = ts.saturating_sub(student_loss_from);
    CrossLayout {
        student_chunk,
        teacher_chunk,
        chunks: next as usize,
        student_loss_from,
        student_loss_tokens,
    }
}

/// Across tokenizers, the teacher rows a pair is trained on (row p scores token p + 1): those of
/// the chunks in the loss region.
pub fn trained_teacher_rows(
    pair: &crate::align::TokenizedPair,
    loss_start: usize,
) -> impl Iterator<Item = usize> {
    cross_layout(pair, loss_start)
        .teacher_chunk
        .into_iter()
        .enumerate()
        .filter(|&(_, c)| c != -1)
        .map(|(p, _)| p)
}

fn check_rows(s: &SequenceScores, len: usize, k: usize) -> Result<()> {
    if s.rows + 1 != len || s.k != k {
        bail!("teacher returned {} rows of k={} for a sequence of {len} tokens (expected {} of k={k})", s.rows, s.k, len - 1);
    }
    Ok(())
}

/// The loss of one micro-batch as one scalar, `[N, V]` logits at once and the decoder through
/// plain autograd (call `backward` on it): the reference for [`micro_grads`]. `scores[i]` is
/// the teacher's answer for `items[i]`.
pub fn micro_loss(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(Tensor, MicroOut)> {
    if items.is_empty() || items.len() != scores.len() {
        bail!(
            "micro-batch of {} items with {} teacher answers",
            items.len(),
            scores.len()
        );
    }
    let (loss, mut out) = match ctx.pairing {
        Pairing::Same => same_tokenizer(ctx, items, scores, norm)?,
        Pairing::Cross(projection) | Pairing::Mixture(projection) => {
            cross_tokenizer(ctx, projection, items, scores, norm)?
        }
    };
    out.units = units(items);
    Ok((loss, out))
}

/// The gradients of one micro-batch's loss (every parameter's, the head's included) and what
/// it measured: the loss of [`micro_loss`], with the decoder run by `ctx.head`'s training pass
/// and the LM head + loss in row chunks (`[N, V]` exists for one chunk at a time).
pub fn micro_grads(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(GradStore, MicroOut)> {
    if items.is_empty() || items.len() != scores.len() {
        bail!(
            "micro-batch of {} items with {} teacher answers",
            items.len(),
            scores.len()
        );
    }
    let (grads, sums) = match ctx.pairing {
        Pairing::Same => same_tokenizer_grads(ctx, items, scores, norm)?,
        Pairing::Cross(projection) | Pairing::Mixture(projection) => {
            cross_tokenizer_grads(ctx, projection, items, scores, norm)?
        }
    };
    let out = MicroOut {
        kd: sums.kd,
        ce: sums.ce.filter(|c| c.1 > 0.0).map(|(v, n)| v * norm.ce / n),
        kd_scale: sums.kd_scale,
        units: units(items),
    };
    Ok((grads, out))
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
        let kd = kd_loss(ctx.loss, logits, KdInputs::Topk(&tk), Some(norm.kd))?;
        let ce = if wants_ce(ctx.loss) {
            let tg = Tensor::from_vec(rows.targets[a..a + n].to_vec(), (1, n), device)?;
            let mask = Tensor::ones((1, n), candle_core::DType::F32, device)?;
            let (ce, count) = cross_entropy(logits, &tg, &mask, Some(norm.ce))?;
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
        let (b, t) = tb.ids.dims2()?;
        let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
        let all_targets: Vec<u32> = tb.targets.flatten_all()?.to_vec1()?;
        let sel: Vec<u32> = (0..b * t)
            .filter(|&i| mask[i] > 0.0)
            .map(|i| i as u32)
            .collect();
        if sel.is_empty() {
            bail!("micro-batch has no trained tokens");
        }
        let mut ids = Vec::with_capacity(sel.len() * k);
        let mut lps = Vec::with_capacity(sel.len() * k);
        for &i in &sel {
            let (r, p) = (i as usize / t, i as usize % t);
            ids.extend_from_slice(scores[r].ids_row(p));
            lps.extend_from_slice(scores[r].values_row(p));
        }
        let targets = sel.iter().map(|&i| all_targets[i as usize]).collect();
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
    let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
    let targets: Vec<u32> = tb.targets.flatten_all()?.to_vec1()?;
    let sel: Vec<u32> = (0..b * t)
        .filter(|&i| mask[i] > 0.0)
        .map(|i| i as u32)
        .collect();
    let n = sel.len();
    if n == 0 {
        bail!("micro-batch has no trained tokens");
    }
    let mut ids = Vec::with_capacity(n * k);
    let mut lps = Vec::with_capacity(n * k);
    for &i in &sel {
        let (r, p) = (i as usize / t, i as usize % t);
        ids.extend_from_slice(scores[r].ids_row(p));
        lps.extend_from_slice(scores[r].values_row(p));
    }
    // 2. Student: hidden [B, T, H] -> trained rows [1, N, H] -> logits [1, N, V].
    let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
    let h = hidden.dim(2)?;
    let sel_t = Tensor::from_vec(sel.clone(), n, device)?;
    let rows = hidden
        .reshape((b * t, h))?
        .index_select(&sel_t, 0)?
        .unsqueeze(0)?;
    let logits = model.logits(&rows)?;
    let vocab = logits.dim(2)?;
    let ones = vec![1f32; n];
    let tk = TopkTargets::from_host(1, n, k, &ids, &lps, &ones, vocab, device)?;
    let kd = kd_loss(ctx.loss, &logits, KdInputs::Topk(&tk), Some(norm.kd))?;
    let ce_inputs = if wants_ce(ctx.loss) {
        let tg: Vec<u32> = sel.iter().map(|&i| targets[i as usize]).collect();
        let tg = Tensor::from_vec(tg, (1, n), device)?;
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

/// Whether `[loss] ce` asks for the cross-entropy term.
fn wants_ce(cfg: &LossConfig) -> bool {
    !matches!(cfg.ce, CeConfig::None {})
}

/// The student side of same-tokenizer items, each checked against its teacher answer.
fn same_encodings(items: &[Item], scores: &[&SequenceScores], k: usize) -> Result<Vec<Encoded>> {
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

/// Adds the cross-entropy term (when `ce` gives targets `[B, T]`, mask `[B, T]` and the count of
/// trained tokens) to the distillation loss as `[loss] ce` says, and reports the parts (the
/// caller fills in the units).
fn finish(
    cfg: &LossConfig,
    logits: &Tensor,
    (kd, kd_m): (Tensor, KdMetrics),
    ce: Option<(Tensor, Tensor, usize)>,
    norm: Units,
) -> Result<(Tensor, MicroOut)> {
    let (ce, ce_mean) = match ce {
        Some((targets, mask, n)) if n > 0 => {
            let (ce, _) = cross_entropy(logits, &targets, &mask, Some(norm.ce))?;
            let mean =
                ce.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? * norm.ce / n as f64;
            (Some(ce), Some(mean))
        }
        _ => (None, None),
    };
    let c = combine(&kd, ce.as_ref(), cfg)?;
    Ok((
        c.total,
        MicroOut {
            kd: kd_m,
            ce: ce_mean,
            kd_scale: c.kd_scale,
            units: Units::default(),
        },
    ))
}

fn cross_tokenizer(
    ctx: &LossCtx,
    projection: &Projection,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(Tensor, MicroOut)> {
    let (xb, enc) = xtoken_batch(items, scores, ctx.k)?;
    let tb = pad_batch(&enc, 0, ctx.device)?;
    let logits = ctx.model.forward(&tb.ids)?; // [B, Ts, V]
    let kd = kd_loss(
        ctx.loss,
        &logits,
        KdInputs::XToken {
            batch: &xb,
            projection,
        },
        Some(norm.kd),
    )?;
    let ce_inputs = wants_ce(ctx.loss).then(|| (tb.targets.clone(), tb.mask.clone(), tb.n_targets));
    finish(ctx.loss, &logits, kd, ce_inputs, norm)
}

/// Cross tokenizer, chunked: pieces of the batch cut at alignment-chunk boundaries
/// ([`super::xpieces`]), each with its own chunk losses and cross-entropy.
fn cross_tokenizer_grads(
    ctx: &LossCtx,
    projection: &Projection,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<(GradStore, HeadSums)> {
    let (model, device) = (ctx.model, ctx.device);
    let (xb, enc) = xtoken_batch(items, scores, ctx.k)?;
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
    let plan = super::xpieces::plan(&xb, per, &wanted);
    let pieces: Vec<head::Piece> = plan
        .iter()
        .map(|p| head::Piece {
            rows: p.rows(ts),
            shape: (p.segments.len(), p.student_len),
        })
        .collect();
    let loss = |i: usize, logits: &Tensor| -> Result<ChunkLoss> {
        let sub = super::xpieces::batch(&xb, &plan[i]);
        let inputs = KdInputs::XToken {
            batch: &sub,
            projection,
        };
        let kd = kd_loss(ctx.loss, logits, inputs, Some(norm.kd))?;
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

/// The cross-tokenizer loss input for aligned items, plus the student side as `Encoded`s.
pub fn xtoken_batch(
    items: &[Item],
    scores: &[&SequenceScores],
    k: usize,
) -> Result<(XTokenBatch, Vec<Encoded>)> {
    let b = items.len();
    let mut layouts = Vec::with_capacity(b);
    let mut enc = Vec::with_capacity(b);
    for (it, s) in items.iter().zip(scores) {
        let Item::Cross { pair, loss_start } = it else {
            bail!("mixed same/cross-tokenizer micro-batch")
        };
        check_rows(s, pair.teacher_ids.len(), k)?;
        let l = cross_layout(pair, *loss_start);
        enc.push(Encoded {
            ids: pair.student_ids.clone(),
            loss_from: l.student_loss_from,
        });
        layouts.push((pair, l));
    }
    let ts = layouts
        .iter()
        .map(|(p, _)| p.student_ids.len())
        .max()
        .unwrap_or(1);
    let tt = layouts
        .iter()
        .map(|(p, _)| p.teacher_ids.len())
        .max()
        .unwrap_or(1);
    let mut x = XTokenBatch {
        batch: b,
        student_len: ts,
        teacher_len: tt,
        k,
        student_chunk: vec![-1; b * ts],
        teacher_chunk: vec![-1; b * tt],
        num_chunks: vec![0; b],
        student_targets: vec![0; b * ts],
        teacher_targets: vec![0; b * tt],
        teacher_topk_ids: vec![0; b * tt * k],
        teacher_topk_logprobs: vec![0.0; b * tt * k],
        teacher_target_logprobs: vec![0.0; b * tt],
    };
    for (r, ((pair, l), s)) in layouts.iter().zip(scores).enumerate() {
        x.num_chunks[r] = l.chunks;
        x.student_chunk[r * ts..r * ts + l.student_chunk.len()].copy_from_slice(&l.student_chunk);
        x.teacher_chunk[r * tt..r * tt + l.teacher_chunk.len()].copy_from_slice(&l.teacher_chunk);
        for p in 0..pair.student_ids.len() - 1 {
            x.student_targets[r * ts + p] = pair.student_ids[p + 1];
        }
        for p in 0..s.rows {
            x.teacher_targets[r * tt + p] = pair.teacher_ids[p + 1];
            let dst = (r * tt + p) * k;
            x.teacher_topk_ids[dst..dst + k].copy_from_slice(s.ids_row(p));
            x.teacher_topk_logprobs[dst..dst + k].copy_from_slice(s.values_row(p));
            x.teacher_target_logprobs[r * tt + p] = s.target_logprobs[p];
        }
    }
    Ok((x, enc))
}

/// Validation figures of one micro-batch, without gradients: forward KL to the teacher over its
/// top-k with a tail bucket (same tokenizer) or chunk-level P-KL in NeMo's renormalised form
/// (cross tokenizer), and the student's cross-entropy, at `ctx.loss`'s temperature. Returns sums
/// (not means) with their counts. The head runs in forward-only row chunks (`ctx.head`), cut as
/// the training path cuts them.
pub fn validation_sums(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
) -> Result<ValSums> {
    let (model, k, device, temperature) = (ctx.model, ctx.k, ctx.device, ctx.loss.temperature);
    let tau2 = temperature * temperature;
    let vocab = model.lm_head().dim(0)?;
    let per = ctx.head.rows(vocab);
    let mut out = ValSums::default();
    // Adds a chunk's mean CE over its `n` targets (mean: no normalizer given).
    let add_ce = |out: &mut ValSums, logits: &Tensor, tg: Tensor, mask: Tensor| -> Result<()> {
        let (ce, n) = cross_entropy(logits, &tg, &mask, None)?;
        if n > 0.0 {
            out.ce += ce.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? * n;
            out.ce_tokens += n;
        }
        Ok(())
    };
    match ctx.pairing {
        Pairing::Same => {
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
                out.kl +=
                    kl.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? / tau2 * m.count;
                out.kl_units += m.count;
                let tg = Tensor::from_vec(rows.targets[a..a + n].to_vec(), (1, n), device)?;
                let mask = Tensor::ones((1, n), candle_core::DType::F32, device)?;
                add_ce(&mut out, logits, tg, mask)
            })?;
        }
        Pairing::Cross(proj) | Pairing::Mixture(proj) => {
            let (xb, enc) = xtoken_batch(items, scores, k)?;
            let tb = pad_batch(&enc, 0, device)?;
            let ts = tb.ids.dim(1)?;
            let targets: Vec<u32> = tb.targets.flatten_all()?.to_vec1()?;
            let mask: Vec<f32> = tb.mask.flatten_all()?.to_vec1()?;
            let wanted: Vec<bool> = (0..mask.len())
                .map(|i| xb.student_chunk[i] != -1 || mask[i] > 0.0)
                .collect();
            let plan = super::xpieces::plan(&xb, per, &wanted);
            let pieces: Vec<head::Piece> = plan
                .iter()
                .map(|p| head::Piece {
                    rows: p.rows(ts),
                    shape: (p.segments.len(), p.student_len),
                })
                .collect();
            // Same tokenizer: a tail bucket; P-KL: NeMo's renormalised form, whose validation
            // figures are comparable with theirs (the bucket adds a floor wherever K holds a
            // teacher token no student token spells, docs/losses.md).
            let cfg = LossConfig {
                kd: match ctx.pairing {
                    Pairing::Mixture(_) => crate::loss::KdConfig::FirstKl {},
                    _ => crate::loss::KdConfig::Pkl {
                        anchor: Default::default(),
                    },
                },
                tail: None,
                temperature,
                kd_weight: 1.0,
                ce: CeConfig::None {},
            };
            let hidden = model.forward_hidden(&tb.ids, None, None, None)?;
            head::forward_only(model, &hidden, &pieces, |i, logits| {
                let sub = super::xpieces::batch(&xb, &plan[i]);
                let inputs = KdInputs::XToken {
                    batch: &sub,
                    projection: proj,
                };
                let (kl, m) = kd_loss(&cfg, logits, inputs, None)?;
                if m.count > 0.0 {
                    out.kl +=
                        kl.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? / tau2 * m.count;
                    out.kl_units += m.count;
                }
                let rows = &pieces[i].rows;
                let shape = pieces[i].shape;
                let tg: Vec<u32> = rows.iter().map(|&r| targets[r as usize]).collect();
                let m: Vec<f32> = rows.iter().map(|&r| mask[r as usize]).collect();
                let tg = Tensor::from_vec(tg, shape, device)?;
                let m = Tensor::from_vec(m, shape, device)?;
                add_ce(&mut out, logits, tg, m)
            })?;
        }
    }
    Ok(out)
}

/// The unchunked [`validation_sums`] (`[B, T, V]` logits at once): the reference of its tests.
#[cfg(test)]
pub fn validation_sums_whole(
    ctx: &LossCtx,
    items: &[Item],
    scores: &[&SequenceScores],
) -> Result<ValSums> {
    let (model, k, device, temperature) = (ctx.model, ctx.k, ctx.device, ctx.loss.temperature);
    let ones_cfg = |kd: crate::loss::KdConfig| LossConfig {
        kd,
        // Same tokenizer: a tail bucket; P-KL: NeMo's renormalised form, whose validation
        // figures are comparable with theirs (the bucket adds a floor wherever K holds a teacher
        // token no student token spells, docs/losses.md).
        tail: None,
        temperature,
        kd_weight: 1.0,
        ce: CeConfig::None {},
    };
    // Mean KL (τ² removed) and the student's CE of one micro-batch, as sums with their counts.
    let sums = |kl: &Tensor, units: f64, logits: &Tensor, tb: &TokenBatch| -> Result<ValSums> {
        let (ce, n) = cross_entropy(logits, &tb.targets, &tb.mask, None)?;
        let kl =
            kl.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()? / (temperature * temperature);
        let ce = ce.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        Ok(ValSums {
            kl: kl * units,
            kl_units: units,
            ce: ce * n,
            ce_tokens: n,
        })
    };
    match ctx.pairing {
        Pairing::Same => {
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
            sums(&kl, m.count, &logits, &tb)
        }
        Pairing::Cross(proj) | Pairing::Mixture(proj) => {
            let (xb, enc) = xtoken_batch(items, scores, k)?;
            let tb = pad_batch(&enc, 0, device)?;
            let logits = model.forward(&tb.ids)?;
            let cfg = ones_cfg(match ctx.pairing {
                Pairing::Mixture(_) => crate::loss::KdConfig::FirstKl {},
                _ => crate::loss::KdConfig::Pkl {
                    anchor: Default::default(),
                },
            });
            let (kl, m) = kd_loss(
                &cfg,
                &logits,
                KdInputs::XToken {
                    batch: &xb,
                    projection: proj,
                },
                None,
            )?;
            sums(&kl, m.count, &logits, &tb)
        }
    }
}

/// Sums of validation figures with their counts (means are `kl / kl_units`, `ce / ce_tokens`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ValSums {
    pub kl: f64,
    pub kl_units: f64,
    pub ce: f64,
    pub ce_tokens: f64,
}

impl std::ops::AddAssign for ValSums {
    fn add_assign(&mut self, o: ValSums) {
        self.kl += o.kl;
        self.kl_units += o.kl_units;
        self.ce += o.ce;
        self.ce_tokens += o.ce_tokens;
    }
}

/// What [`accumulate`] measured over a step's micro-batches.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepSums {
    /// Σ over micro-batches of (KD value × step units): divide by `norm.kd` for the step's mean.
    pub kd_sum: f64,
    /// Σ of CE means weighted by their tokens, and the tokens.
    pub ce_sum: f64,
    pub ce_n: f64,
    /// Effective KD multiplier of the last micro-batch (dynamic scaling).
    pub kd_scale: f64,
}

impl std::ops::AddAssign for StepSums {
    /// Sums add; `kd_scale` is the last one's.
    fn add_assign(&mut self, o: StepSums) {
        self.kd_sum += o.kd_sum;
        self.ce_sum += o.ce_sum;
        self.ce_n += o.ce_n;
        self.kd_scale = o.kd_scale;
    }
}

impl StepSums {
    pub fn kd_mean(&self, norm: Units) -> f64 {
        self.kd_sum / norm.kd.max(1.0)
    }
    pub fn ce_mean(&self) -> Option<f64> {
        (self.ce_n > 0.0).then(|| self.ce_sum / self.ce_n)
    }
}

/// Runs `items` in micro-batches of `ctx.micro_batch`, each loss normalised by the whole step's
/// `norm` (so the summed gradients are those of the step's mean), and adds every backward to
/// `acc`.
pub fn accumulate(
    ctx: &LossCtx,
    acc: &mut crate::optim::GradAccumulator,
    items: &[Item],
    scores: &[&SequenceScores],
    norm: Units,
) -> Result<StepSums> {
    let mb = ctx.micro_batch.max(1);
    let mut s = StepSums {
        kd_scale: 1.0,
        ..Default::default()
    };
    for (it, sc) in items.chunks(mb).zip(scores.chunks(mb)) {
        let u = units(it);
        if u.kd == 0.0 {
            continue;
        }
        let (grads, m) = micro_grads(ctx, it, sc, norm)?;
        acc.add(&grads)?;
        s.kd_sum += m.kd.loss * norm.kd;
        if let Some(ce) = m.ce {
            s.ce_sum += ce * u.ce;
            s.ce_n += u.ce;
        }
        s.kd_scale = m.kd_scale;
    }
    Ok(s)
}

#[cfg(test)]
#[path = "step_tests.rs"]
mod tests;
