//! Raw [`TopkRequest`] → [`ValidTopkRequest`], in one place. Every error names the field.

use crate::error::ApiError;
use crate::topk::ScoreParams;
use std::sync::Arc;
use xdistill_shared::protocol::TopkRequest;

/// The limits a request is checked against.
#[derive(Debug, Clone)]
pub struct RequestLimits {
    /// Valid ids are `< vocab_size` (the tokenizer's vocabulary, not the padded LM head).
    pub vocab_size: usize,
    pub max_k: usize,
    pub max_seq_len: usize,
    pub max_queue_tokens: usize,
}

/// One sequence to score: rows `start..len-1` (the distribution predicting token `p + 1`).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSequence {
    pub ids: Arc<[u32]>,
    pub start: usize,
}

impl ValidSequence {
    /// Number of result rows, `S - 1 - start`.
    pub fn rows(&self) -> usize {
        self.ids.len() - 1 - self.start
    }
    /// Tokens the model must read: the last token predicts nothing we return, so `S - 1`
    /// (0 when there are no rows: the sequence needs no forward at all).
    pub fn input_tokens(&self) -> usize {
        if self.rows() == 0 {
            0
        } else {
            self.ids.len() - 1
        }
    }
}

#[derive(Debug, Clone)]
pub struct ValidTopkRequest {
    pub sequences: Vec<ValidSequence>,
    pub params: ScoreParams,
}

impl ValidTopkRequest {
    pub fn input_tokens(&self) -> usize {
        self.sequences.iter().map(|s| s.input_tokens()).sum()
    }
}

/// Checks every field of `req` against `lim`.
pub fn validate(req: TopkRequest, lim: &RequestLimits) -> Result<ValidTopkRequest, ApiError> {
    if req.k == 0 {
        return Err(ApiError::invalid("k", "k must be at least 1"));
    }
    if req.k > lim.max_k {
        return Err(ApiError::invalid(
            "k",
            format!("k = {} exceeds the server's max-k {}", req.k, lim.max_k),
        ));
    }
    if req.k > lim.vocab_size {
        return Err(ApiError::invalid(
            "k",
            format!(
                "k = {} exceeds the vocabulary size {}",
                req.k, lim.vocab_size
            ),
        ));
    }
    if !req.temperature.is_finite() || req.temperature <= 0.0 {
        return Err(ApiError::invalid(
            "temperature",
            format!(
                "temperature must be finite and > 0, got {}",
                req.temperature
            ),
        ));
    }
    if req.sequences.is_empty() {
        return Err(ApiError::invalid(
            "sequences",
            "at least one sequence is required",
        ));
    }
    if let Some(starts) = &req.starts {
        if starts.len() != req.sequences.len() {
            return Err(ApiError::invalid(
                "starts",
                format!(
                    "{} starts for {} sequences",
                    starts.len(),
                    req.sequences.len()
                ),
            ));
        }
    }
    let mut sequences = Vec::with_capacity(req.sequences.len());
    for (i, seq) in req.sequences.iter().enumerate() {
        if seq.is_empty() {
            return Err(ApiError::invalid(
                format!("sequences[{i}]"),
                "empty sequence",
            ));
        }
        if seq.len() > lim.max_seq_len {
            return Err(ApiError::invalid(
                format!("sequences[{i}]"),
                format!(
                    "sequence of {} tokens exceeds max-seq-len {}",
                    seq.len(),
                    lim.max_seq_len
                ),
            ));
        }
        if let Some(j) = seq.iter().position(|&id| id as usize >= lim.vocab_size) {
            return Err(ApiError::invalid(
                format!("sequences[{i}][{j}]"),
                format!("token id {} >= vocab size {}", seq[j], lim.vocab_size),
            ));
        }
        let start = req.start_of(i);
        if start >= seq.len() {
            let field = if req.starts.is_some() {
                format!("starts[{i}]")
            } else {
                "start".into()
            };
            return Err(ApiError::invalid(
                field,
                format!(
                    "start {start} out of range for sequences[{i}] of length {} (must be < {})",
                    seq.len(),
                    seq.len()
                ),
            ));
        }
        sequences.push(ValidSequence {
            ids: Arc::from(seq.as_slice()),
            start,
        });
    }
    let valid = ValidTopkRequest {
        sequences,
        params: ScoreParams {
            k: req.k,
            temperature: req.temperature,
            values: req.values,
        },
    };
    let tokens = valid.input_tokens();
    if tokens > lim.max_queue_tokens {
        return Err(ApiError::RequestTooLarge {
            tokens,
            limit: lim.max_queue_tokens,
        });
    }
    Ok(valid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdistill_shared::protocol::ValuesKind;

    fn lim() -> RequestLimits {
        RequestLimits {
            vocab_size: 100,
            max_k: 10,
            max_seq_len: 8,
            max_queue_tokens: 20,
        }
    }

    fn req(seqs: Vec<Vec<u32>>) -> TopkRequest {
        TopkRequest {
            sequences: seqs,
            k: 3,
            temperature: 1.0,
            start: 0,
            starts: None,
            values: ValuesKind::Logprobs,
        }
    }

    fn field_of(r: TopkRequest) -> String {
        match validate(r, &lim()) {
            Err(ApiError::Invalid { field, .. }) => field,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn accepts_and_counts_rows() {
        let mut r = req(vec![vec![1, 2, 3], vec![4]]);
        r.starts = Some(vec![1, 0]);
        let v = validate(r, &lim()).unwrap();
        assert_eq!(v.sequences[0].rows(), 1);
        assert_eq!(v.sequences[1].rows(), 0);
        assert_eq!(v.input_tokens(), 2);
    }

    #[test]
    fn names_the_offending_field() {
        assert_eq!(
            field_of(req(vec![vec![1, 2], vec![3, 100]])),
            "sequences[1][1]"
        );
        assert_eq!(field_of(req(vec![vec![1], vec![]])), "sequences[1]");
        assert_eq!(field_of(req(vec![vec![1; 9]])), "sequences[0]");
        assert_eq!(field_of(req(vec![])), "sequences");
        let mut r = req(vec![vec![1, 2]]);
        r.k = 0;
        assert_eq!(field_of(r.clone()), "k");
        r.k = 11;
        assert_eq!(field_of(r.clone()), "k");
        r.k = 3;
        r.temperature = 0.0;
        assert_eq!(field_of(r.clone()), "temperature");
        r.temperature = f32::NAN;
        assert_eq!(field_of(r.clone()), "temperature");
        r.temperature = 1.0;
        r.start = 2;
        assert_eq!(field_of(r.clone()), "start");
        r.start = 0;
        r.starts = Some(vec![0, 0]);
        assert_eq!(field_of(r), "starts");
    }

    #[test]
    fn k_above_vocab_and_queue_limit() {
        let small = RequestLimits {
            vocab_size: 2,
            ..lim()
        };
        let mut r = req(vec![vec![1, 0]]);
        r.k = 3;
        assert!(matches!(validate(r, &small), Err(ApiError::Invalid { .. })));
        let big = req(vec![vec![1; 8], vec![1; 8], vec![1; 8]]);
        assert!(matches!(
            validate(big, &lim()),
            Err(ApiError::RequestTooLarge { tokens: 21, .. })
        ));
    }
}
