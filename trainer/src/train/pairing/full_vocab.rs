//! The same tokenizer with the teacher's **whole** distribution (`teacher.transport =
//! "hidden"`): the teacher sends its final hidden states per position, and the loss applies the
//! teacher's own LM head ([`TeacherHead`]) chunk by chunk beside the student's
//! ([`crate::loss::full_vocab`]): exact forward KL, reverse KL or JSD(β) over every token, no
//! top-k set and no tail bucket. Records are encoded as in [`super::same`]; position `p` of the
//! teacher's answer lies against the student's position `p`.

use super::same::same_encodings;
use super::{Item, LossCtx, Purpose, TrainedRows};
use crate::collate::pad_batch;
use crate::loss::full_vocab::{
    full_vocab_divergence, teacher_token_logprobs, TeacherHead, DEFAULT_CHUNK_ROWS,
};
use crate::loss::kl::Divergence;
use crate::loss::{kd_loss_figures, KdFigures, KdInputs, KdMetrics, Normalizer, Temperature};
use crate::train::micro::{Layout, MicroBatch, Part, RowPieces};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use xdistill_shared::protocol::SequenceScores;

/// A micro-batch against the teacher's whole distribution: the student's trained positions,
/// each with the teacher's hidden state at the same position.
pub struct FullVocabBatch<'a> {
    ctx: LossCtx<'a>,
    head: &'a TeacherHead,
    rows: TrainedRows<Vec<f32>>,
    layout: RowPieces,
}

impl<'a> FullVocabBatch<'a> {
    /// `items` (checked against answers carrying hidden rows and no top-k: `k` = 0).
    pub fn new(
        ctx: LossCtx<'a>,
        head: &'a TeacherHead,
        items: &[Item],
        scores: &[&SequenceScores],
        purpose: Purpose,
    ) -> Result<FullVocabBatch<'a>> {
        let enc = same_encodings(items, scores, 0)?;
        let tb = pad_batch(&enc, 0, ctx.vocab(), ctx.device)?;
        let hsz = head.hidden_size();
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
        // `[N, H]` the teacher's final-norm hidden states at the trained positions.
        let (rows, layout) = TrainedRows::lay_out(&ctx, &tb, purpose, |r, p, h: &mut Vec<f32>| {
            h.extend(hidden_row(scores[r], r, p, hsz)?);
            Ok(())
        })?;
        Ok(FullVocabBatch {
            ctx,
            head,
            rows,
            layout,
        })
    }

    /// The student logits `[1, n, V_s]` of `part` cut to the teacher's vocabulary (columns past
    /// it are the student's padding, not tokens), the teacher's hidden states `[1, n, H]` there
    /// and a mask of ones.
    fn inputs(&self, part: Part, logits: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let r = self.layout.range(part);
        let (n, hsz, vocab) = (r.len(), self.head.hidden_size(), self.head.vocab());
        let v = logits.dim(2)?;
        if v < vocab {
            bail!("the student has {v} logits per position, the teacher {vocab} tokens");
        }
        let logits = if v > vocab {
            logits.narrow(2, 0, vocab)?
        } else {
            logits.clone()
        };
        let device = self.ctx.device;
        let hidden = &self.rows.teacher[r.start * hsz..r.end * hsz];
        let hid = Tensor::from_slice(hidden, (1, n, hsz), device)?;
        let mask = Tensor::ones((1, n), DType::F32, device)?;
        Ok((logits, hid, mask))
    }
}

impl MicroBatch for FullVocabBatch<'_> {
    fn layout(&self) -> &Layout {
        &self.layout.layout
    }

    /// The run's divergence (forward KL, reverse KL or JSD) over every token.
    fn kd(
        &self,
        part: Part,
        logits: &Tensor,
        normalizer: Option<Normalizer>,
    ) -> Result<(Tensor, KdFigures)> {
        let (logits, hidden, mask) = self.inputs(part, logits)?;
        let inputs = KdInputs::TeacherHidden {
            head: self.head,
            hidden: &hidden,
            mask: &mask,
        };
        Ok(kd_loss_figures(self.ctx.loss, &logits, inputs, normalizer)?)
    }

    /// Exact forward KL to the teacher over the whole vocabulary.
    fn val_kd(&self, part: Part, logits: &Tensor) -> Result<Option<(Tensor, KdMetrics)>> {
        let (logits, hidden, mask) = self.inputs(part, logits)?;
        let (kl, figures) = full_vocab_divergence(
            &logits,
            self.head,
            &hidden,
            &mask,
            Divergence::Forward,
            self.ctx.loss.temperature,
            DEFAULT_CHUNK_ROWS,
            None,
        )?;
        Ok(Some((kl, figures.read()?)))
    }

    fn ce(&self, part: Part) -> Result<(Tensor, Tensor, usize)> {
        self.layout.ce(part, &self.rows.targets, self.ctx.device)
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
