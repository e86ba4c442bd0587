//! vLLM's routes: `GET /v1/models`, `POST /v1/completions` (prompt log-probs, the scoring use of
//! it that TRL, Axolotl and the `openai` SDK make), `POST /tokenize`, `POST /detokenize`.
//!
//! `prompt_logprobs[p]` (p ≥ 1) is row `p - 1` of the engine (the distribution that predicted
//! token p): its top K by rank, then the actual token with its true rank when it is not among
//! them. Entry 0 is null. `max_tokens` is 0 or 1: this server scores, it does not generate.

use super::admit::{self, Admission};
use super::{
    decode, encode_json, next_token_mode, read_json, refuse_messages, request_id, respond,
    temperature_of, tokenize_inputs, unix_now, wire_logprob,
};
use crate::engine;
use crate::error::ApiError;
use crate::scoring::ScoreParams;
use crate::state::{AppState, Ready};
use crate::validation::{check_answer_size, validate_spec, CandidateSpec, FieldNames, ScoreSpec};
use crate::vocab::Vocab;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::sync::Arc;
use xdistill_shared::protocol::{SequenceScores, ValuesKind};

type Shared = Arc<AppState>;

/// Field names of `/v1/completions`, for errors.
const FIELDS: FieldNames = FieldNames {
    sequences: "prompt",
    k: "prompt_logprobs",
    temperature: "temperature",
    start: "prompt",
    ids: "prompt",
};

/// The fields of a completion request that this server reads; every other field is ignored.
/// The prompt stays raw JSON until [`admit`] has counted it.
#[derive(Debug, Deserialize)]
struct CompletionRequest<'a> {
    model: Option<String>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    /// Chat messages: refused (no chat template), with or without a prompt.
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    /// 0 or 1 (default 1; vLLM's default of 16 would be generation).
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    prompt_logprobs: Option<i64>,
    /// Legacy log-probs (with `echo`: of the prompt too).
    logprobs: Option<i64>,
    echo: Option<bool>,
    n: Option<i64>,
    seed: Option<i64>,
    add_special_tokens: Option<bool>,
    return_tokens_as_token_ids: Option<bool>,
    stream: Option<bool>,
}

/// `GET /v1/models`: the one served model.
pub async fn models(State(st): State<Shared>) -> Response {
    respond(st.ready().map(|r| {
        axum::Json(json!({
            "object": "list",
            "data": [{
                "id": st.config.served_model_name,
                "object": "model",
                "created": unix_now(),
                "owned_by": "xdistill",
                "root": st.config.served_model_name,
                "max_model_len": r.limits.max_seq_len,
            }],
        }))
        .into_response()
    }))
}

/// The `model` field must name the served model, when given.
fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != st.config.served_model_name => {
            Err(ApiError::ModelNotFound(m.to_string()))
        }
        _ => Ok(()),
    }
}

/// A log-prob count (`prompt_logprobs`, `logprobs`): -1 is the whole vocabulary, allowed only up
/// to `--max-k`; the error message is vLLM's.
fn logprob_count(
    n: Option<i64>,
    field: &str,
    what: &str,
    r: &Ready,
) -> Result<Option<usize>, ApiError> {
    let (vocab, max_k) = (r.limits.vocab_size, r.limits.max_k);
    match n {
        None => Ok(None),
        Some(-1) if vocab <= max_k => Ok(Some(vocab)),
        Some(-1) => Err(ApiError::unsupported(
            field,
            format!(
                "Requested {what} logprobs of -1 (the whole vocabulary of {vocab} ids), which is \
                 greater than max allowed: {max_k}"
            ),
        )),
        Some(k) if k < -1 => Err(ApiError::invalid(field, format!("must be >= -1, got {k}"))),
        Some(k) if k as u64 > max_k as u64 => Err(ApiError::unsupported(
            field,
            format!("Requested {what} logprobs of {k}, which is greater than max allowed: {max_k}"),
        )),
        Some(k) => Ok(Some(k as usize)),
    }
}

/// What one completion request asks for, after its own checks.
struct Plan {
    /// Entries of `prompt_logprobs` (None: the field is null).
    prompt_k: Option<usize>,
    /// Entries of the legacy `logprobs` object (None: null).
    legacy_k: Option<usize>,
    echo: bool,
    max_tokens: usize,
    as_token_ids: bool,
}

impl Plan {
    /// Whether any prompt position needs scores.
    fn prompt_rows(&self) -> bool {
        self.prompt_k.is_some() || (self.echo && self.legacy_k.is_some())
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    respond(complete(&st, &headers, body).await)
}

async fn complete(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let ready = st.ready()?;
    let bytes = read_json(st, headers, body).await?;
    let req: CompletionRequest = decode(&bytes)?;
    check_model(st, req.model.as_deref())?;
    refuse_messages(req.messages)?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::unsupported(
            "n",
            "only n = 1 is supported: this server scores, it does not generate",
        ));
    }
    if req.stream == Some(true) {
        return Err(ApiError::unsupported(
            "stream",
            "streaming is not supported",
        ));
    }
    let max_tokens = match req.max_tokens.unwrap_or(1) {
        n @ (0 | 1) => n as usize,
        n => {
            return Err(ApiError::unsupported(
                "max_tokens",
                format!(
                    "max_tokens = {n}: at most 1 (this server scores prompts with \
                     prompt_logprobs; it does not generate)"
                ),
            ))
        }
    };
    let echo = req.echo.unwrap_or(false);
    let legacy_k = logprob_count(req.logprobs, "logprobs", "sample", ready)?;
    // With echo and no prompt_logprobs, prompt_logprobs takes the value of logprobs (vLLM).
    let prompt_n = req
        .prompt_logprobs
        .or(if echo { req.logprobs } else { None });
    let plan = Plan {
        prompt_k: logprob_count(prompt_n, "prompt_logprobs", "prompt", ready)?,
        legacy_k,
        echo,
        max_tokens,
        as_token_ids: req.return_tokens_as_token_ids.unwrap_or(false),
    };
    let (temperature, greedy) = temperature_of(req.temperature, "temperature")?;
    let prompt = req
        .prompt
        .ok_or_else(|| ApiError::invalid("prompt", "a prompt is required"))?;
    let vocab = &ready.facts.vocab;
    let adm = Admission::scoring(&ready.limits, vocab.bytes_per_token());
    let inputs = admit::inputs(prompt, "prompt", &adm)?;
    let texts: Vec<Option<String>> = inputs
        .items
        .iter()
        .map(|i| match i {
            super::Input::Text(t) => Some(t.clone()),
            super::Input::Ids(_) => None,
        })
        .collect();
    let add_special = req.add_special_tokens.unwrap_or(true);
    let sequences = tokenize_inputs(vocab, inputs, add_special).await?;
    if let Some(i) = sequences.iter().position(Vec::is_empty) {
        return Err(ApiError::invalid(format!("prompt[{i}]"), "empty prompt"));
    }
    check_context(&sequences, max_tokens, ready.limits.max_seq_len)?;
    // The answer as sent is estimated before anything is scored.
    check_answer_size(
        answer_estimate(
            &plan,
            sequences.iter().map(Vec::len),
            vocab.mean_text_json(),
        ),
        "of JSON",
        "prompt",
        &ready.limits,
    )?;

    // Score: the prompt rows when log-probs of them are asked for, the next row for a token;
    // nothing at all for `max_tokens: 0` without log-probs (the prompt is still checked).
    let score = plan.prompt_rows() || max_tokens == 1;
    let k = plan.prompt_k.unwrap_or(0).max(plan.legacy_k.unwrap_or(0));
    let spec = ScoreSpec {
        starts: sequences
            .iter()
            .map(|s| if plan.prompt_rows() { 0 } else { s.len() - 1 })
            .collect(),
        per_sequence_start: false,
        candidates: CandidateSpec::None,
        params: ScoreParams {
            k,
            temperature,
            values: ValuesKind::Logprobs,
            ranks: true,
            next: (max_tokens == 1)
                .then(|| next_token_mode(greedy, req.seed.map(|s| s as u64), &sequences)),
            hidden: false,
        },
        names: FIELDS,
        sequences,
    };
    let valid = validate_spec(spec, &ready.limits)?;
    let scores = if score {
        Some(engine::score(st, &valid).await?)
    } else {
        None
    };
    let answer = Answer {
        model: st.config.served_model_name.clone(),
        vocab: vocab.clone(),
        plan,
        sequences: valid.sequences.into_iter().map(|s| s.ids).collect(),
        texts,
        scores,
    };
    encode_json(st, answer).await
}

/// The prompt and the completion together must fit the model's context, as vLLM counts them
/// (`max_model_len`): a prompt of `max_model_len` tokens with `max_tokens: 1` is a 400.
fn check_context(
    sequences: &[Vec<u32>],
    max_tokens: usize,
    max_model_len: usize,
) -> Result<(), ApiError> {
    for (i, s) in sequences.iter().enumerate() {
        let total = s.len() + max_tokens;
        if total > max_model_len {
            let field = if sequences.len() == 1 {
                "prompt".to_string()
            } else {
                format!("prompt[{i}]")
            };
            return Err(ApiError::unsupported(
                field,
                format!(
                    "This model's maximum context length is {max_model_len} tokens. However, you \
                     requested {total} tokens ({} in the messages, {max_tokens} in the \
                     completion). Please reduce the length of the messages or completion.",
                    s.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Bytes of JSON of one `prompt_logprobs` entry besides its token text:
/// `"31999":{"logprob":-1.17549435e-38,"rank":31999,"decoded_token":…},`.
const ENTRY_JSON: usize = 64;

/// The answer's size as sent, estimated before scoring from the prompts' lengths: per choice
/// 256 bytes and its text; per `prompt_logprobs` position `k + 1` entries of [`ENTRY_JSON`]
/// bytes plus a token text; per legacy `logprobs` position the token, its log-prob, its
/// offset and `k + 1` `"text": logprob` pairs. Token texts count `text_json` bytes each (the
/// vocabulary's mean JSON length): an estimate, not a bound.
fn answer_estimate(plan: &Plan, sizes: impl Iterator<Item = usize>, text_json: usize) -> usize {
    let t = text_json;
    sizes
        .map(|s| {
            let text = if plan.echo { s * t } else { t };
            let prompt = plan
                .prompt_k
                .map_or(0, |k| s.saturating_sub(1) * (k + 1) * (ENTRY_JSON + t));
            let legacy = plan.legacy_k.map_or(0, |k| {
                let rows = if plan.echo { s } else { 0 } + plan.max_tokens;
                rows * (t + 1 + 16 + 8 + (k + 1) * (t + 16))
            });
            256usize
                .saturating_add(text)
                .saturating_add(prompt)
                .saturating_add(legacy)
        })
        .fold(0usize, usize::saturating_add)
}

/// Everything the response is written from (serialised off the async threads).
struct Answer {
    model: String,
    vocab: Arc<Vocab>,
    plan: Plan,
    /// The validated prompts (shared with the engine's jobs, not copied).
    sequences: Vec<Arc<[u32]>>,
    /// The prompt as text, when it was given as text.
    texts: Vec<Option<String>>,
    /// One per prompt, when anything was scored.
    scores: Option<Vec<Arc<SequenceScores>>>,
}

impl Serialize for Answer {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let prompt_tokens: usize = self.sequences.iter().map(|s| s.len()).sum();
        let completion_tokens = self.plan.max_tokens * self.sequences.len();
        let choices: Vec<Choice<'_>> = (0..self.sequences.len())
            .map(|i| Choice { a: self, i })
            .collect();
        let mut m = s.serialize_map(Some(6))?;
        m.serialize_entry("id", &request_id("cmpl-"))?;
        m.serialize_entry("object", "text_completion")?;
        m.serialize_entry("created", &unix_now())?;
        m.serialize_entry("model", &self.model)?;
        m.serialize_entry("choices", &choices)?;
        m.serialize_entry(
            "usage",
            &json!({
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }),
        )?;
        m.end()
    }
}

/// `choices[i]`.
struct Choice<'a> {
    a: &'a Answer,
    i: usize,
}

impl Choice<'_> {
    fn scores(&self) -> Option<&SequenceScores> {
        self.a.scores.as_ref().map(|s| &*s[self.i])
    }
    fn next_token(&self) -> Option<u32> {
        self.scores().and_then(|s| s.next_token)
    }
    /// The prompt's text: as given, or decoded from its ids.
    fn prompt_text(&self) -> String {
        match &self.a.texts[self.i] {
            Some(t) => t.clone(),
            None => self
                .a
                .vocab
                .decode(&self.a.sequences[self.i])
                .unwrap_or_default(),
        }
    }
}

impl Serialize for Choice<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (a, plan) = (self.a, &self.a.plan);
        let generated = self.next_token().map(|t| a.vocab.text(t)).unwrap_or("");
        let text = if plan.echo {
            self.prompt_text() + generated
        } else {
            generated.to_string()
        };
        let mut m = s.serialize_map(Some(7))?;
        m.serialize_entry("index", &self.i)?;
        m.serialize_entry("text", &text)?;
        match (plan.legacy_k, self.scores()) {
            (Some(k), Some(sc)) => m.serialize_entry("logprobs", &Legacy { c: self, sc, k })?,
            _ => m.serialize_entry("logprobs", &Value::Null)?,
        }
        m.serialize_entry("finish_reason", "length")?;
        m.serialize_entry("stop_reason", &Value::Null)?;
        match (plan.prompt_k, self.scores()) {
            (Some(k), Some(sc)) => m.serialize_entry(
                "prompt_logprobs",
                &PromptLogprobs {
                    ids: &a.sequences[self.i],
                    sc,
                    k,
                    vocab: &a.vocab,
                },
            )?,
            _ => m.serialize_entry("prompt_logprobs", &Value::Null)?,
        }
        m.end()
    }
}

/// `prompt_logprobs`: `[null, {id: entry, ...}, ...]`, one entry per prompt token.
struct PromptLogprobs<'a> {
    ids: &'a [u32],
    sc: &'a SequenceScores,
    k: usize,
    vocab: &'a Vocab,
}

impl Serialize for PromptLogprobs<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.ids.len()))?;
        seq.serialize_element(&Value::Null)?;
        for p in 1..self.ids.len() {
            seq.serialize_element(&Position {
                sc: self.sc,
                row: p - 1,
                target: self.ids[p],
                k: self.k,
                vocab: self.vocab,
            })?;
        }
        seq.end()
    }
}

/// One position: the top `k` by rank, then the actual token when it is not among them.
struct Position<'a> {
    sc: &'a SequenceScores,
    row: usize,
    target: u32,
    k: usize,
    vocab: &'a Vocab,
}

#[derive(Serialize)]
struct Entry<'a> {
    logprob: f32,
    rank: u32,
    decoded_token: &'a str,
}

impl Serialize for Position<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (ids, vals) = (self.sc.ids_row(self.row), self.sc.values_row(self.row));
        let (ids, vals) = (&ids[..self.k], &vals[..self.k]);
        let inside = ids.contains(&self.target);
        let mut m = s.serialize_map(Some(self.k + !inside as usize))?;
        for (j, (&id, &v)) in ids.iter().zip(vals).enumerate() {
            let e = Entry {
                logprob: wire_logprob(v),
                rank: j as u32 + 1,
                decoded_token: self.vocab.text(id),
            };
            // serde_json writes integer keys as strings: "42".
            m.serialize_entry(&id, &e)?;
        }
        if !inside {
            let e = Entry {
                logprob: wire_logprob(self.sc.target_logprobs[self.row]),
                rank: self.sc.target_ranks.get(self.row).copied().unwrap_or(0),
                decoded_token: self.vocab.text(self.target),
            };
            m.serialize_entry(&self.target, &e)?;
        }
        m.end()
    }
}

/// The legacy `logprobs` object: with `echo`, every prompt token then the generated one;
/// without, the generated token only. Keys of `top_logprobs` are token texts (or `token_id:N`).
struct Legacy<'a> {
    c: &'a Choice<'a>,
    sc: &'a SequenceScores,
    k: usize,
}

impl Serialize for Legacy<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (a, ids) = (self.c.a, &self.c.a.sequences[self.c.i]);
        let name = |id: u32| -> String {
            if a.plan.as_token_ids {
                format!("token_id:{id}")
            } else {
                a.vocab.text(id).to_string()
            }
        };
        // (token, row of the distribution that predicted it); the first prompt token has none.
        let mut covered: Vec<(u32, Option<usize>)> = Vec::new();
        if a.plan.echo {
            covered.push((ids[0], None));
            covered.extend((1..ids.len()).map(|p| (ids[p], Some(p - 1))));
        }
        if let Some(t) = self.sc.next_token {
            covered.push((t, Some(self.sc.rows - 1)));
        }
        let mut tokens = Vec::with_capacity(covered.len());
        let mut token_logprobs = Vec::with_capacity(covered.len());
        let mut top_logprobs = Vec::with_capacity(covered.len());
        let mut text_offset = Vec::with_capacity(covered.len());
        let mut offset = 0usize;
        for &(tok, row) in &covered {
            let t = name(tok);
            text_offset.push(offset);
            offset += a.vocab.text(tok).chars().count();
            tokens.push(t);
            match row {
                None => {
                    token_logprobs.push(Value::Null);
                    top_logprobs.push(Value::Null);
                }
                Some(r) => {
                    let lp = wire_logprob(self.sc.target_logprobs[r]);
                    token_logprobs.push(json!(lp));
                    let mut top = serde_json::Map::new();
                    let row_ids = &self.sc.ids_row(r)[..self.k];
                    let row_vals = &self.sc.values_row(r)[..self.k];
                    for (&id, &v) in row_ids.iter().zip(row_vals) {
                        top.entry(name(id)).or_insert(json!(wire_logprob(v)));
                    }
                    top.entry(name(tok)).or_insert(json!(lp));
                    top_logprobs.push(Value::Object(top));
                }
            }
        }
        json!({
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        })
        .serialize(s)
    }
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest<'a> {
    model: Option<String>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    add_special_tokens: Option<bool>,
    return_token_strs: Option<bool>,
}

/// `POST /tokenize`: `{"prompt": TEXT}` → `{"count", "max_model_len", "tokens", "token_strs"}`.
pub async fn tokenize(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    respond(
        async {
            let ready = st.ready()?;
            let bytes = read_json(&st, &headers, body).await?;
            let req: TokenizeRequest = decode(&bytes)?;
            check_model(&st, req.model.as_deref())?;
            refuse_messages(req.messages)?;
            let prompt = req
                .prompt
                .ok_or_else(|| ApiError::invalid("prompt", "a prompt is required"))?;
            let vocab = ready.facts.vocab.clone();
            let adm = Admission::scoring(&ready.limits, vocab.bytes_per_token());
            let inputs = admit::inputs(prompt, "prompt", &adm)?;
            if inputs.batch || !matches!(inputs.items[..], [super::Input::Text(_)]) {
                return Err(ApiError::invalid("prompt", "expected one text"));
            }
            let add = req.add_special_tokens.unwrap_or(true);
            let ids = tokenize_inputs(&vocab, inputs, add)
                .await?
                .pop()
                .unwrap_or_default();
            let strs = req.return_token_strs.unwrap_or(false).then(|| {
                ids.iter()
                    .map(|&id| vocab.token_str(id).unwrap_or_default())
                    .collect::<Vec<_>>()
            });
            Ok(axum::Json(json!({
                "count": ids.len(),
                "max_model_len": ready.limits.max_seq_len,
                "tokens": ids,
                "token_strs": strs,
            }))
            .into_response())
        }
        .await,
    )
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest<'a> {
    model: Option<String>,
    #[serde(borrow)]
    tokens: Option<&'a RawValue>,
}

/// `POST /detokenize`: `{"tokens": [ids]}` → `{"prompt": TEXT}`.
pub async fn detokenize(State(st): State<Shared>, headers: HeaderMap, body: Body) -> Response {
    respond(
        async {
            let ready = st.ready()?;
            let bytes = read_json(&st, &headers, body).await?;
            let req: DetokenizeRequest = decode(&bytes)?;
            check_model(&st, req.model.as_deref())?;
            let ids = match req.tokens {
                Some(raw) => admit::id_list(raw, "tokens", &ready.limits)?,
                None => {
                    return Err(ApiError::invalid(
                        "tokens",
                        "a list of token ids is required",
                    ))
                }
            };
            let vocab_size = ready.limits.vocab_size;
            if let Some(j) = ids.iter().position(|&id| id as usize >= vocab_size) {
                return Err(ApiError::invalid(
                    format!("tokens[{j}]"),
                    format!("token id {} >= vocab size {vocab_size}", ids[j]),
                ));
            }
            let text = ready.facts.vocab.decode(&ids).map_err(ApiError::Internal)?;
            Ok(axum::Json(json!({ "prompt": text })).into_response())
        }
        .await,
    )
}
