//! Different tokenizers on the two sides: a record is tokenized for both and aligned into
//! byte-exact chunks ([`crate::align`]); the teacher's rows lie against the student's through
//! the chunks and the projection of the student's vocabulary onto the teacher's. The LM head is
//! cut at alignment-chunk boundaries ([`crate::train::xpieces`]).

use super::{check_rows, Item, Limits, LossCtx, Purpose};
use crate::align::{canonical_text, tokenize_pair, AlignTokenizer, PairOptions, TokenizedPair};
use crate::collate::{pad_batch, Encoded, TokenBatch};
use crate::data::Record;
use crate::loss::{
    kd_loss_figures, CeConfig, KdConfig, KdFigures, KdInputs, KdMetrics, LossConfig, Normalizer,
    Projection, XTokenBatch,
};
use crate::train::head_chunks::Piece;
use crate::train::micro::{wants_ce, Layout, MicroBatch, Part, Units};
use crate::train::xpieces::XPiece;
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::borrow::Cow;
use xdistill_shared::protocol::SequenceScores;

/// Whether `r` exceeds a token limit on either side (without truncation). Texts short enough in
/// bytes are not tokenized; a record that cannot be tokenized is not "too long".
pub fn too_long(
    student: &AlignTokenizer,
    teacher: &AlignTokenizer,
    r: &Record,
    lim: Limits,
) -> bool {
    let (max_s, max_t) = (lim.max_student_tokens, lim.max_teacher_tokens);
    if r.len_bytes() + super::same::SPECIAL_TOKEN_MARGIN <= max_s.min(max_t) {
        return false;
    }
    let opts = PairOptions {
        add_special_tokens: true,
        max_student_tokens: None,
        max_teacher_tokens: None,
    };
    tokenize_pair(&r.text(), student, teacher, opts)
        .is_ok_and(|p| p.student_ids.len() > max_s || p.teacher_ids.len() > max_t)
}

/// Tokenizes one record for both sides and aligns it (both sides truncated at one chunk
/// boundary when `lim.truncate`, else refused over the limits).
pub fn item(
    student: &AlignTokenizer,
    teacher: &AlignTokenizer,
    r: &Record,
    lim: Limits,
) -> std::result::Result<Item, String> {
    let text = r.text();
    let loss_start = r.loss_start_byte();
    let (max_s, max_t) = (lim.max_student_tokens, lim.max_teacher_tokens);
    let opts = PairOptions {
        add_special_tokens: true,
        max_student_tokens: lim.truncate.then_some(max_s),
        max_teacher_tokens: lim.truncate.then_some(max_t),
    };
    // Canonicalisation (e.g. Unicode normalisation) may move bytes: locate the loss start in
    // the canonical text through the canonical prompt.
    let ls = if loss_start == 0 {
        0
    } else {
        canonical_text(
            &text[..loss_start.min(text.len())],
            &student.bytes,
            &teacher.bytes,
        )
        .map(|p| p.len())
        .map_err(|e| e.to_string())?
    };
    let pair = tokenize_pair(&text, student, teacher, opts).map_err(|e| e.to_string())?;
    if pair.student_ids.len() > max_s || pair.teacher_ids.len() > max_t {
        Err(format!(
            "{} student / {} teacher tokens exceed the limits of {max_s} / {max_t}",
            pair.student_ids.len(),
            pair.teacher_ids.len()
        ))
    } else if pair.student_ids.len() < 2 || pair.teacher_ids.len() < 2 {
        Err("fewer than 2 tokens on a side".to_string())
    } else {
        Ok(Item::Cross {
            pair,
            loss_start: ls,
        })
    }
}

/// Trained chunks (the distillation loss) and trained student tokens (cross-entropy).
pub fn units(pair: &TokenizedPair, loss_start: usize) -> Units {
    let layout = cross_layout(pair, loss_start);
    Units {
        kd: layout.chunks as f64,
        ce: layout.student_loss_tokens as f64,
    }
}

/// What a cross-tokenizer pairing's validation reports: P-KL in NeMo's renormalised form, whose
/// figures are comparable with theirs (a tail bucket adds a floor wherever K holds a teacher
/// token no student token spells, docs/losses.md); a chunk-level ensemble reports first-token
/// KL ([`super::mixture::validation_kd`]).
pub fn validation_kd() -> KdConfig {
    KdConfig::Pkl {
        anchor: Default::default(),
    }
}

/// The loss of `cfg` on a part's logits against one kind of teacher answer: what differs between
/// the cross-tokenizer pairings (top-k rows here, the whole distribution in
/// [`super::cross_full`]).
pub trait ChunkTerm {
    fn term(
        &self,
        cp: &CrossPieces,
        cfg: &LossConfig,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)>;
}

/// The teacher's top-k at each chunk, through the projection.
pub struct TopkChunks<'a> {
    pub projection: &'a Projection,
}

impl ChunkTerm for TopkChunks<'_> {
    fn term(
        &self,
        cp: &CrossPieces,
        cfg: &LossConfig,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)> {
        let batch = cp.part_batch(part);
        let inputs = KdInputs::XToken {
            batch: &batch,
            projection: self.projection,
        };
        Ok(kd_loss_figures(cfg, logits, inputs, normalizer)?)
    }
}

/// A cross-tokenizer micro-batch: the student's logits against the teacher through the aligned
/// chunks, the head cut at chunk boundaries ([`CrossPieces`]); `T` reads the teacher's answers.
pub struct CrossBatch<'a, T> {
    ctx: LossCtx<'a>,
    /// The loss validation reports (no CE term: it is summed apart).
    validation: LossConfig,
    cp: CrossPieces,
    teacher: T,
}

impl<'a, T: ChunkTerm> CrossBatch<'a, T> {
    /// `items` laid out against `scores` (answers of `ctx.k` entries; 0: hidden states).
    pub fn new(
        ctx: LossCtx<'a>,
        teacher: T,
        validation: LossConfig,
        items: &[Item],
        scores: &[&SequenceScores],
        purpose: Purpose,
    ) -> Result<CrossBatch<'a, T>> {
        let with_ce = purpose == Purpose::Validate || wants_ce(ctx.loss);
        let cp = CrossPieces::new(&ctx, items, scores, ctx.k, with_ce)?;
        Ok(CrossBatch {
            ctx,
            validation,
            cp,
            teacher,
        })
    }
}

impl<T: ChunkTerm> MicroBatch for CrossBatch<'_, T> {
    fn layout(&self) -> &Layout {
        &self.cp.layout
    }

    fn kd(
        &self,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)> {
        self.teacher
            .term(&self.cp, self.ctx.loss, part, logits, normalizer)
    }

    fn val_kd(&self, part: Part, logits: &Tensor) -> Result<Option<(Tensor, KdMetrics)>> {
        let (kl, figures) = self
            .teacher
            .term(&self.cp, &self.validation, part, logits, None)?;
        Ok(Some((kl, figures.read()?)))
    }

    fn ce(&self, part: Part) -> Result<(Tensor, Tensor, usize)> {
        self.cp.ce_inputs(part, self.ctx.device)
    }
}

/// The top-k pairing's micro-batch: validation reports `validation_kd` at the run's temperature.
pub fn topk_batch<'a>(
    ctx: LossCtx<'a>,
    projection: &'a Projection,
    validation_kd: KdConfig,
    items: &[Item],
    scores: &[&SequenceScores],
    purpose: Purpose,
) -> Result<CrossBatch<'a, TopkChunks<'a>>> {
    let validation = LossConfig {
        kd: validation_kd,
        tail: None,
        temperature: ctx.loss.temperature,
        kd_weight: 1.0,
        ce: CeConfig::None {},
    };
    let teacher = TopkChunks { projection };
    CrossBatch::new(ctx, teacher, validation, items, scores, purpose)
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

/// A cross-tokenizer micro-batch cut into LM-head pieces at alignment-chunk boundaries
/// ([`crate::train::xpieces`]), with what each piece's cross-entropy reads: shared by the
/// top-k and the hidden-state pairings, for training and validation.
pub struct CrossPieces {
    pub xb: XTokenBatch,
    pub tb: TokenBatch,
    /// `[B·Ts]` the student token each position predicts, and whether it is trained.
    targets: Vec<u32>,
    mask: Vec<f32>,
    pub plan: Vec<XPiece>,
    /// The head's pieces, cut at chunk boundaries; the reference takes every position.
    pub layout: Layout,
}

impl CrossPieces {
    /// The batch of `items` (answers of `k` entries) in pieces of at most the head's rows;
    /// positions outside every chunk are kept only for the CE when `with_ce`.
    pub fn new(
        ctx: &LossCtx,
        items: &[Item],
        scores: &[&SequenceScores],
        k: usize,
        with_ce: bool,
    ) -> Result<CrossPieces> {
        let (xb, enc) = xtoken_batch(items, scores, k)?;
        let tb = pad_batch(&enc, 0, ctx.vocab(), ctx.device)?;
        let ts = tb.ids.dim(1)?;
        let (targets, mask) = (tb.host_targets.clone(), tb.host_mask.clone());
        let wanted: Vec<bool> = (0..mask.len())
            .map(|i| xb.student_chunk[i] != -1 || (with_ce && mask[i] > 0.0))
            .collect();
        let per = ctx.head.rows(ctx.model.lm_head().dim(0)?);
        let plan = crate::train::xpieces::plan(&xb, per, &wanted);
        let pieces = plan
            .iter()
            .map(|p| Piece {
                rows: p.rows(ts),
                shape: (p.segments.len(), p.student_len),
            })
            .collect();
        let (b, ts) = (xb.batch, xb.student_len);
        let whole = Piece {
            rows: (0..(b * ts) as u32).collect(),
            shape: (b, ts),
        };
        let layout = Layout {
            ids: tb.ids.clone(),
            pieces,
            whole,
        };
        Ok(CrossPieces {
            xb,
            tb,
            targets,
            mask,
            plan,
            layout,
        })
    }

    /// Piece `i`'s own loss inputs (its chunks renumbered).
    pub fn batch(&self, i: usize) -> XTokenBatch {
        crate::train::xpieces::batch(&self.xb, &self.plan[i])
    }

    /// Piece `part`'s own loss inputs (the whole batch's, or a piece's with its chunks
    /// renumbered).
    pub fn part_batch(&self, part: Part) -> Cow<'_, XTokenBatch> {
        match part {
            Part::Whole => Cow::Borrowed(&self.xb),
            Part::Piece(i) => Cow::Owned(self.batch(i)),
        }
    }

    /// `part`'s CE targets and mask, shaped as its logits, and its trained-token count.
    pub fn ce_inputs(
        &self,
        part: Part,
        device: &candle_core::Device,
    ) -> Result<(Tensor, Tensor, usize)> {
        let i = match part {
            Part::Whole => {
                let tb = &self.tb;
                return Ok((tb.targets.clone(), tb.mask.clone(), tb.n_targets));
            }
            Part::Piece(i) => i,
        };
        let piece = &self.layout.pieces[i];
        let (rows, shape) = (&piece.rows, piece.shape);
        let tg: Vec<u32> = rows.iter().map(|&r| self.targets[r as usize]).collect();
        let m: Vec<f32> = rows.iter().map(|&r| self.mask[r as usize]).collect();
        let n = m.iter().filter(|&&x| x > 0.0).count();
        Ok((
            Tensor::from_vec(tg, shape, device)?,
            Tensor::from_vec(m, shape, device)?,
            n,
        ))
    }
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
    let mut x = XTokenBatch::empty(b, ts, tt, k);
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
            // Hidden-state answers carry no log-probs (the trainer applies the teacher's head).
            if s.hidden.is_empty() {
                x.teacher_target_logprobs[r * tt + p] = s.target_logprobs[p];
            }
        }
    }
    Ok((x, enc))
}
