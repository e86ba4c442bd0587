//! Admission before work on the compatible routes: their inputs (token ids, texts, candidate
//! lists) are decoded straight from the body's JSON by visitors that count as they read, and
//! refused as soon as a limit is passed — before anything is tokenized, and without ever
//! building a tree of JSON values (which costs 20–60 bytes per id: a 64 MiB body of one-token
//! prompts took the teacher to 4.3 GB before its 413).
//!
//! The limits are the engine's ([`RequestLimits`]), applied early where they can be known:
//! - inputs per request: `--max-sequences` (413 `too_many_sequences`, with the exact count);
//! - ids per input: `--max-seq-len` (422, as [`crate::validation`] says it);
//! - ids in all: more than `--max-queue-tokens` plus one per input can never be admitted (413);
//! - text bytes: a text prompt is bounded in bytes before tokenization. No token covers more
//!   than [`Admission::bytes_per_token`] bytes (the longest single-token text of the vocabulary,
//!   plus one for a leading space), so a text longer than `max-seq-len × bytes_per_token` bytes
//!   cannot fit and is refused with 413 `input_too_large`; all texts of a request together are
//!   bounded by `max-queue-tokens × bytes_per_token`.
//!
//! Small fields (per-input flags, sampling parameters) are bounded in bytes before they are
//! parsed ([`small`]), so no field can be made to build a large tree either.

mod ids;

use super::{Input, Inputs};
use crate::error::ApiError;
use crate::request::RequestLimits;
use ids::IdsSeed;
use serde::de::{self, DeserializeSeed, IgnoredAny, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use std::fmt;

/// What one request may bring, from the server's limits.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    pub max_inputs: usize,
    /// Most ids in one input.
    pub max_ids: usize,
    /// Most ids in all inputs together.
    pub max_total_ids: usize,
    /// Most bytes of one text input.
    pub max_text_bytes: usize,
    /// Most bytes of all text inputs together.
    pub max_total_text_bytes: usize,
    pub bytes_per_token: usize,
    /// What the ids of one input are (for the error past `max_ids`).
    pub ids_are: IdsAre,
}

/// What a list of ids is, for the error when it is too long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdsAre {
    /// A sequence to score: past `--max-seq-len`, the validator's 422.
    Sequence,
    /// Candidate ids of a row: past `--max-k`, 422.
    Candidates,
    /// Ids to detokenize: past `--max-queue-tokens`, 413.
    Detokenize,
}

impl Admission {
    /// The limits for scoring inputs: `lim`, and a tokenizer whose longest token covers
    /// `bytes_per_token` bytes.
    pub fn scoring(lim: &RequestLimits, bytes_per_token: usize) -> Admission {
        let bpt = bytes_per_token.max(1);
        Admission {
            max_inputs: lim.max_sequences,
            max_ids: lim.max_seq_len,
            max_total_ids: lim.max_queue_tokens.saturating_add(lim.max_sequences),
            max_text_bytes: lim.max_seq_len.saturating_mul(bpt),
            max_total_text_bytes: lim.max_queue_tokens.saturating_mul(bpt),
            bytes_per_token: bpt,
            ids_are: IdsAre::Sequence,
        }
    }

    /// Candidate-id lists (SGLang's `token_ids_logprob`): one per input, at most `max_k` ids each.
    pub fn candidates(lim: &RequestLimits) -> Admission {
        Admission {
            max_inputs: lim.max_sequences,
            max_ids: lim.max_k,
            max_total_ids: lim.max_sequences.saturating_mul(lim.max_k),
            max_text_bytes: 0,
            max_total_text_bytes: 0,
            bytes_per_token: 1,
            ids_are: IdsAre::Candidates,
        }
    }
}

/// Most bytes of JSON a small field may take: room for one short value per input.
pub fn small_field_bytes(lim: &RequestLimits) -> usize {
    4096usize.saturating_add(lim.max_sequences.saturating_mul(256))
}

/// Parses a small field (flags, numbers, sampling parameters) after checking its size in bytes.
pub fn small(raw: Option<&RawValue>, field: &str, max_bytes: usize) -> Result<Value, ApiError> {
    let Some(raw) = raw else {
        return Ok(Value::Null);
    };
    let text = raw.get();
    if text.len() > max_bytes {
        return Err(ApiError::InputTooLarge {
            field: field.to_string(),
            message: format!(
                "{field} takes {} bytes of JSON, more than the {max_bytes} it can need \
                 for --max-sequences inputs",
                text.len()
            ),
        });
    }
    serde_json::from_str(text).map_err(|e| ApiError::invalid(field, format!("invalid JSON: {e}")))
}

/// Decodes ids or text as these APIs accept them: one (`[ids]`, `"text"`) or a batch
/// (`[[ids], ...]`, `["text", ...]`), naming `field` (and the index) in every error.
pub fn inputs(raw: &RawValue, field: &str, adm: &Admission) -> Result<Inputs, ApiError> {
    let mut state = State {
        field,
        adm,
        error: None,
        total_ids: 0,
        total_text: 0,
    };
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let out = TopSeed { st: &mut state }.deserialize(&mut de);
    match (out, state.error) {
        (_, Some(e)) => Err(e),
        (Ok(inputs), None) => Ok(inputs),
        (Err(e), None) => Err(ApiError::invalid(field, e.to_string())),
    }
}

/// A list of token ids alone (`/detokenize`'s `tokens`): at most `--max-queue-tokens` of them,
/// so that the text decoded from them stays bounded too.
pub fn id_list(raw: &RawValue, field: &str, lim: &RequestLimits) -> Result<Vec<u32>, ApiError> {
    let adm = Admission {
        max_inputs: 1,
        max_ids: lim.max_queue_tokens,
        max_total_ids: usize::MAX,
        max_text_bytes: 0,
        max_total_text_bytes: 0,
        bytes_per_token: 1,
        ids_are: IdsAre::Detokenize,
    };
    let mut st = State {
        field,
        adm: &adm,
        error: None,
        total_ids: 0,
        total_text: 0,
    };
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let out = IdsSeed {
        st: &mut st,
        path: field.to_string(),
        first: None,
    }
    .deserialize(&mut de);
    match (out, st.error) {
        (_, Some(e)) => Err(e),
        (Ok(ids), None) => Ok(ids),
        (Err(_), None) => Err(ApiError::invalid(field, "a list of token ids is required")),
    }
}

/// What the visitors share: the limits, the running totals and the first refusal (a serde
/// error only stops the parser; the refusal itself travels here, with its field).
struct State<'a> {
    field: &'a str,
    adm: &'a Admission,
    error: Option<ApiError>,
    total_ids: usize,
    total_text: usize,
}

impl State<'_> {
    /// Records `e` (the first one wins) and returns the error that stops the parser.
    fn fail<E: de::Error>(&mut self, e: ApiError) -> E {
        if self.error.is_none() {
            self.error = Some(e);
        }
        E::custom("refused")
    }

    fn count_ids<E: de::Error>(&mut self, path: &str, n: usize) -> Result<(), E> {
        self.total_ids += n;
        if self.total_ids > self.adm.max_total_ids {
            let limit = self.adm.max_total_ids;
            return Err(self.fail(ApiError::InputTooLarge {
                field: path.to_string(),
                message: format!(
                    "more than {limit} token ids in one request: over --max-queue-tokens, it \
                     can never be admitted; split the request"
                ),
            }));
        }
        Ok(())
    }

    fn text<E: de::Error>(&mut self, path: String, s: &str) -> Result<Input, E> {
        let adm = *self.adm;
        if adm.max_text_bytes == 0 {
            return Err(self.fail(ApiError::invalid(path, "expected token ids, not text")));
        }
        if s.len() > adm.max_text_bytes {
            return Err(self.fail(ApiError::InputTooLarge {
                field: path,
                message: format!(
                    "text of {} bytes: no text over {} bytes fits --max-seq-len {} tokens \
                     (no token of this tokenizer covers more than {} bytes)",
                    s.len(),
                    adm.max_text_bytes,
                    adm.max_ids,
                    adm.bytes_per_token
                ),
            }));
        }
        self.total_text += s.len();
        if self.total_text > adm.max_total_text_bytes {
            return Err(self.fail(ApiError::InputTooLarge {
                field: path,
                message: format!(
                    "more than {} bytes of text in one request: it cannot fit \
                     --max-queue-tokens; split the request",
                    adm.max_total_text_bytes
                ),
            }));
        }
        Ok(Input::Text(s.to_string()))
    }
}

const SHAPES: &str = "expected token ids, a list of token-id lists, text or a list of texts";

/// The whole field: a text, a list of ids, a list of texts or a list of id lists.
struct TopSeed<'s, 'a> {
    st: &'s mut State<'a>,
}

impl<'de> DeserializeSeed<'de> for TopSeed<'_, '_> {
    type Value = Inputs;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Inputs, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TopSeed<'_, '_> {
    type Value = Inputs;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(SHAPES)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Inputs, E> {
        let path = self.st.field.to_string();
        let item = self.st.text(path, s)?;
        Ok(Inputs {
            items: vec![item],
            batch: false,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Inputs, A::Error> {
        let st = self.st;
        let field = st.field.to_string();
        // The first element decides the shape.
        let Some(first) = seq.next_element_seed(ElemSeed {
            st,
            path: format!("{field}[0]"),
        })?
        else {
            return Err(st.fail(ApiError::invalid(field, "empty prompt")));
        };
        match first {
            Elem::Id(id) => {
                // One list of ids: the rest are ids too.
                let rest = IdsSeed {
                    st,
                    path: field.clone(),
                    first: Some(id),
                };
                let ids = rest.visit_rest(seq)?;
                Ok(Inputs {
                    items: vec![Input::Ids(ids)],
                    batch: false,
                })
            }
            Elem::Text(t) | Elem::Ids(t) => {
                let text_batch = matches!(t, Input::Text(_));
                let mut items = vec![t];
                loop {
                    let i = items.len();
                    let path = format!("{field}[{i}]");
                    if i >= st.adm.max_inputs {
                        // Count the rest without keeping it, for an exact error.
                        let mut n = i;
                        while seq.next_element::<IgnoredAny>()?.is_some() {
                            n += 1;
                        }
                        if n > st.adm.max_inputs {
                            return Err(st.fail(ApiError::TooManySequences {
                                field: field.clone(),
                                sequences: n,
                                limit: st.adm.max_inputs,
                            }));
                        }
                        break;
                    }
                    let next = if text_batch {
                        seq.next_element_seed(TextSeed { st, path })?
                    } else {
                        seq.next_element_seed(IdsSeed {
                            st,
                            path,
                            first: None,
                        })?
                        .map(Input::Ids)
                    };
                    match next {
                        Some(item) => items.push(item),
                        None => break,
                    }
                }
                Ok(Inputs { items, batch: true })
            }
        }
    }

    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Inputs, A::Error> {
        let field = self.st.field.to_string();
        Err(self.st.fail(ApiError::invalid(field, SHAPES)))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Inputs, E> {
        let field = self.st.field.to_string();
        Err(self.st.fail(ApiError::invalid(field, SHAPES)))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Inputs, E> {
        self.visit_bool(false)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Inputs, E> {
        self.visit_bool(false)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Inputs, E> {
        self.visit_bool(false)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Inputs, E> {
        self.visit_bool(false)
    }
}

/// The first element of a list: an id, a text, or a list of ids.
enum Elem {
    Id(u32),
    Text(Input),
    Ids(Input),
}

struct ElemSeed<'s, 'a> {
    st: &'s mut State<'a>,
    path: String,
}

impl<'de> DeserializeSeed<'de> for ElemSeed<'_, '_> {
    type Value = Elem;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Elem, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ElemSeed<'_, '_> {
    type Value = Elem;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id, a text or a list of token ids")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Elem, E> {
        match u32::try_from(v) {
            Ok(id) => {
                self.st.count_ids::<E>(&self.path, 1)?;
                Ok(Elem::Id(id))
            }
            Err(_) => Err(not_an_id(self.st, self.path, &v.to_string())),
        }
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Elem, E> {
        match u64::try_from(v) {
            Ok(u) => self.visit_u64(u),
            Err(_) => Err(not_an_id(self.st, self.path, &v.to_string())),
        }
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Elem, E> {
        Err(not_an_id(self.st, self.path, &v.to_string()))
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Elem, E> {
        Ok(Elem::Text(self.st.text(self.path, s)?))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Elem, A::Error> {
        let ids = IdsSeed {
            st: self.st,
            path: self.path,
            first: None,
        }
        .visit_seq(seq)?;
        Ok(Elem::Ids(Input::Ids(ids)))
    }
    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Elem, A::Error> {
        Err(self.st.fail(ApiError::invalid(self.path, SHAPES)))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Elem, E> {
        Err(self.st.fail(ApiError::invalid(self.path, SHAPES)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Elem, E> {
        Err(self.st.fail(ApiError::invalid(self.path, SHAPES)))
    }
}

fn not_an_id<E: de::Error>(st: &mut State, path: String, v: &str) -> E {
    st.fail(ApiError::invalid(path, format!("{v} is not a token id")))
}

/// A text element of a batch of texts.
struct TextSeed<'s, 'a> {
    st: &'s mut State<'a>,
    path: String,
}

impl<'de> DeserializeSeed<'de> for TextSeed<'_, '_> {
    type Value = Input;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Input, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TextSeed<'_, '_> {
    type Value = Input;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Input, E> {
        self.st.text(self.path, s)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Input, A::Error> {
        Err(self.wrong())
    }
    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Input, A::Error> {
        Err(self.wrong())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Input, E> {
        Err(self.wrong())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Input, E> {
        Err(self.wrong())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Input, E> {
        Err(self.wrong())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Input, E> {
        Err(self.wrong())
    }
    fn visit_unit<E: de::Error>(self) -> Result<Input, E> {
        Err(self.wrong())
    }
}

impl TextSeed<'_, '_> {
    fn wrong<E: de::Error>(self) -> E {
        self.st.fail(ApiError::invalid(
            self.path,
            "expected a string like the other items",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adm(max_inputs: usize, max_ids: usize) -> Admission {
        Admission {
            max_inputs,
            max_ids,
            max_total_ids: 10,
            max_text_bytes: 8,
            max_total_text_bytes: 12,
            bytes_per_token: 2,
            ids_are: IdsAre::Sequence,
        }
    }

    fn run(json: &str, a: &Admission) -> Result<Inputs, ApiError> {
        let raw: Box<RawValue> = serde_json::from_str(json).unwrap();
        inputs(&raw, "prompt", a)
    }

    fn ids_of(i: Inputs) -> Vec<Vec<u32>> {
        i.items
            .into_iter()
            .map(|x| match x {
                Input::Ids(v) => v,
                Input::Text(t) => panic!("text {t}"),
            })
            .collect()
    }

    fn err(json: &str, a: &Admission) -> (u16, String, Option<String>) {
        let e = run(json, a).unwrap_err();
        let b = e.body();
        (e.status().as_u16(), b.error.message, b.error.field)
    }

    #[test]
    fn every_shape_decodes() {
        let a = adm(4, 4);
        let one = run("[1, 2, 3]", &a).unwrap();
        assert!(!one.batch);
        assert_eq!(ids_of(one), vec![vec![1, 2, 3]]);
        let two = run("[[1], [2, 3]]", &a).unwrap();
        assert!(two.batch);
        assert_eq!(ids_of(two), vec![vec![1], vec![2, 3]]);
        let t = run("\"hi\"", &a).unwrap();
        assert_eq!(t.items, vec![Input::Text("hi".into())]);
        let ts = run("[\"a\", \"b\"]", &a).unwrap();
        assert!(ts.batch && ts.items.len() == 2);
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let a = adm(4, 4);
        let f = |j: &str| err(j, &a).2.unwrap();
        assert_eq!(f("[]"), "prompt");
        assert_eq!(f("7"), "prompt");
        assert_eq!(f("[1, -2]"), "prompt[1]");
        assert_eq!(f("[1, 5000000000]"), "prompt[1]");
        assert_eq!(f("[[1], [2, 1.5]]"), "prompt[1][1]");
        assert_eq!(f("[[1], 2]"), "prompt[1]");
        assert_eq!(f("[\"a\", 2]"), "prompt[1]");
        assert_eq!(f("[{}]"), "prompt[0]");
    }

    #[test]
    fn limits_are_refused_while_reading() {
        let a = adm(2, 3);
        // Too many inputs: counted to the end, 413.
        let (status, msg, field) = err("[[1], [2], [3], [4]]", &a);
        assert_eq!((status, field.as_deref()), (413, Some("prompt")));
        assert!(
            msg.starts_with("4 sequences exceed --max-sequences 2"),
            "{msg}"
        );
        // Too many ids in one input: the validator's 422, with the exact length.
        let (status, msg, field) = err("[[1, 2, 3, 4, 5]]", &a);
        assert_eq!((status, field.as_deref()), (422, Some("prompt[0]")));
        assert!(
            msg.contains("sequence of 5 tokens exceeds max-seq-len 3"),
            "{msg}"
        );
        let (status, _, field) = err("[1, 2, 3, 4]", &a);
        assert_eq!((status, field.as_deref()), (422, Some("prompt")));
        // Too many ids in all.
        let b = adm(10, 3);
        let (status, _, _) = err("[[1,2,3],[1,2,3],[1,2,3],[1,2]]", &b);
        assert_eq!(status, 413);
        // Text over its byte bound, and all texts over theirs.
        let (status, msg, field) = err("[\"ok\", \"123456789\"]", &a);
        assert_eq!((status, field.as_deref()), (413, Some("prompt[1]")));
        assert!(msg.contains("text of 9 bytes"), "{msg}");
        let (status, _, _) = err("[\"1234567\", \"1234567\"]", &a);
        assert_eq!(status, 413);
    }
}
