//! Exact full-vocabulary distillation from the teacher's **hidden states** and its **LM head**
//! (issue 32): the trainer-side math, as pure functions of candle tensors.
//!
//! The teacher sends its final hidden states `[N, H]` (after the final norm, before the LM head:
//! 2·H bytes per position in bf16, 148× less than its bf16 logits for Qwen3-0.6B), and the
//! student side holds a copy of the teacher's output head ([`TeacherHead`]: weight `[R, H]`,
//! optional bias, final logit scale, optional soft-cap, `vocab ≤ R` real tokens). The teacher's
//! full distribution is rebuilt here, `chunk_rows` positions at a time, and compared with the
//! student's over the **whole** vocabulary: no top-k set, no tail bucket.
//!
//! Per valid position (`τ` = temperature, rows of the head past `vocab` are masked out, i.e.
//! never computed):
//!
//! ```text
//! z_T   = scale · (W h + b)                 (W, b: the first `vocab` rows)
//! z_T   = c · tanh(z_T / c)                 (only with a soft-cap c, Gemma-2/3 style)
//! lp_T  = log_softmax(z_T / τ),  lp_S = log_softmax(z_S / τ)      (over all `vocab` ids)
//! forward  D = Σ p_T (lp_T − lp_S)
//! reverse  D = Σ p_S (lp_S − lp_T)
//! jsd(β)   D = β Σ p_T (lp_T − lM) + (1−β) Σ p_S (lp_S − lM),  lM = logaddexp(lp_T + ln β, lp_S + ln(1−β))
//!          (TRL convention, as `loss::kl`: β = 0 is exactly forward KL, β = 1 exactly reverse KL)
//! loss = τ² · Σ_valid D / N      (N = `normalizer`, else the number of valid positions)
//! ```
//!
//! **Memory.** Everything is computed `chunk_rows` valid positions at a time, so the largest
//! temporaries are `[chunk_rows, vocab]`; the only `[N, vocab]` tensor the loss makes is the
//! gradient with respect to the student logits (which the backward pass produces anyway). The
//! gradient is computed in closed form chunk by chunk (no autograd graph per chunk):
//! `∂D/∂s_j = p_S,j (g_j − Σ_i p_S,i g_i)` with `s = z_S/τ` and `g = ∂D/∂p_S`, i.e.
//!
//! ```text
//! forward  ∂D/∂s = p_S · Σ p_T − p_T
//! reverse  ∂D/∂s = p_S ⊙ (lp_S − lp_T − D)
//! jsd(β)   ∂D/∂s = (1−β) · p_S ⊙ (h − Σ p_S h),  h = lp_S − lM
//! ```
//!
//! and returned through a surrogate scalar `Σ z_S ⊙ sg(G) − sg(Σ z_S ⊙ G) + value` whose value is
//! the loss and whose first derivative with respect to the student logits is `G` exactly (higher
//! derivatives are not provided). Tests check the value against an f64 loop reference, the
//! gradient against finite differences and against candle's autograd through the top-k path with
//! K = the whole vocabulary.
//!
//! **Fingerprint.** [`TeacherHead::fingerprint`] names a head (SHA-256 hex) so that a trainer and a
//! teacher can check that they hold the same head before trusting hidden states.
//!
//! # Across tokenizers
//!
//! Everything above needs the teacher's tokens among the student's (`V_s ≥ vocab`). Across
//! tokenizers, [`super::xtoken_full`] has first-token KL and P-KL over the teacher's whole
//! distribution at each chunk's anchor (P-KL projects the chunk's student distribution onto
//! every teacher id through W; a teacher token no student token spells keeps a floored `Q`, so
//! its mass is an irreducible part of that loss, as with top-k).

use candle_core::{DType, Tensor, D};
use sha2::{Digest, Sha256};

use super::kl::Divergence;
use super::stable::{log_softmax_last, logaddexp};
use super::{compute_dtype, KdFigures, LossError, Normalizer, Result, Temperature};

/// Positions per chunk when the caller has no better figure: `[64, V]` f32 is 39 MB for Qwen3.
pub const DEFAULT_CHUNK_ROWS: usize = 64;

/// Domain tag hashed first by [`TeacherHead::fingerprint`] (bump when the layout changes).
const FINGERPRINT_TAG: &[u8] = b"xdistill.teacher_head.v1\0";

/// The teacher's output head as the student side holds it.
#[derive(Debug, Clone)]
pub struct TeacherHead {
    weight: Tensor,
    bias: Option<Tensor>,
    scale: f64,
    softcap: Option<f64>,
    vocab: usize,
}

impl TeacherHead {
    /// A validated head.
    ///
    /// * `weight`: `[R, H]` (f32 or bf16; f16 and f64 also accepted), on the student's device.
    /// * `bias`: optional `[R]`, same device.
    /// * `scale`: final logit multiplier (1 for most models), finite and > 0.
    /// * `softcap`: `Some(c)` applies `c · tanh(z / c)` after the scale (Gemma 2/3's
    ///   `final_logit_softcapping`), `c` finite and > 0.
    /// * `vocab`: the real token count, `1 ≤ vocab ≤ R`; rows `vocab..R` (Qwen3's padding:
    ///   151,936 rows for 151,669 tokens) are masked out: probability 0, never computed.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        scale: f64,
        softcap: Option<f64>,
        vocab: usize,
    ) -> Result<Self> {
        let (rows, hidden) = match *weight.dims() {
            [r, h] => (r, h),
            ref d => {
                return Err(LossError::input(
                    "head.weight",
                    format!("must be [V, H], got shape {d:?}"),
                ))
            }
        };
        if rows == 0 || hidden == 0 {
            return Err(LossError::input(
                "head.weight",
                format!("empty head [{rows}, {hidden}]"),
            ));
        }
        if !is_float(weight.dtype()) {
            return Err(LossError::input(
                "head.weight",
                format!("must be a float tensor, got {:?}", weight.dtype()),
            ));
        }
        if vocab == 0 || vocab > rows {
            return Err(LossError::input(
                "head.vocab",
                format!("the head has {rows} rows, vocab must be in 1..={rows}, got {vocab}"),
            ));
        }
        if let Some(b) = &bias {
            if b.dims() != [rows] {
                return Err(LossError::input(
                    "head.bias",
                    format!("must be [{rows}], got {:?}", b.dims()),
                ));
            }
            if !is_float(b.dtype()) {
                return Err(LossError::input("head.bias", "must be a float tensor"));
            }
            if !b.device().same_device(weight.device()) {
                return Err(LossError::input(
                    "head.bias",
                    "on another device than the weight",
                ));
            }
        }
        if !(scale.is_finite() && scale > 0.0) {
            return Err(LossError::input(
                "head.scale",
                format!("must be finite and > 0, got {scale}"),
            ));
        }
        if let Some(c) = softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(LossError::input(
                    "head.softcap",
                    format!("must be finite and > 0, got {c}"),
                ));
            }
        }
        Ok(Self {
            weight,
            bias,
            scale,
            softcap,
            vocab,
        })
    }

    /// `[R, H]` as given.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    pub fn scale(&self) -> f64 {
        self.scale
    }
    pub fn softcap(&self) -> Option<f64> {
        self.softcap
    }
    /// Real tokens (columns of the distributions this module produces).
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// Rows of the weight, `≥ vocab`.
    pub fn rows(&self) -> usize {
        self.weight.dims()[0]
    }
    /// H.
    pub fn hidden_size(&self) -> usize {
        self.weight.dims()[1]
    }

    /// SHA-256 (lowercase hex) of the head, over, in this order:
    /// the tag `b"xdistill.teacher_head.v1\0"`; `R`, `H`, `vocab` as u64 little-endian; every
    /// weight element as f32 little-endian bytes, row by row (all `R` rows, padding included;
    /// bf16/f16 convert exactly, f64 is rounded to f32); a byte 0 (no bias) or 1 followed by the
    /// `R` bias values as f32 LE; `scale` as f64 LE; a byte 0 (no soft-cap) or 1 followed by `c`
    /// as f64 LE. A bf16 head and its f32 upcast have the same fingerprint.
    pub fn fingerprint(&self) -> Result<String> {
        let (rows, hidden) = (self.rows(), self.hidden_size());
        let mut h = Sha256::new();
        h.update(FINGERPRINT_TAG);
        for x in [rows, hidden, self.vocab] {
            h.update((x as u64).to_le_bytes());
        }
        // Blocks of about 4 Mi elements: the host never holds the whole head.
        let block = (1 << 22) / hidden.max(1);
        let block = block.max(1);
        let mut r0 = 0;
        while r0 < rows {
            let n = block.min(rows - r0);
            hash_f32(&mut h, &self.weight.narrow(0, r0, n)?)?;
            r0 += n;
        }
        match &self.bias {
            None => h.update([0u8]),
            Some(b) => {
                h.update([1u8]);
                hash_f32(&mut h, b)?;
            }
        }
        h.update(self.scale.to_le_bytes());
        match self.softcap {
            None => h.update([0u8]),
            Some(c) => {
                h.update([1u8]);
                h.update(c.to_le_bytes());
            }
        }
        Ok(hex::encode(h.finalize()))
    }

    /// The final teacher logits (scale and soft-cap applied, before any temperature) for a
    /// chunk of positions: `hidden [n, H] -> [n, vocab]`, in f64 when `hidden` is f64, else f32.
    pub fn logits_chunk(&self, hidden: &Tensor) -> Result<Tensor> {
        self.check_hidden(hidden, 2)?;
        let dt = compute_dtype(hidden);
        self.prepare(dt)?.logits(hidden)
    }

    /// Checks `hidden [.., H]` of rank `rank` against the head.
    fn check_hidden(&self, hidden: &Tensor, rank: usize) -> Result<()> {
        let dims = hidden.dims();
        if dims.len() != rank || dims[rank - 1] != self.hidden_size() {
            return Err(LossError::input(
                "hidden",
                format!(
                    "expected rank {rank} with H = {} last, got shape {dims:?}",
                    self.hidden_size()
                ),
            ));
        }
        if !is_float(hidden.dtype()) {
            return Err(LossError::input("hidden", "must be a float tensor"));
        }
        if !hidden.device().same_device(self.weight.device()) {
            return Err(LossError::input(
                "hidden",
                "on another device than the head",
            ));
        }
        Ok(())
    }

    /// The head's first `vocab` rows in the compute dtype (a bf16 head is upcast once per call:
    /// `vocab·H·4` transient bytes).
    fn prepare(&self, dt: DType) -> Result<Prepared> {
        let w = self
            .weight
            .narrow(0, 0, self.vocab)?
            .detach()
            .to_dtype(dt)?;
        let b = match &self.bias {
            Some(b) => Some(b.narrow(0, 0, self.vocab)?.detach().to_dtype(dt)?),
            None => None,
        };
        Ok(Prepared {
            w,
            b,
            scale: self.scale,
            softcap: self.softcap,
            dt,
        })
    }
}

/// A head ready for one call: `[vocab, H]` in the compute dtype.
struct Prepared {
    w: Tensor,
    b: Option<Tensor>,
    scale: f64,
    softcap: Option<f64>,
    dt: DType,
}

impl Prepared {
    /// `[n, H] -> [n, vocab]` final logits (no gradient).
    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = hidden.detach().to_dtype(self.dt)?;
        let mut z = h.matmul(&self.w.t()?)?;
        if let Some(b) = &self.b {
            z = z.broadcast_add(b)?;
        }
        if self.scale != 1.0 {
            z = z.affine(self.scale, 0.0)?;
        }
        if let Some(c) = self.softcap {
            z = z.affine(1.0 / c, 0.0)?.tanh()?.affine(c, 0.0)?;
        }
        Ok(z)
    }
}

fn is_float(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::BF16 | DType::F16 | DType::F64)
}

fn hash_f32(h: &mut Sha256, t: &Tensor) -> Result<()> {
    let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut bytes = Vec::with_capacity(v.len() * 4);
    for x in v {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    h.update(&bytes);
    Ok(())
}

/// The teacher's log-probabilities `log_softmax(z_T / temperature)` for a chunk of positions,
/// `hidden [n, H] -> [n, vocab]` (f64 when `hidden` is f64, else f32; no gradient).
pub fn teacher_log_softmax_chunk(
    head: &TeacherHead,
    hidden: &Tensor,
    temperature: Temperature,
) -> Result<Tensor> {
    let temperature = temperature.get();
    let z = head.logits_chunk(hidden)?;
    log_softmax_last(&scaled(&z, 1.0 / temperature)?)
}

/// The teacher's log-prob of one token per position, `log_softmax(z_T / τ)[target]`: what the
/// top-k transport's `target_logprobs` carries, rebuilt from the hidden-state transport.
///
/// * `hidden`: `[N, H]` the teacher's final hidden states; `targets`: `[N]` u32 ids `< vocab`.
/// * `chunk_rows` positions at a time (≥ 1): `[chunk_rows, vocab]` bounds the temporaries.
///
/// Returns `[N]` f32 (f64 when the head and states are f64).
pub fn teacher_token_logprobs(
    head: &TeacherHead,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: Temperature,
    chunk_rows: usize,
) -> Result<Tensor> {
    let (n, h) = hidden.dims2()?;
    if h != head.hidden_size() {
        return Err(LossError::input(
            "hidden",
            format!("H = {h}, the head has H = {}", head.hidden_size()),
        ));
    }
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        return Err(LossError::input(
            "targets",
            format!(
                "must be [{n}] u32, got {:?} {:?}",
                targets.dims(),
                targets.dtype()
            ),
        ));
    }
    if chunk_rows == 0 {
        return Err(LossError::input("chunk_rows", "must be at least 1"));
    }
    if n > 0 {
        let max = targets.max(0)?.to_scalar::<u32>()?;
        if max as usize >= head.vocab() {
            return Err(LossError::input(
                "targets",
                format!("id {max} is outside the teacher's {} tokens", head.vocab()),
            ));
        }
    }
    let mut out = Vec::with_capacity(n.div_ceil(chunk_rows));
    let mut r0 = 0;
    while r0 < n {
        let m = chunk_rows.min(n - r0);
        let lp = teacher_log_softmax_chunk(head, &hidden.narrow(0, r0, m)?, temperature)?;
        let t = targets.narrow(0, r0, m)?.unsqueeze(1)?;
        out.push(lp.gather(&t, 1)?.squeeze(1)?);
        r0 += m;
    }
    if out.is_empty() {
        return Ok(Tensor::zeros(0, compute_dtype(hidden), hidden.device())?);
    }
    Ok(Tensor::cat(&out, 0)?)
}

/// Exact full-vocabulary divergence between the student and the teacher rebuilt from its hidden
/// states and head.
///
/// * `student_logits`: `[N, V]` or `[B, T, V]` (any float dtype; computed in f32, or f64 when
///   given f64), `V == head.vocab()` (a student with a padded head: narrow its logits to the
///   real vocabulary first).
/// * `hidden`: the teacher's final hidden states, the same leading dims with `H` last.
/// * `mask`: the leading dims (`[N]` or `[B, T]`), values 0 or 1. Masked positions may hold
///   anything (NaN included) in `student_logits` and `hidden`: they are never read.
/// * `div`: forward, reverse or JSD(β), β ∈ [0, 1] (TRL convention, as [`super::kl`]).
/// * `temperature` τ: both sides' logits are divided by τ, the loss is multiplied by τ².
/// * `chunk_rows`: valid positions per chunk (≥ 1); `[chunk_rows, vocab]` bounds the temporaries.
/// * `normalizer`: divide by this instead of the local valid count (gradient accumulation).
///
/// Returns `τ² · Σ_valid D / N` (a scalar in the compute dtype, differentiable with respect to
/// `student_logits`) and detached metrics (`teacher_topk_mass`/`student_topk_mass` are `None`:
/// there is no top-k set).
#[allow(clippy::too_many_arguments)]
pub fn full_vocab_divergence(
    student_logits: &Tensor,
    head: &TeacherHead,
    hidden: &Tensor,
    mask: &Tensor,
    div: Divergence,
    temperature: Temperature,
    chunk_rows: usize,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let rank = student_logits.rank();
    if rank < 2 {
        return Err(LossError::input(
            "student_logits",
            format!(
                "must be [N, V] or [B, T, V], got {:?}",
                student_logits.dims()
            ),
        ));
    }
    head.check_hidden(hidden, rank)?;
    let lead = &student_logits.dims()[..rank - 1];
    if &hidden.dims()[..rank - 1] != lead {
        return Err(LossError::input(
            "hidden",
            format!(
                "shape {:?} does not match the student logits {:?}",
                hidden.dims(),
                student_logits.dims()
            ),
        ));
    }
    let n: usize = lead.iter().product();
    let dt = compute_dtype(student_logits);
    let h2 = hidden.reshape((n, head.hidden_size()))?;
    let prepared = head.prepare(dt)?;
    let teacher = |ids: &[u32]| -> Result<Tensor> { prepared.logits(&rows(&h2, ids)?) };
    chunked(
        student_logits,
        head.vocab(),
        &teacher,
        mask,
        div,
        temperature,
        chunk_rows,
        normalizer,
    )
}

/// The same loss from the teacher's full final logits (scale and soft-cap applied, padded
/// columns removed): `teacher_logits` has the student logits' shape, `[N, V]` or `[B, T, V]`.
/// The reference path of [`full_vocab_divergence`], and the loss where full logits are at hand.
#[allow(clippy::too_many_arguments)]
pub fn full_vocab_divergence_from_logits(
    student_logits: &Tensor,
    teacher_logits: &Tensor,
    mask: &Tensor,
    div: Divergence,
    temperature: Temperature,
    chunk_rows: usize,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    if teacher_logits.dims() != student_logits.dims() {
        return Err(LossError::input(
            "teacher_logits",
            format!(
                "shape {:?} does not match the student logits {:?}",
                teacher_logits.dims(),
                student_logits.dims()
            ),
        ));
    }
    if !is_float(teacher_logits.dtype()) {
        return Err(LossError::input("teacher_logits", "must be a float tensor"));
    }
    let rank = student_logits.rank();
    if rank < 2 {
        return Err(LossError::input(
            "student_logits",
            format!(
                "must be [N, V] or [B, T, V], got {:?}",
                student_logits.dims()
            ),
        ));
    }
    let v = student_logits.dims()[rank - 1];
    let n = student_logits.elem_count() / v.max(1);
    let dt = compute_dtype(student_logits);
    let t2 = teacher_logits.reshape((n, v))?.detach();
    let teacher = |ids: &[u32]| -> Result<Tensor> { Ok(rows(&t2, ids)?.to_dtype(dt)?) };
    chunked(
        student_logits,
        v,
        &teacher,
        mask,
        div,
        temperature,
        chunk_rows,
        normalizer,
    )
}

/// `x / τ` as `x · inv_t` (no op when τ = 1).
fn scaled(x: &Tensor, inv_t: f64) -> Result<Tensor> {
    Ok(if inv_t == 1.0 {
        x.clone()
    } else {
        x.affine(inv_t, 0.0)?
    })
}

/// Rows `ids` of a 2-D tensor: a view when they are consecutive, else `index_select`.
fn rows(x: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let consecutive = ids.windows(2).all(|w| w[1] == w[0] + 1);
    if consecutive && !ids.is_empty() {
        Ok(x.narrow(0, ids[0] as usize, ids.len())?)
    } else if ids.is_empty() {
        Ok(x.narrow(0, 0, 0)?)
    } else {
        let idx = Tensor::from_slice(ids, ids.len(), x.device())?;
        Ok(x.index_select(&idx, 0)?)
    }
}

/// The divergence actually computed: JSD at β = 0 / 1 is forward / reverse KL (TRL).
enum Form {
    Forward,
    Reverse,
    Jsd(f64),
    TotalVariation,
}

fn form(div: Divergence) -> Result<Form> {
    Ok(match div {
        Divergence::Forward => Form::Forward,
        Divergence::Reverse => Form::Reverse,
        Divergence::Jsd { beta } if !(0.0..=1.0).contains(&beta) => {
            return Err(LossError::config(
                "kd.beta",
                format!("must be in [0, 1], got {beta}"),
            ))
        }
        Divergence::Jsd { beta: 0.0 } => Form::Forward,
        Divergence::Jsd { beta: 1.0 } => Form::Reverse,
        Divergence::Jsd { beta } => Form::Jsd(beta),
        Divergence::TotalVariation => Form::TotalVariation,
    })
}

/// Per-row divergence `[c, 1]` and its gradient with respect to `s = z_S/τ`, `[c, V]`, from the
/// two log-distributions `[c, V]`.
fn divergence_and_grad(lp_t: &Tensor, lp_s: &Tensor, form: &Form) -> Result<(Tensor, Tensor)> {
    let p_t = lp_t.exp()?;
    let p_s = lp_s.exp()?;
    Ok(match *form {
        Form::Forward => {
            let d = (&p_t * (lp_t - lp_s)?)?.sum_keepdim(D::Minus1)?;
            let g = (p_s.broadcast_mul(&p_t.sum_keepdim(D::Minus1)?)? - &p_t)?;
            (d, g)
        }
        Form::Reverse => {
            let diff = (lp_s - lp_t)?;
            let d = (&p_s * &diff)?.sum_keepdim(D::Minus1)?;
            let g = (&p_s * diff.broadcast_sub(&d)?)?;
            (d, g)
        }
        Form::Jsd(beta) => {
            let lm = logaddexp(
                &lp_t.affine(1.0, beta.ln())?,
                &lp_s.affine(1.0, (1.0 - beta).ln())?,
            )?;
            let kt = (&p_t * (lp_t - &lm)?)?.sum_keepdim(D::Minus1)?;
            let h = (lp_s - &lm)?;
            let ks = (&p_s * &h)?.sum_keepdim(D::Minus1)?;
            let d = (kt.affine(beta, 0.0)? + ks.affine(1.0 - beta, 0.0)?)?;
            let g = (&p_s * h.broadcast_sub(&ks)?)?.affine(1.0 - beta, 0.0)?;
            (d, g)
        }
        Form::TotalVariation => {
            // σ = sign(p_S − p_T); ∂D/∂s = ½ p_S ⊙ (σ − Σ σ p_S).
            let diff = (&p_s - &p_t)?;
            let d = diff.abs()?.sum_keepdim(D::Minus1)?.affine(0.5, 0.0)?;
            let sigma = diff.sign()?;
            let mean = (&sigma * &p_s)?.sum_keepdim(D::Minus1)?;
            let g = (&p_s * sigma.broadcast_sub(&mean)?)?.affine(0.5, 0.0)?;
            (d, g)
        }
    })
}

/// The shared chunk loop. `teacher(ids)` gives the teacher's final logits `[len(ids), vocab]` in
/// the compute dtype for those flat positions.
#[allow(clippy::too_many_arguments)]
fn chunked(
    student_logits: &Tensor,
    vocab: usize,
    teacher: &dyn Fn(&[u32]) -> Result<Tensor>,
    mask: &Tensor,
    div: Divergence,
    temperature: Temperature,
    chunk_rows: usize,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let temperature = temperature.get();
    let normalizer = normalizer.map(Normalizer::get);
    let form = form(div)?;
    if chunk_rows == 0 {
        return Err(LossError::config("chunk_rows", "must be at least 1"));
    }
    let dims = student_logits.dims();
    if dims.len() < 2 || !is_float(student_logits.dtype()) {
        return Err(LossError::input(
            "student_logits",
            format!(
                "must be a float [N, V] or [B, T, V], got {:?} {:?}",
                student_logits.dtype(),
                dims
            ),
        ));
    }
    let v = dims[dims.len() - 1];
    if v != vocab {
        return Err(LossError::input(
            "student_logits",
            format!("{v} columns, the teacher has {vocab} tokens (same tokenizer required)"),
        ));
    }
    let lead = &dims[..dims.len() - 1];
    if mask.dims() != lead {
        return Err(LossError::input(
            "mask",
            format!("shape {:?}, expected {lead:?}", mask.dims()),
        ));
    }
    let n: usize = lead.iter().product();
    let mask_host: Vec<f64> = mask.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let mut valid = Vec::with_capacity(n);
    for (p, &m) in mask_host.iter().enumerate() {
        if m == 1.0 {
            valid.push(p as u32);
        } else if m != 0.0 {
            return Err(LossError::input(
                "mask",
                format!("position {p}: mask must be 0 or 1, got {m}"),
            ));
        }
    }
    let nv = valid.len();
    let count = nv as f64;
    let denom = normalizer.unwrap_or(count);
    let inv_n = if denom > 0.0 { 1.0 / denom } else { 0.0 };
    let dt = compute_dtype(student_logits);
    let inv_t = 1.0 / temperature;
    let z2 = student_logits.reshape((n, v))?;

    // Chunk by chunk: value and closed-form gradient, no graph; the value summed on the
    // device (nothing read back per chunk).
    let grad = Tensor::zeros((nv, v), dt, student_logits.device())?;
    let mut total = Tensor::zeros((), dt, student_logits.device())?;
    for (c, ids) in valid.chunks(chunk_rows).enumerate() {
        let lp_t = log_softmax_last(&scaled(&teacher(ids)?, inv_t)?)?;
        let zs = rows(&z2, ids)?.detach().to_dtype(dt)?;
        let lp_s = log_softmax_last(&scaled(&zs, inv_t)?)?;
        let (d, g) = divergence_and_grad(&lp_t, &lp_s, &form)?;
        total = (total + d.sum_all()?)?;
        // ∂(τ² Σ D / N)/∂z = τ²/N · (1/τ) ∂D/∂s.
        let g = g.affine(temperature * inv_n, 0.0)?.contiguous()?;
        grad.slice_set(&g, 0, c * chunk_rows)?;
    }
    let value = total.affine(temperature * temperature * inv_n, 0.0)?;

    // Surrogate: value `value`, gradient `grad` at the valid rows, 0 elsewhere.
    let z_valid = if nv == n { z2 } else { rows(&z2, &valid)? };
    let dot = (z_valid.to_dtype(dt)? * &grad)?.sum_all()?;
    let loss = ((&dot - dot.detach())? + value)?;
    let figures = KdFigures::pending(&loss, &[], count)?;
    Ok((loss, figures))
}

#[cfg(test)]
mod tests;
