//! SGLang's `POST /generate` with `max_new_tokens` 0 (or 1): the input log-probs that verl,
//! miles and Axolotl read.
//!
//! For `logprob_start_len = N` the input lists have `S - N` entries aligned with `ids[N..]`;
//! entry 0 is always null (SGLang drops the first one even when N > 0); entry i ≥ 1 comes from
//! engine row `N + i - 1`, the distribution that predicted `ids[N + i]`. Every entry is a
//! `[logprob, token_id, text_or_null]` triple.

use super::admit::{self, Admission};
use super::{
    decode, encode_json, next_token_mode, read_json, request_id, respond, temperature_of,
    tokenize_inputs, wire_logprob,
};
use crate::engine;
use crate::error::ApiError;
use crate::scoring::ScoreParams;
use crate::state::AppState;
use crate::validation::{
    check_answer_size, check_k, validate_spec, CandidateSpec, FieldNames, ScoreSpec,
};
use crate::vocab::Vocab;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;
use xdistill_shared::protocol::{SequenceScores, ValuesKind};

type Shared = Arc<AppState>;

/// Field names for errors when the inputs came as `input_ids` ([`TEXT_FIELDS`]: as `text`).
const FIELDS: FieldNames = FieldNames {
    sequences: "input_ids",
    k: "top_logprobs_num",
    temperature: "sampling_params.temperature",
    start: "logprob_start_len",
    ids: "token_ids_logprob",
};

const TEXT_FIELDS: FieldNames = FieldNames {
    sequences: "text",
    ..FIELDS
};

/// The fields of a generate request that this server reads; every other field is ignored.
/// Per-input fields take one value for every input or a list with one per input. Every field
/// that can be large stays raw JSON until it is counted ([`admit`]).
#[derive(Debug, Deserialize)]
struct GenerateRequest<'a> {
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    input_ids: Option<&'a RawValue>,
    #[serde(borrow)]
    return_logprob: Option<&'a RawValue>,
    #[serde(borrow)]
    logprob_start_len: Option<&'a RawValue>,
    #[serde(borrow)]
    top_logprobs_num: Option<&'a RawValue>,
    #[serde(borrow)]
    token_ids_logprob: Option<&'a RawValue>,
    return_text_in_logprobs: Option<bool>,
    #[serde(borrow)]
    sampling_params: Option<&'a RawValue>,
    stream: Option<bool>,
    #[serde(borrow)]
    rid: Option<&'a RawValue>,
}

/// One value per input from a scalar (repeated) or a list of `n`; `default` when absent.
fn per_input<T: Clone>(
    v: Option<&Value>,
    n: usize,
    field: &str,
    default: T,
    parse: impl Fn(&Value) -> Option<T>,
) -> Result<Vec<T>, ApiError> {
    let bad = |f: String| ApiError::invalid(f, "wrong type or value");
    match v {
        None | Some(Value::Null) => Ok(vec![default; n]),
        Some(Value::Array(a)) => {
            if a.len() != n {
                return Err(ApiError::invalid(
                    field,
                    format!("{} values for {n} inputs", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, x)| parse(x).ok_or_else(|| bad(format!("{field}[{i}]"))))
                .collect()
        }
        Some(x) => Ok(vec![parse(x).ok_or_else(|| bad(field.to_string()))?; n]),
    }
}

/// The sampling parameters this server honours.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sampling {
    max_new_tokens: usize,
    temperature: Option<f64>,
}

/// `sampling_params`: one object, or one per input (which must then agree).
fn sampling_of(v: Option<&Value>, n: usize) -> Result<Sampling, ApiError> {
    let one = |v: &Value, field: &str| -> Result<Sampling, ApiError> {
        let max_new = match v.get("max_new_tokens") {
            None | Some(Value::Null) => 0,
            Some(x) => match x.as_u64() {
                Some(m @ (0 | 1)) => m as usize,
                _ => {
                    return Err(ApiError::unsupported(
                        format!("{field}.max_new_tokens"),
                        format!(
                            "max_new_tokens = {x}: at most 1 (this server scores inputs with \
                             return_logprob; it does not generate)"
                        ),
                    ))
                }
            },
        };
        let temperature = match v.get("temperature") {
            None | Some(Value::Null) => None,
            Some(x) => Some(x.as_f64().ok_or_else(|| {
                ApiError::invalid(format!("{field}.temperature"), "expected a number")
            })?),
        };
        Ok(Sampling {
            max_new_tokens: max_new,
            temperature,
        })
    };
    match v {
        None | Some(Value::Null) => Ok(Sampling {
            max_new_tokens: 0,
            temperature: None,
        }),
        Some(Value::Array(a)) => {
            if a.len() != n {
                return Err(ApiError::invalid(
                    "sampling_params",
                    format!("{} values for {n} inputs", a.len()),
                ));
            }
            let all = a
                .iter()
                .enumerate()
                .map(|(i, x)| one(x, &format!("sampling_params[{i}]")))
                .collect::<Result<Vec<_>, _>>()?;
            match all.first() {
                Some(first) if all.iter().all(|s| s == first) => Ok(*first),
                Some(_) => Err(ApiError::unsupported(
                    "sampling_params",
                    "every input of one request must use the same max_new_tokens and temperature",
                )),
                None => Ok(Sampling {
                    max_new_tokens: 0,
                    temperature: None,
                }),
            }
        }
        Some(x @ Value::Object(_)) => one(x, "sampling_params"),
        Some(_) => Err(ApiError::invalid("sampling_params", "expected an object")),
    }
}

/// `token_ids_logprob`: one list for every input, or one list per input; counted as it is
/// read (at most `--max-k` ids a list, one list per input).
fn candidate_lists(
    raw: Option<&RawValue>,
    n: usize,
    lim: &crate::request::RequestLimits,
) -> Result<Option<Vec<Vec<u32>>>, ApiError> {
    let field = "token_ids_logprob";
    let Some(raw) = raw else {
        return Ok(None);
    };
    if raw.get().trim() == "[]" {
        return Ok(Some(vec![Vec::new(); n]));
    }
    let lists = admit::inputs(raw, field, &Admission::candidates(lim)).map_err(|e| match e {
        ApiError::Invalid { field, message } if message.starts_with("expected token ids") => {
            ApiError::invalid(field, "expected a list of token ids")
        }
        other => other,
    })?;
    let ids = |i: super::Input| match i {
        super::Input::Ids(v) => v,
        super::Input::Text(_) => Vec::new(),
    };
    if !lists.batch {
        let one = lists.items.into_iter().next().map(ids).unwrap_or_default();
        return Ok(Some(vec![one; n]));
    }
    if lists.items.len() != n {
        return Err(ApiError::invalid(
            field,
            format!("{} lists for {n} inputs", lists.items.len()),
        ));
    }
    Ok(Some(lists.items.into_iter().map(ids).collect()))
}

/// What each input asks for.
struct PerInput {
    return_logprob: Vec<bool>,
    /// Resolved start (-1 → S - 1).
    start: Vec<usize>,
    top_n: Vec<usize>,
    candidates: Option<Vec<Vec<u32>>>,
}

/// `POST /generate`.
pub async fn generate(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    respond(run(&st, &headers, body).await)
}

async fn run(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let t0 = Instant::now();
    let ready = st.ready()?;
    let bytes = read_json(st, headers, body).await?;
    let req: GenerateRequest = decode(&bytes)?;
    if req.stream == Some(true) {
        return Err(ApiError::unsupported(
            "stream",
            "streaming is not supported",
        ));
    }
    let vocab = &ready.facts.vocab;
    let adm = Admission::scoring(&ready.limits, vocab.bytes_per_token());
    let (inputs, names) = match (req.input_ids, req.text) {
        (Some(ids), None) => (admit::inputs(ids, "input_ids", &adm)?, FIELDS),
        (None, Some(text)) => (admit::inputs(text, "text", &adm)?, TEXT_FIELDS),
        _ => {
            return Err(ApiError::invalid(
                "input_ids",
                "send exactly one of `input_ids` and `text`",
            ))
        }
    };
    let batch = inputs.batch;
    let sequences = tokenize_inputs(vocab, inputs, true).await?;
    let n = sequences.len();
    if let Some(i) = sequences.iter().position(Vec::is_empty) {
        let field = if batch {
            format!("{}[{i}]", names.sequences)
        } else {
            names.sequences.to_string()
        };
        return Err(ApiError::invalid(field, "empty input"));
    }
    // The small per-input fields, each bounded in bytes before it is parsed.
    let cap = admit::small_field_bytes(&ready.limits);
    let small = |raw: Option<&RawValue>, field: &str| admit::small(raw, field, cap);
    let sampling_params = small(req.sampling_params, "sampling_params")?;
    let return_logprob = small(req.return_logprob, "return_logprob")?;
    let logprob_start_len = small(req.logprob_start_len, "logprob_start_len")?;
    let top_logprobs_num = small(req.top_logprobs_num, "top_logprobs_num")?;
    let rid = small(req.rid, "rid")?;
    let sampling = sampling_of(Some(&sampling_params), n)?;
    let (temperature, greedy) = temperature_of(sampling.temperature, FIELDS.temperature)?;
    let per = PerInput {
        return_logprob: per_input(
            Some(&return_logprob),
            n,
            "return_logprob",
            false,
            Value::as_bool,
        )?,
        start: {
            let raw = per_input(
                Some(&logprob_start_len),
                n,
                "logprob_start_len",
                -1,
                Value::as_i64,
            )?;
            raw.iter()
                .zip(&sequences)
                .enumerate()
                .map(|(i, (&s, seq))| match s {
                    -1 => Ok(seq.len() - 1),
                    s if s >= 0 && (s as usize) < seq.len() => Ok(s as usize),
                    s => Err(ApiError::invalid(
                        if matches!(logprob_start_len, Value::Array(_)) {
                            format!("logprob_start_len[{i}]")
                        } else {
                            "logprob_start_len".into()
                        },
                        format!(
                            "logprob_start_len {s} out of range for an input of {} tokens \
                             (-1 or 0..{})",
                            seq.len(),
                            seq.len()
                        ),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        },
        top_n: per_input(Some(&top_logprobs_num), n, "top_logprobs_num", 0, |v| {
            v.as_u64().map(|x| x as usize)
        })?,
        candidates: candidate_lists(req.token_ids_logprob, n, &ready.limits)?,
    };
    let next = sampling.max_new_tokens == 1;
    let any_logprob = per.return_logprob.iter().any(|&b| b);
    // `top_logprobs_num` sizes the estimate below, which comes before `validate_spec`: a peer's
    // 2^64 - 1 is refused here, as the k it is, not summed into it.
    for (&top_n, _) in per
        .top_n
        .iter()
        .zip(&per.return_logprob)
        .filter(|(_, &r)| r)
    {
        check_k(top_n, names.k, &ready.limits)?;
    }
    // The answer as sent is estimated before anything is copied or scored.
    let with_text = req.return_text_in_logprobs.unwrap_or(false);
    check_answer_size(
        answer_estimate(&per, &sequences, next, with_text, vocab.mean_text_json()),
        "of JSON",
        names.sequences,
        &ready.limits,
    )?;

    // Score the requested input rows (and the next row), or nothing at all (the inputs are
    // still checked).
    let starts: Vec<usize> = (0..n)
        .map(|i| {
            if per.return_logprob[i] {
                per.start[i]
            } else {
                sequences[i].len() - 1
            }
        })
        .collect();
    let candidates = match &per.candidates {
        None => CandidateSpec::None,
        Some(lists) => CandidateSpec::PerRow(
            lists
                .iter()
                .zip(&sequences)
                .zip(&starts)
                .map(|((l, s), &start)| vec![l.clone(); s.len() - 1 - start + next as usize])
                .collect(),
        ),
    };
    let k = (0..n)
        .filter(|&i| per.return_logprob[i])
        .map(|i| per.top_n[i])
        .max()
        .unwrap_or(0);
    let spec = ScoreSpec {
        starts,
        per_sequence_start: false,
        candidates,
        params: ScoreParams {
            k,
            temperature,
            values: ValuesKind::Logprobs,
            ranks: false,
            next: next.then(|| next_token_mode(greedy, None, &sequences)),
            hidden: false,
        },
        names,
        sequences: sequences.clone(),
    };
    let valid = validate_spec(spec, &ready.limits)?;
    let scores = if any_logprob || next {
        Some(engine::score(st, &valid).await?)
    } else {
        None
    };
    let rid = match rid {
        Value::String(s) => Some(s),
        _ => None,
    };
    let answer = Answer {
        vocab: vocab.clone(),
        sequences,
        per,
        scores,
        batch,
        with_text,
        max_new_tokens: sampling.max_new_tokens,
        rid,
        seconds: t0.elapsed().as_secs_f64(),
    };
    encode_json(st, answer).await
}

/// Bytes of one `[logprob, token_id, text_or_null]` triple besides its text:
/// `[-1.17549435e-38,151935,…],`.
const TRIPLE_JSON: usize = 32;

/// The answer's size as sent, estimated before scoring: per input 320 bytes (text and
/// meta_info); with `return_logprob`, per input row (and the generated token's) one triple for
/// the token, `top_logprobs_num` triples and one per candidate id. A triple is [`TRIPLE_JSON`]
/// bytes plus, with `return_text_in_logprobs`, a token text of `text_json` bytes (the
/// vocabulary's mean JSON length): an estimate, not a bound.
fn answer_estimate(
    per: &PerInput,
    sequences: &[Vec<u32>],
    next: bool,
    with_text: bool,
    text_json: usize,
) -> usize {
    let triple = TRIPLE_JSON + if with_text { text_json } else { 4 };
    sequences
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if !per.return_logprob[i] {
                return 320;
            }
            let rows = s.len() - per.start[i] + next as usize;
            let m = per.candidates.as_ref().map_or(0, |c| c[i].len());
            let per_row = (1 + per.top_n[i] + m).saturating_mul(triple);
            320usize.saturating_add(rows.saturating_mul(per_row))
        })
        .fold(0usize, usize::saturating_add)
}

/// Everything the answer is written from.
struct Answer {
    vocab: Arc<Vocab>,
    sequences: Vec<Vec<u32>>,
    per: PerInput,
    scores: Option<Vec<Arc<SequenceScores>>>,
    /// A list answer (the request sent a batch) or a single object.
    batch: bool,
    with_text: bool,
    max_new_tokens: usize,
    rid: Option<String>,
    seconds: f64,
}

impl Serialize for Answer {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let outputs = (0..self.sequences.len()).map(|i| Output { a: self, i });
        if self.batch {
            let mut seq = s.serialize_seq(Some(self.sequences.len()))?;
            for o in outputs {
                seq.serialize_element(&o)?;
            }
            seq.end()
        } else {
            match outputs.into_iter().next() {
                Some(o) => o.serialize(s),
                None => Value::Null.serialize(s),
            }
        }
    }
}

/// The answer for input `i`.
struct Output<'a> {
    a: &'a Answer,
    i: usize,
}

/// `[logprob, token_id, text_or_null]`.
fn triple(lp: f32, id: u32, vocab: &Vocab, with_text: bool) -> (f32, u32, Option<&str>) {
    (wire_logprob(lp), id, with_text.then(|| vocab.text(id)))
}

impl Serialize for Output<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (a, i) = (self.a, self.i);
        let ids = &a.sequences[i];
        let sc = a.scores.as_ref().map(|v| &*v[i]);
        let next = sc.and_then(|s| s.next_token);
        let text = next.map(|t| a.vocab.text(t)).unwrap_or("");
        let mut meta = serde_json::Map::new();
        let id = a.rid.clone().unwrap_or_else(|| request_id(""));
        meta.insert("id".into(), json!(id));
        meta.insert(
            "finish_reason".into(),
            json!({"type": "length", "length": a.max_new_tokens}),
        );
        meta.insert("prompt_tokens".into(), json!(ids.len()));
        meta.insert("completion_tokens".into(), json!(a.max_new_tokens));
        meta.insert("cached_tokens".into(), json!(0));
        meta.insert("e2e_latency".into(), json!(a.seconds));
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("text", text)?;
        match (a.per.return_logprob[i], sc) {
            (true, Some(sc)) => {
                let logprobs = InputLogprobs {
                    a,
                    ids,
                    sc,
                    start: a.per.start[i],
                    top_n: a.per.top_n[i],
                    candidates: a.per.candidates.as_ref().map(|c| c[i].as_slice()),
                };
                m.serialize_entry("meta_info", &MetaInfo { meta, logprobs })?;
            }
            _ => m.serialize_entry("meta_info", &meta)?,
        }
        m.end()
    }
}

struct MetaInfo<'a> {
    meta: serde_json::Map<String, Value>,
    logprobs: InputLogprobs<'a>,
}

/// The log-prob lists of one input: rows `0..n_input` of `sc` are the input positions
/// `start..S-1`; the row after them (if any) is the generated token's.
struct InputLogprobs<'a> {
    a: &'a Answer,
    ids: &'a [u32],
    sc: &'a SequenceScores,
    start: usize,
    top_n: usize,
    /// This input's `token_ids_logprob`, if any.
    candidates: Option<&'a [u32]>,
}

impl InputLogprobs<'_> {
    fn input_rows(&self) -> usize {
        self.ids.len() - 1 - self.start
    }
    /// The top `top_n` of row `r` as triples.
    fn top(&self, r: usize) -> Vec<(f32, u32, Option<&str>)> {
        let (v, w) = (self.a.vocab.as_ref(), self.a.with_text);
        let ids = &self.sc.ids_row(r)[..self.top_n];
        let vals = &self.sc.values_row(r)[..self.top_n];
        ids.iter()
            .zip(vals)
            .map(|(&id, &lp)| triple(lp, id, v, w))
            .collect()
    }
    /// The candidate ids of row `r` as triples.
    fn candidates(&self, r: usize, list: &[u32]) -> Vec<(f32, u32, Option<&str>)> {
        let (v, w) = (self.a.vocab.as_ref(), self.a.with_text);
        list.iter()
            .zip(self.sc.ids_logprobs_row(r))
            .map(|(&id, &lp)| triple(lp, id, v, w))
            .collect()
    }
}

impl Serialize for MetaInfo<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let l = &self.logprobs;
        let (v, w) = (l.a.vocab.as_ref(), l.a.with_text);
        let n_in = l.input_rows();
        let out_row = (l.sc.next_token.is_some()).then_some(n_in);
        let mut m = s.serialize_map(None)?;
        for (k, val) in &self.meta {
            m.serialize_entry(k, val)?;
        }
        // input_token_logprobs: [null, ids[start]] then the row that predicted each next token.
        let mut input_tok = Vec::with_capacity(n_in + 1);
        input_tok.push((None, l.ids[l.start], w.then(|| v.text(l.ids[l.start]))));
        for r in 0..n_in {
            let t = triple(l.sc.target_logprobs[r], l.ids[l.start + r + 1], v, w);
            input_tok.push((Some(t.0), t.1, t.2));
        }
        m.serialize_entry("input_token_logprobs", &input_tok)?;
        let output_tok: Vec<_> = out_row
            .map(|r| triple(l.sc.target_logprobs[r], l.sc.next_token.unwrap_or(0), v, w))
            .into_iter()
            .collect();
        m.serialize_entry("output_token_logprobs", &output_tok)?;
        if l.top_n > 0 {
            let mut tops: Vec<Option<Vec<_>>> = vec![None];
            tops.extend((0..n_in).map(|r| Some(l.top(r))));
            m.serialize_entry("input_top_logprobs", &tops)?;
            let out: Vec<_> = out_row.map(|r| l.top(r)).into_iter().collect();
            m.serialize_entry("output_top_logprobs", &out)?;
        }
        if let Some(list) = l.candidates {
            let mut rows: Vec<Option<Vec<_>>> = vec![None];
            rows.extend((0..n_in).map(|r| Some(l.candidates(r, list))));
            m.serialize_entry("input_token_ids_logprobs", &rows)?;
            let out: Vec<_> = out_row.map(|r| l.candidates(r, list)).into_iter().collect();
            m.serialize_entry("output_token_ids_logprobs", &out)?;
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_input_values_and_sampling() {
        let v = json!([1, 2]);
        assert_eq!(
            per_input(Some(&v), 2, "x", 0, Value::as_i64).unwrap(),
            vec![1, 2]
        );
        assert_eq!(
            per_input(Some(&json!(3)), 2, "x", 0, Value::as_i64).unwrap(),
            vec![3, 3]
        );
        assert_eq!(
            per_input(None, 2, "x", 7, Value::as_i64).unwrap(),
            vec![7, 7]
        );
        assert!(per_input(Some(&v), 3, "x", 0, Value::as_i64).is_err());
        let s = sampling_of(Some(&json!({"max_new_tokens": 1, "temperature": 0})), 1).unwrap();
        assert_eq!((s.max_new_tokens, s.temperature), (1, Some(0.0)));
        assert!(matches!(
            sampling_of(Some(&json!({"max_new_tokens": 2})), 1),
            Err(ApiError::Unsupported { .. })
        ));
        let same = json!([{"max_new_tokens": 0}, {"max_new_tokens": 0}]);
        assert_eq!(sampling_of(Some(&same), 2).unwrap().max_new_tokens, 0);
        let differ = json!([{"max_new_tokens": 0}, {"max_new_tokens": 1}]);
        assert!(sampling_of(Some(&differ), 2).is_err());
        assert_eq!(sampling_of(None, 1).unwrap().max_new_tokens, 0);
    }

    #[test]
    fn candidate_lists_shared_or_per_input() {
        let lim = crate::request::RequestLimits {
            vocab_size: 100,
            max_k: 2,
            max_seq_len: 16,
            max_queue_tokens: 64,
            max_sequences: 4,
            max_answer_bytes: 1 << 20,
        };
        let raw = |j: &str| -> Box<RawValue> { serde_json::from_str(j).unwrap() };
        let lists = |j: &str| candidate_lists(Some(&raw(j)), 2, &lim);
        assert_eq!(lists("[3, 4]").unwrap(), Some(vec![vec![3, 4], vec![3, 4]]));
        assert_eq!(
            lists("[[3], [4, 5]]").unwrap(),
            Some(vec![vec![3], vec![4, 5]])
        );
        assert_eq!(lists("[]").unwrap(), Some(vec![vec![], vec![]]));
        assert!(lists("[[3]]").is_err());
        // Past --max-k ids in one list: refused while reading, naming the list.
        let e = lists("[[3], [4, 5, 6]]").unwrap_err();
        assert_eq!(
            e.body().error.field.as_deref(),
            Some("token_ids_logprob[1]")
        );
        assert_eq!(candidate_lists(None, 2, &lim).unwrap(), None);
    }
}
