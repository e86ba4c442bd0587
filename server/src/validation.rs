//! Every scoring request, whatever route it came by, becomes a [`ValidTopkRequest`] here, in one
//! place. Each route first translates its own body into a [`ScoreSpec`] (engine terms, with the
//! route's own field names for errors); [`validate_spec`] checks it. Every error names the field.

use crate::error::ApiError;
use crate::request::{Candidates, RequestLimits, ScoreParams, ValidSequence, ValidTopkRequest};
use std::sync::Arc;
use xdistill_shared::protocol::{HiddenRequest, TopkRequest};

/// Refuses an answer whose size as the route sends it, estimated before scoring, is over
/// `--max-answer-bytes` (413 `answer_too_large`, naming the route's input field).
pub fn check_answer_size(
    bytes: usize,
    what: &'static str,
    field: &str,
    lim: &RequestLimits,
) -> Result<(), ApiError> {
    if bytes > lim.max_answer_bytes {
        return Err(ApiError::AnswerTooLarge {
            field: field.to_string(),
            bytes,
            limit: lim.max_answer_bytes,
            what,
        });
    }
    Ok(())
}

/// The request fields of one route, for error messages.
#[derive(Debug, Clone, Copy)]
pub struct FieldNames {
    pub sequences: &'static str,
    pub k: &'static str,
    pub temperature: &'static str,
    /// The shared start (`start`), or the per-sequence list (`starts`) when `per_sequence_start`.
    pub start: &'static str,
    pub ids: &'static str,
}

/// `/topk_logits`.
pub const NATIVE_FIELDS: FieldNames = FieldNames {
    sequences: "sequences",
    k: "k",
    temperature: "temperature",
    start: "start",
    ids: "ids",
};

/// Candidate ids as a route gives them.
#[derive(Debug, Clone, Default)]
pub enum CandidateSpec {
    #[default]
    None,
    /// Per sequence, per returned row, a list of ids (`[n][rows][m]`): the native `ids`.
    PerRow(Vec<Vec<Vec<u32>>>),
    /// One list for every row of every sequence: SGLang's `token_ids_logprob`.
    Shared(Vec<u32>),
}

/// A scoring request in engine terms, before validation.
#[derive(Debug, Clone)]
pub struct ScoreSpec {
    pub sequences: Vec<Vec<u32>>,
    /// One start per sequence.
    pub starts: Vec<usize>,
    /// Whether the starts were given per sequence (errors then name `start[i]`).
    pub per_sequence_start: bool,
    pub candidates: CandidateSpec,
    pub params: ScoreParams,
    pub names: FieldNames,
}

/// The native routes' field names for a request with `n` sequences and these `starts`
/// (`starts` must hold one per sequence).
fn native_names(n: usize, starts: Option<&Vec<usize>>) -> Result<FieldNames, ApiError> {
    let mut names = NATIVE_FIELDS;
    if let Some(starts) = starts {
        if starts.len() != n {
            return Err(ApiError::invalid(
                "starts",
                format!("{} starts for {n} sequences", starts.len()),
            ));
        }
        names.start = "starts";
    }
    Ok(names)
}

/// Checks a `/hidden_states` request against `lim`: the same sequence, start and size rules as
/// `/topk_logits` (the answer's size is checked by the route, which knows the hidden width).
pub fn validate_hidden(
    req: HiddenRequest,
    lim: &RequestLimits,
) -> Result<ValidTopkRequest, ApiError> {
    let n = req.sequences.len();
    let names = native_names(n, req.starts.as_ref())?;
    let spec = ScoreSpec {
        starts: (0..n).map(|i| req.start_of(i)).collect(),
        per_sequence_start: req.starts.is_some(),
        candidates: CandidateSpec::None,
        params: ScoreParams::hidden_states(),
        sequences: req.sequences,
        names,
    };
    validate_spec(spec, lim)
}

/// Checks every field of a native request against `lim`.
pub fn validate(req: TopkRequest, lim: &RequestLimits) -> Result<ValidTopkRequest, ApiError> {
    let n = req.sequences.len();
    let names = native_names(n, req.starts.as_ref())?;
    let spec = ScoreSpec {
        starts: (0..n).map(|i| req.start_of(i)).collect(),
        per_sequence_start: req.starts.is_some(),
        candidates: match req.ids {
            Some(ids) => CandidateSpec::PerRow(ids),
            None => CandidateSpec::None,
        },
        params: ScoreParams::native(req.k, req.temperature, req.values),
        sequences: req.sequences,
        names,
    };
    validate_spec(spec, lim)
}

/// Checks a request of any route against `lim`.
pub fn validate_spec(spec: ScoreSpec, lim: &RequestLimits) -> Result<ValidTopkRequest, ApiError> {
    let f = spec.names;
    let p = spec.params;
    check_k(p.k, f.k, lim)?;
    if !p.temperature.is_finite() || p.temperature <= 0.0 {
        return Err(ApiError::invalid(
            f.temperature,
            format!("temperature must be finite and > 0, got {}", p.temperature),
        ));
    }
    // Below 1 / f32::MAX the scale 1 / τ itself overflows: every score would be NaN, whatever
    // the model. (Larger τ that overflow only for large logits are caught by the worker.)
    if !(1.0 / p.temperature).is_finite() {
        return Err(ApiError::invalid(
            f.temperature,
            format!(
                "temperature {:e} is too small: 1 / temperature overflows f32 (use >= {:e})",
                p.temperature,
                1.0 / f32::MAX
            ),
        ));
    }
    if spec.sequences.is_empty() {
        return Err(ApiError::invalid(
            f.sequences,
            "at least one sequence is required",
        ));
    }
    if spec.sequences.len() > lim.max_sequences {
        return Err(ApiError::TooManySequences {
            field: f.sequences.into(),
            sequences: spec.sequences.len(),
            limit: lim.max_sequences,
        });
    }
    if let CandidateSpec::PerRow(ids) = &spec.candidates {
        if ids.len() != spec.sequences.len() {
            return Err(ApiError::invalid(
                f.ids,
                format!(
                    "{} candidate lists for {} sequences",
                    ids.len(),
                    spec.sequences.len()
                ),
            ));
        }
    }
    if let CandidateSpec::Shared(ids) = &spec.candidates {
        check_candidate_row(ids, f.ids.to_string(), lim)?;
    }
    let next_row = p.next.is_some();
    let mut sequences = Vec::with_capacity(spec.sequences.len());
    for (i, seq) in spec.sequences.iter().enumerate() {
        let start = spec.starts[i];
        let valid = check_sequence(i, seq, start, &spec, lim)?;
        let rows = seq.len() - 1 - start + next_row as usize;
        let candidates = match &spec.candidates {
            CandidateSpec::None => None,
            CandidateSpec::Shared(ids) => Some(Candidates {
                m: ids.len(),
                ids: ids.iter().copied().cycle().take(rows * ids.len()).collect(),
            }),
            CandidateSpec::PerRow(all) => Some(per_row_candidates(i, &all[i], rows, f, lim)?),
        };
        sequences.push(ValidSequence {
            ids: valid,
            start,
            next_row,
            candidates,
        });
    }
    let valid = ValidTopkRequest {
        sequences,
        params: p,
    };
    let tokens = valid.cost();
    if tokens > lim.max_queue_tokens {
        return Err(ApiError::RequestTooLarge {
            field: f.sequences.into(),
            tokens,
            limit: lim.max_queue_tokens,
        });
    }
    let bytes = valid.answer_bytes();
    if bytes > lim.max_answer_bytes {
        return Err(ApiError::AnswerTooLarge {
            field: f.sequences.into(),
            bytes,
            limit: lim.max_answer_bytes,
            what: "of scores",
        });
    }
    Ok(valid)
}

pub(crate) fn check_k(k: usize, field: &str, lim: &RequestLimits) -> Result<(), ApiError> {
    if k > lim.max_k {
        return Err(ApiError::invalid(
            field,
            format!("{field} = {k} exceeds the server's max-k {}", lim.max_k),
        ));
    }
    if k > lim.vocab_size {
        return Err(ApiError::invalid(
            field,
            format!(
                "{field} = {k} exceeds the vocabulary size {}",
                lim.vocab_size
            ),
        ));
    }
    Ok(())
}

/// Sequence `i`: not empty, not too long, ids in range, start in range.
fn check_sequence(
    i: usize,
    seq: &[u32],
    start: usize,
    spec: &ScoreSpec,
    lim: &RequestLimits,
) -> Result<Arc<[u32]>, ApiError> {
    let f = spec.names;
    if seq.is_empty() {
        return Err(ApiError::invalid(
            format!("{}[{i}]", f.sequences),
            "empty sequence",
        ));
    }
    if seq.len() > lim.max_seq_len {
        return Err(ApiError::invalid(
            format!("{}[{i}]", f.sequences),
            format!(
                "sequence of {} tokens exceeds max-seq-len {}",
                seq.len(),
                lim.max_seq_len
            ),
        ));
    }
    if let Some(j) = seq.iter().position(|&id| id as usize >= lim.vocab_size) {
        return Err(ApiError::invalid(
            format!("{}[{i}][{j}]", f.sequences),
            format!("token id {} >= vocab size {}", seq[j], lim.vocab_size),
        ));
    }
    if start >= seq.len() {
        let field = if spec.per_sequence_start {
            format!("{}[{i}]", f.start)
        } else {
            f.start.to_string()
        };
        return Err(ApiError::invalid(
            field,
            format!(
                "start {start} out of range for {}[{i}] of length {} (must be < {})",
                f.sequences,
                seq.len(),
                seq.len()
            ),
        ));
    }
    Ok(Arc::from(seq))
}

/// One row of candidate ids: at most `max_k` of them, each a valid id.
fn check_candidate_row(row: &[u32], field: String, lim: &RequestLimits) -> Result<(), ApiError> {
    if row.len() > lim.max_k {
        return Err(ApiError::invalid(
            field,
            format!(
                "{} candidate ids exceed the server's max-k {}",
                row.len(),
                lim.max_k
            ),
        ));
    }
    if let Some(j) = row.iter().position(|&id| id as usize >= lim.vocab_size) {
        return Err(ApiError::invalid(
            format!("{field}[{j}]"),
            format!("token id {} >= vocab size {}", row[j], lim.vocab_size),
        ));
    }
    Ok(())
}

/// Sequence `i`'s `[rows][m]` candidates: one list per returned row, all of one length.
fn per_row_candidates(
    i: usize,
    lists: &[Vec<u32>],
    rows: usize,
    f: FieldNames,
    lim: &RequestLimits,
) -> Result<Candidates, ApiError> {
    if lists.len() != rows {
        return Err(ApiError::invalid(
            format!("{}[{i}]", f.ids),
            format!(
                "{} candidate rows for the {rows} returned rows of {}[{i}]",
                lists.len(),
                f.sequences
            ),
        ));
    }
    let m = lists.first().map_or(0, Vec::len);
    // Row 0 sets the width, so it is checked (at most max_k ids) before `rows × m` is reserved:
    // a first row of millions of ids would otherwise size an allocation that aborts the server.
    if let Some(first) = lists.first() {
        check_candidate_row(first, format!("{}[{i}][0]", f.ids), lim)?;
    }
    let mut flat = Vec::with_capacity(rows * m);
    for (r, row) in lists.iter().enumerate() {
        if row.len() != m {
            return Err(ApiError::invalid(
                format!("{}[{i}][{r}]", f.ids),
                format!(
                    "{} ids where row 0 has {m}: every row needs the same count",
                    row.len()
                ),
            ));
        }
        check_candidate_row(row, format!("{}[{i}][{r}]", f.ids), lim)?;
        flat.extend_from_slice(row);
    }
    Ok(Candidates {
        m,
        ids: flat.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scoring::NextToken;
    use xdistill_shared::protocol::ValuesKind;

    fn lim() -> RequestLimits {
        RequestLimits {
            vocab_size: 100,
            max_k: 10,
            max_seq_len: 8,
            max_queue_tokens: 20,
            max_sequences: 6,
            max_answer_bytes: 1 << 20,
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
            ids: None,
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
        r.k = 11;
        assert_eq!(field_of(r.clone()), "k");
        r.k = 3;
        r.temperature = 0.0;
        assert_eq!(field_of(r.clone()), "temperature");
        r.temperature = f32::NAN;
        assert_eq!(field_of(r.clone()), "temperature");
        r.temperature = 1e-45;
        assert_eq!(field_of(r.clone()), "temperature");
        r.temperature = 1e-37;
        assert!(validate(r.clone(), &lim()).is_ok());
        r.temperature = 1.0;
        r.start = 2;
        assert_eq!(field_of(r.clone()), "start");
        r.start = 0;
        r.starts = Some(vec![0, 0]);
        assert_eq!(field_of(r.clone()), "starts");
        r.starts = Some(vec![5]);
        assert_eq!(field_of(r), "starts[0]");
    }

    #[test]
    fn hidden_requests_follow_the_same_rules() {
        let h = |sequences: Vec<Vec<u32>>, start: usize, starts: Option<Vec<usize>>| {
            validate_hidden(
                HiddenRequest {
                    sequences,
                    start,
                    starts,
                },
                &lim(),
            )
        };
        let v = h(vec![vec![1, 2, 3], vec![4]], 0, Some(vec![1, 0])).unwrap();
        assert!(v.params.hidden);
        assert_eq!((v.sequences[0].rows(), v.sequences[1].rows()), (1, 0));
        let field = |r: Result<ValidTopkRequest, ApiError>| match r {
            Err(ApiError::Invalid { field, .. }) => field,
            other => panic!("expected Invalid, got {other:?}"),
        };
        assert_eq!(field(h(vec![vec![1, 100]], 0, None)), "sequences[0][1]");
        assert_eq!(field(h(vec![vec![]], 0, None)), "sequences[0]");
        assert_eq!(field(h(vec![vec![1; 9]], 0, None)), "sequences[0]");
        assert_eq!(field(h(vec![], 0, None)), "sequences");
        assert_eq!(field(h(vec![vec![1, 2]], 2, None)), "start");
        assert_eq!(field(h(vec![vec![1, 2]], 0, Some(vec![]))), "starts");
        assert_eq!(field(h(vec![vec![1, 2]], 0, Some(vec![2]))), "starts[0]");
    }

    #[test]
    fn k_zero_is_accepted() {
        let mut r = req(vec![vec![1, 2, 3]]);
        r.k = 0;
        let v = validate(r, &lim()).unwrap();
        assert_eq!(v.params.k, 0);
        assert_eq!(v.sequences[0].rows(), 2);
    }

    #[test]
    fn candidate_ids_are_checked_per_row() {
        let mut r = req(vec![vec![1, 2, 3], vec![4, 5]]);
        r.starts = Some(vec![0, 1]);
        // Sequence 0 has 2 rows, sequence 1 none.
        r.ids = Some(vec![vec![vec![7, 8], vec![9, 10]], vec![]]);
        let v = validate(r.clone(), &lim()).unwrap();
        let c = v.sequences[0].candidates.as_ref().unwrap();
        assert_eq!((c.m, &*c.ids), (2, &[7u32, 8, 9, 10][..]));
        assert_eq!(v.sequences[1].candidates.as_ref().unwrap().m, 0);
        let mut bad = r.clone();
        bad.ids = Some(vec![vec![vec![7, 8]], vec![]]);
        assert_eq!(field_of(bad), "ids[0]");
        let mut bad = r.clone();
        bad.ids = Some(vec![vec![vec![7, 8], vec![9]], vec![]]);
        assert_eq!(field_of(bad), "ids[0][1]");
        let mut bad = r.clone();
        bad.ids = Some(vec![vec![vec![7, 8], vec![9, 100]], vec![]]);
        assert_eq!(field_of(bad), "ids[0][1][1]");
        let mut bad = r.clone();
        bad.ids = Some(vec![vec![vec![1; 11], vec![1; 11]], vec![]]);
        assert_eq!(field_of(bad), "ids[0][0]");
        let mut bad = r;
        bad.ids = Some(vec![]);
        assert_eq!(field_of(bad), "ids");
    }

    /// A first candidate row far wider than max-k is refused before `rows × m` ids are
    /// reserved: here 4,194,303 rows × 8,388,608 ids, 128 TiB, more than any address space
    /// holds, whose reservation aborted the server (an allocation failure is no panic to catch).
    #[test]
    fn a_wide_first_candidate_row_is_refused_before_anything_is_reserved() {
        let rows = (1 << 22) - 1;
        let mut lists = vec![Vec::new(); rows];
        lists[0] = vec![1u32; 1 << 23];
        let mut r = req(vec![vec![1; rows + 1]]);
        r.ids = Some(vec![lists]);
        let limits = RequestLimits {
            max_seq_len: rows + 1,
            max_queue_tokens: rows + 1,
            ..lim()
        };
        match validate(r, &limits) {
            Err(ApiError::Invalid { field, message }) => {
                assert_eq!(field, "ids[0][0]");
                assert!(
                    message.contains("exceed the server's max-k 10"),
                    "{message}"
                );
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn shared_candidates_and_next_row() {
        let spec = ScoreSpec {
            sequences: vec![vec![1, 2, 3]],
            starts: vec![1],
            per_sequence_start: false,
            candidates: CandidateSpec::Shared(vec![5, 6]),
            params: ScoreParams {
                next: Some(NextToken::Greedy),
                ..ScoreParams::native(2, 1.0, ValuesKind::Logprobs)
            },
            names: NATIVE_FIELDS,
        };
        let v = validate_spec(spec, &lim()).unwrap();
        let s = &v.sequences[0];
        // Rows at positions 1 and 2 (the next row): every token is fed.
        assert_eq!((s.rows(), s.input_tokens()), (2, 3));
        assert_eq!(&*s.candidates.as_ref().unwrap().ids, &[5, 6, 5, 6]);
    }

    /// Every sequence costs at least one token, however empty its answer; the sequence count and
    /// the answer's size are bounded.
    #[test]
    fn every_sequence_and_every_answer_byte_counts() {
        // 6 one-token sequences: no forward at all, but 6 of the 20 budget tokens.
        let v = validate(req(vec![vec![1]; 6]), &lim()).unwrap();
        assert_eq!((v.input_tokens(), v.cost()), (0, 6));
        assert!(matches!(
            validate(req(vec![vec![1]; 7]), &lim()),
            Err(ApiError::TooManySequences {
                sequences: 7,
                limit: 6,
                ..
            })
        ));
        let many = RequestLimits {
            max_sequences: 100,
            ..lim()
        };
        assert!(matches!(
            validate(req(vec![vec![1]; 21]), &many),
            Err(ApiError::RequestTooLarge { tokens: 21, .. })
        ));
        // 2 rows × (2·3 + 2) values × 4 bytes + 64 = 128 bytes; a limit of 127 refuses it.
        let v = validate(req(vec![vec![1, 2, 3]]), &lim()).unwrap();
        assert_eq!(v.answer_bytes(), 128);
        let tight = RequestLimits {
            max_answer_bytes: 127,
            ..lim()
        };
        assert!(matches!(
            validate(req(vec![vec![1, 2, 3]]), &tight),
            Err(ApiError::AnswerTooLarge { bytes: 128, .. })
        ));
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

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Arbitrary requests (any k, starts, candidate shapes, ids) never panic the validator;
        /// an accepted one is consistent: rows, candidate shapes and its cost within limits.
        #[test]
        fn validation_never_panics_and_accepts_only_consistent_requests(
            sequences in prop::collection::vec(prop::collection::vec(0u32..120, 0..9), 0..8),
            k in 0usize..14,
            start in 0usize..10,
            starts in prop::option::of(prop::collection::vec(0usize..10, 0..8)),
            ids in prop::option::of(prop::collection::vec(
                prop::collection::vec(prop::collection::vec(0u32..120, 0..12), 0..9), 0..8)),
            temperature in prop_oneof![Just(1.0f32), Just(0.0), Just(f32::NAN), -2.0f32..3.0],
        ) {
            let r = TopkRequest {
                sequences, k, temperature, start, starts, ids,
                values: ValuesKind::Logprobs,
            };
            if let Ok(v) = validate(r.clone(), &lim()) {
                prop_assert!(v.cost() <= lim().max_queue_tokens);
                prop_assert!(v.sequences.len() <= lim().max_sequences);
                for (i, s) in v.sequences.iter().enumerate() {
                    prop_assert_eq!(s.rows(), r.sequences[i].len() - 1 - r.start_of(i));
                    if let Some(c) = &s.candidates {
                        prop_assert_eq!(c.ids.len(), s.rows() * c.m);
                        prop_assert!(c.ids.iter().all(|&id| id < 100));
                    }
                    prop_assert!(s.ids.iter().all(|&id| id < 100));
                }
            }
        }
    }
}
