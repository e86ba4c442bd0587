//! Parsing a `tokenizer.json` (Hugging Face's format) into a [`Tokenizer`], the same tokenizer
//! the `tokenizers` crate's own parse gives, 1.3-2.1x faster for the BPE vocabularies models
//! ship (bench/README.md).
//!
//! The crate reads a file's `model` object through two intermediate trees (serde's buffered
//! content for an untagged enum, then a `serde_json::Value` with a sorted map of the whole
//! vocabulary) before its BPE reads it: Gemma 3's file (262k ids, 515k merges) took 1.57 s
//! there and 0.75 s here, paid by every teacher and trainer start and by the tests many times
//! over (553 loads in one run of the Rust tests). Here the
//! model object goes straight to the crate's own [`BPE`] deserializer, the small rest of the
//! file (normalizer, pre-tokenizer, post-processor, decoder, truncation, padding) is parsed by
//! the crate itself, and the added tokens are added after the model as the crate's parse adds
//! them. A model of another kind (WordPiece, Unigram, …), or anything unexpected, takes the
//! crate's whole parse, which also makes its error messages.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, ModelWrapper, Tokenizer};

/// The tokenizer `bytes` (a `tokenizer.json`) describes, or the `tokenizers` crate's error.
///
/// A file is untrusted input (a model directory's, or a teacher's `GET /tokenizer.json`), and
/// the crate panics on some broken ones instead of answering an error: in 0.23, any syntax
/// error inside the `decoder` object reaches its `expect("Helper")` (found by `fuzz/`;
/// upstream fixes of the same kind: huggingface/tokenizers#2154, #2156). Such a panic is
/// caught here and becomes this function's error, naming what the crate said.
pub fn parse(bytes: &[u8]) -> Result<Tokenizer, tokenizers::Error> {
    let parsed = std::panic::catch_unwind(|| match parse_bpe(bytes) {
        Some(t) => Ok(t),
        None => Tokenizer::from_bytes(bytes),
    });
    parsed.unwrap_or_else(|panic| {
        let said = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(
            format!("malformed tokenizer.json (the tokenizers crate panicked on it: {said})")
                .into(),
        )
    })
}

/// An entry of `added_tokens`, as the crate's parse reads it.
#[derive(Deserialize)]
struct AddedTokenWithId {
    id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// A JSON object's entries in the file's order, each value as its raw JSON text (a map would
/// keep only the last of a repeated key, silently).
struct Entries<'a>(Vec<(&'a str, &'a RawValue)>);

impl<'de> Deserialize<'de> for Entries<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<&'de str, &'de RawValue>()? {
                    out.push(entry);
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// The BPE tokenizer of `bytes`, or `None` where the model is not a BPE or anything else does
/// not parse (then the crate's own parse decides, and explains).
fn parse_bpe(bytes: &[u8]) -> Option<Tokenizer> {
    let text = std::str::from_utf8(bytes).ok()?;
    // Top-level keys borrowed (none of Hugging Face's needs an escape; one that does fails
    // here), values as their raw JSON text. A key given twice is left to the crate's parse,
    // which reads each value as it comes (a first value of the wrong type is its error even
    // where the last is right; found by `fuzz/`).
    let Entries(entries) = serde_json::from_str(text).ok()?;
    let top: BTreeMap<&str, &RawValue> = entries.iter().copied().collect();
    if top.len() != entries.len() {
        return None;
    }
    let model: BPE = serde_json::from_str(top.get("model")?.get()).ok()?;
    let added: Vec<AddedTokenWithId> = match top.get("added_tokens") {
        Some(raw) => serde_json::from_str(raw.get()).ok()?,
        None => Vec::new(),
    };
    // Everything else, with an empty BPE in place of the model and no added tokens: the
    // added tokens' ids depend on the model, so they are added once the real one is in.
    let mut rest = String::from("{");
    for (key, value) in top
        .iter()
        .filter(|(k, _)| !matches!(**k, "model" | "added_tokens"))
    {
        rest.push_str(&serde_json::to_string(key).ok()?);
        rest.push(':');
        rest.push_str(value.get());
        rest.push(',');
    }
    rest.push_str(r#""model":{"type":"BPE","vocab":{},"merges":[]},"added_tokens":[]}"#);
    let mut tokenizer: Tokenizer = rest.parse().ok()?;
    tokenizer.with_model(ModelWrapper::BPE(model));
    // An added token the model already has keeps the model's id (as in the crate's parse, which
    // logs each such token): one line for them all.
    let moved: Vec<(&str, u32, u32)> = added
        .iter()
        .filter_map(|t| {
            let id = tokenizer.token_to_id(&t.token.content)?;
            (id != t.id).then_some((t.token.content.as_str(), t.id, id))
        })
        .collect();
    if let Some((content, file_id, id)) = moved.first() {
        tracing::warn!(
            "{} added token(s) of tokenizer.json have the model's id, not the file's: \
             {content:?} is {id}, not {file_id}",
            moved.len()
        );
    }
    tokenizer
        .add_tokens(added.into_iter().map(|t| t.token))
        .ok()?;
    Some(tokenizer)
}

#[cfg(test)]
mod tests;
