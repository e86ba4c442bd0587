//! Finiteness: a score a client receives is never NaN or infinite. Scores are checked as they
//! are made ([`first_non_finite`]); a failing row's logits are recomputed to name the cause
//! ([`non_finite_cause`]): the model's logits (a server fault) or the request's temperature (the
//! client's).

use super::{Scorer, ScoringError};
use candle_core::{DType, Tensor};
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

/// The first non-finite value among the scores a client receives: `(row, field)`.
///
/// Every returned value is finite for finite logits and a temperature whose scaled logits fit
/// an f32: ids are below the valid vocabulary (validation), so a log-prob is at least
/// `-(max - min) / τ - ln V`, never -inf. A non-finite value is therefore an error, never an answer.
pub fn first_non_finite(s: &SequenceScores) -> Option<(usize, &'static str)> {
    let per_row = |v: &[f32], width: usize| -> Option<usize> {
        let i = v.iter().position(|x| !x.is_finite())?;
        Some(i / width.max(1))
    };
    let checks: [(&[f32], usize, &'static str); 4] = [
        (&s.logsumexp, 1, "logsumexp"),
        (&s.target_logprobs, 1, "target_logprobs"),
        (&s.topk_values, s.k, "topk_values"),
        (&s.ids_logprobs, s.m, "ids_logprobs"),
    ];
    checks
        .iter()
        .filter_map(|&(v, w, name)| per_row(v, w).map(|r| (r, name)))
        .min_by_key(|&(r, _)| r)
}

/// Why the scores of logit row `row` (its valid columns) at `position` are not finite: the
/// model's logits themselves, or (logits finite) a temperature so small that `z / τ` or its
/// spread overflows an f32.
pub fn non_finite_cause(
    row: &[f32],
    temperature: f32,
    position: usize,
    field: &'static str,
) -> ScoringError {
    match row.iter().position(|x| !x.is_finite()) {
        Some(id) => ScoringError::NonFiniteLogits {
            id,
            position,
            value: row[id],
        },
        None => ScoringError::TemperatureOverflow {
            temperature,
            field,
            position,
        },
    }
}

impl Scorer {
    /// Refuses scores with a non-finite value, naming the cause ([`first_non_finite`]).
    /// `rows`: the `[c, H]` hidden states of positions `p0..p0 + c` they came from; the failing
    /// row's logits are recomputed from them only when something is wrong.
    pub(super) fn check_finite(
        &self,
        s: &SequenceScores,
        decoder: &Decoder,
        rows: &Tensor,
        p0: usize,
        temperature: f32,
    ) -> Result<(), ScoringError> {
        let Some((r, field)) = first_non_finite(s) else {
            return Ok(());
        };
        let row: Vec<f32> = decoder
            .logits(&rows.narrow(0, r, 1)?)?
            .get(0)?
            .narrow(0, 0, self.valid())?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        Err(non_finite_cause(&row, temperature, p0 + r, field))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scoring::{score_rows, CandidateRows, ScoreParams};
    use xdistill_shared::protocol::ValuesKind;

    const NONE: CandidateRows<'static> = CandidateRows { ids: &[], m: 0 };

    /// Non-finite scores are found and blamed on their cause: at τ = 1e-37 the logits ±30
    /// scale to ±3e38 (finite) but their spread to -6e38 (an f32 -inf log-prob); at 1e-45 the
    /// scale itself is infinite (NaN everywhere); a NaN logit is the model's.
    #[test]
    fn non_finite_scores_are_found_with_their_cause() {
        let row = vec![30.0f32, -30.0, 0.0];
        let ok = score_rows(
            &row,
            3,
            &[1],
            NONE,
            &ScoreParams::native(3, 1.0, ValuesKind::Logprobs).rows(3),
        );
        assert_eq!(first_non_finite(&ok.into()), None);
        let p = ScoreParams::native(1, 1e-37, ValuesKind::Logprobs);
        let s = score_rows(&row, 3, &[1], NONE, &p.rows(3));
        assert!(s.logsumexp[0].is_finite() && s.topk_values[0].is_finite());
        assert_eq!(first_non_finite(&s.into()), Some((0, "target_logprobs")));
        assert_eq!(
            non_finite_cause(&row, 1e-37, 5, "target_logprobs").to_string(),
            "temperature 1e-37 overflows the scaled logits (non-finite target_logprobs at position 5)"
        );
        let p = ScoreParams::native(2, 1e-45, ValuesKind::Logits);
        let s = score_rows(
            &[row.clone(), row.clone()].concat(),
            3,
            &[0, 2],
            NONE,
            &p.rows(3),
        );
        assert_eq!(first_non_finite(&s.into()), Some((0, "logsumexp")));
        let nan = vec![1.0f32, f32::NAN, 0.0];
        let s = score_rows(
            &nan,
            3,
            &[0],
            NONE,
            &ScoreParams::native(1, 1.0, ValuesKind::Logprobs).rows(3),
        );
        assert_eq!(first_non_finite(&s.into()).map(|e| e.0), Some(0));
        assert!(non_finite_cause(&nan, 1.0, 0, "logsumexp")
            .to_string()
            .contains("logits are not finite"));
    }
}
