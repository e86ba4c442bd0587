//! Cross-tokenizer first-token KL over the teacher's **whole** distribution (issue 32): the
//! `first_kl` of [`super::xtoken`] with the teacher's top-k replaced by its full log-softmax at
//! each chunk's anchor (from its hidden states and head, [`super::full_vocab`]). Pure tensor
//! math: the caller gathers one row per aligned chunk on both sides.
//!
//! Per chunk `c`, with `f(u)` the first student token of teacher token `u`'s re-tokenisation
//! ([`Projection::teacher_first`]) and `G = {f(u)}` the student tokens that start some teacher
//! token:
//!
//! ```text
//! P(g) = Σ_{u : f(u) = g} p_T(u)          over every teacher id u (no top-k set)
//! T    = Σ_{u : f(u) = ∅} p_T(u)          teacher mass no student token starts (floored at 1e-6)
//! S    = Σ_{g ∈ G} p_S(g),  p_S = softmax(z_S / τ)   (the student's mass inside G)
//! D_c  = Σ_g P(g) (ln P(g) − ln p_S(g)) + T (ln T − ln(1 − S))      (1 − S floored at 1e-6)
//! loss = τ² Σ_c D_c / N
//! ```
//!
//! This is exactly `first_kl` with `k` = the teacher's vocabulary (every teacher id in the
//! "top-k", the tail bucket holding only unspellable tokens), which the tests check, so the two
//! transports train the same objective where the top-k one is exact. The gradient is candle's
//! autograd through the student's log-softmax: `[C, V_s]` per call, so callers pass chunks of
//! rows (a head piece's chunks).

use candle_core::{DType, Tensor, D};

use super::stable::{check_normalizer, check_temperature, log1mexp, log_softmax_last, TAIL_FLOOR};
use super::{compute_dtype, KdMetrics, LossError, Projection, Result};

/// First-token KL of the student rows `student_logits [C, V]` (`V ≥` the projection's student
/// vocabulary; padded columns are ignored) against the teacher's full log-probs
/// `teacher_logprobs [C, V_t]` (`log_softmax(z_T / τ)` at each chunk's anchor, `V_t` the
/// projection's teacher vocabulary; no gradient), divided by `normalizer` (else C).
pub fn first_kl_full(
    student_logits: &Tensor,
    teacher_logprobs: &Tensor,
    proj: &Projection,
    temperature: f64,
    normalizer: Option<f64>,
) -> Result<(Tensor, KdMetrics)> {
    check_temperature(temperature)?;
    check_normalizer(normalizer)?;
    let (vs, vt) = (proj.student_vocab(), proj.teacher_vocab());
    let (c, v) = match *student_logits.dims() {
        [c, v] => (c, v),
        ref d => {
            return Err(LossError::input(
                "student_logits",
                format!("must be [C, V], got {d:?}"),
            ))
        }
    };
    if v < vs {
        return Err(LossError::input(
            "student_logits",
            format!("{v} columns for a student vocabulary of {vs}"),
        ));
    }
    if teacher_logprobs.dims() != [c, vt] {
        return Err(LossError::input(
            "teacher_logprobs",
            format!(
                "must be [{c}, {vt}] (one row per chunk, the teacher's whole vocabulary), got {:?}",
                teacher_logprobs.dims()
            ),
        ));
    }
    if !proj.has_teacher_first() {
        return Err(LossError::input(
            "projection",
            "first_kl needs the teacher → student first-token map (Projection::with_teacher_first)",
        ));
    }
    let dt = compute_dtype(student_logits);
    let dev = student_logits.device().clone();
    if c == 0 {
        let zero = Tensor::zeros((), dt, &dev)?;
        return Ok((zero, KdMetrics::default()));
    }

    // 1. Host: which teacher ids have a first student token (and which), and G as a mask.
    let (mut mapped_u, mut mapped_g, mut unmapped_u) = (vec![], vec![], vec![]);
    let mut in_g = vec![0f32; vs];
    for u in 0..vt {
        match proj.teacher_first(u) {
            Some(g) => {
                mapped_u.push(u as u32);
                mapped_g.push(g);
                in_g[g as usize] = 1.0;
            }
            None => unmapped_u.push(u as u32),
        }
    }

    // 2. Teacher side (constant): P [C, V_s] grouped by first token, the tail T [C].
    let pt = teacher_logprobs.detach().to_dtype(dt)?.exp()?; // [C, V_t]
    let p = if mapped_u.is_empty() {
        Tensor::zeros((c, vs), dt, &dev)?
    } else {
        let n = mapped_u.len();
        let src = pt.index_select(&Tensor::from_vec(mapped_u, n, &dev)?, 1)?;
        Tensor::zeros((c, vs), dt, &dev)?.index_add(
            &Tensor::from_vec(mapped_g, n, &dev)?,
            &src,
            1,
        )?
    };
    let tail = if unmapped_u.is_empty() {
        Tensor::zeros(c, dt, &dev)?
    } else {
        let n = unmapped_u.len();
        pt.index_select(&Tensor::from_vec(unmapped_u, n, &dev)?, 1)?
            .sum(D::Minus1)?
    };
    let tail = tail.maximum(TAIL_FLOOR)?;
    // Σ P ln P + T ln T, with 0 ln 0 = 0 (P is 0 exactly where no teacher id maps).
    let tiny = if dt == DType::F64 { 1e-300 } else { 1e-30 };
    let constant = ((&p * p.maximum(tiny)?.log()?)?.sum(D::Minus1)? + (&tail * tail.log()?)?)?; // [C]

    // 3. Student side: ln p_S over its vocabulary, the mass outside G.
    let z = student_logits.narrow(1, 0, vs)?.to_dtype(dt)?;
    let ls = log_softmax_last(&z.affine(1.0 / temperature, 0.0)?)?; // [C, V_s]
    let mask = Tensor::from_vec(in_g, vs, &dev)?.to_dtype(dt)?;
    let s_in = ls.exp()?.broadcast_mul(&mask)?.sum(D::Minus1)?; // [C]
    let ls_tail = log1mexp(&s_in.log()?, TAIL_FLOOR)?;
    let cross = ((&p * &ls)?.sum(D::Minus1)? + (&tail * ls_tail)?)?; // [C]

    let n = normalizer.unwrap_or(c as f64);
    let inv = if n > 0.0 { 1.0 / n } else { 0.0 };
    let loss = (constant - cross)?
        .sum_all()?
        .affine(temperature * temperature * inv, 0.0)?;
    let mean =
        |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.mean_all()?.to_scalar::<f64>()?) };
    let metrics = KdMetrics {
        loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        count: c as f64,
        teacher_topk_mass: Some(mean(&p.sum(D::Minus1)?)?),
        student_topk_mass: Some(mean(&s_in)?),
    };
    Ok((loss, metrics))
}

#[cfg(test)]
#[path = "xtoken_full_tests.rs"]
mod tests;
