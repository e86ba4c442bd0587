//! The teacher's tokenizer as the compatible routes need it: text prompts to ids, ids to text,
//! and every id's text decoded alone (vLLM's `decoded_token`), built once at load so that
//! answers with thousands of entries copy strings instead of running the decoder.

use rayon::prelude::*;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// The tokenizer plus a table of single-token texts.
pub struct Vocab {
    pub tokenizer: Arc<Tokenizer>,
    /// `texts[id]`: `decode([id])` with special tokens kept; invalid UTF-8 pieces become U+FFFD.
    texts: Vec<Box<str>>,
    /// Most bytes of text one token can stand for: the longest single-token text plus one (a
    /// leading space that decoding a token alone drops). Bounds text prompts before they are
    /// tokenized ([`crate::compat::admit`]).
    bytes_per_token: usize,
    /// Mean length of a token's text as a JSON string (quotes and escapes included), rounded
    /// up: the per-entry size the compatible routes' answer estimates use.
    mean_text_json: usize,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("ids", &self.texts.len())
            .finish()
    }
}

impl Vocab {
    /// Decodes ids `0..n` (n = the valid vocabulary) once, in parallel. Truncation and padding
    /// that a `tokenizer.json` may carry are switched off: a prompt is scored whole, as given.
    ///
    /// The `tokenizers` crate's decoders can panic on a malformed file's settings (0.23: a
    /// `Strip` decoder whose `start`/`stop` overrun a token, upstream huggingface/tokenizers
    /// #2154); every id's text is made here, at load, so such a file is this error, naming the
    /// id, and a served tokenizer has decoded every one of its tokens once.
    pub fn build(mut tokenizer: Tokenizer, n: usize) -> Result<Vocab, String> {
        // Disabling truncation cannot fail (only enabling it validates a stride).
        let _ = tokenizer.with_truncation(None);
        tokenizer.with_padding(None);
        let texts: Result<Vec<Box<str>>, String> = (0..n as u32)
            .into_par_iter()
            .map(|id| {
                let decoded =
                    std::panic::catch_unwind(AssertUnwindSafe(|| tokenizer.decode(&[id], false)));
                match decoded {
                    Ok(text) => Ok(text.unwrap_or_default().into_boxed_str()),
                    Err(_) => Err(format!(
                        "malformed tokenizer.json: its decoder panicked decoding id {id} \
                         (the tokenizers crate's message is above)"
                    )),
                }
            })
            .collect();
        let texts = texts?;
        let longest = texts.iter().map(|t| t.len()).max().unwrap_or(0);
        let json_total: usize = texts
            .par_iter()
            .map(|t| serde_json::to_string(&**t).map_or(2, |j| j.len()))
            .sum();
        Ok(Vocab {
            tokenizer: Arc::new(tokenizer),
            bytes_per_token: longest + 1,
            mean_text_json: json_total.div_ceil(texts.len().max(1)).max(2),
            texts,
        })
    }

    /// Mean length of a token's text as a JSON string (see the field).
    pub fn mean_text_json(&self) -> usize {
        self.mean_text_json
    }

    /// Most bytes of text one token can stand for (see the field).
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }

    /// The text of one id decoded alone ("" for an id outside the table).
    pub fn text(&self, id: u32) -> &str {
        self.texts.get(id as usize).map_or("", |s| s)
    }

    /// Tokenizes `text`; `add_special` adds what the tokenizer's post-processor adds (a BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizing: {e}"))
    }

    /// Decodes ids to text, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| format!("detokenizing: {e}"))
    }

    /// The tokenizer's own token strings (`Ġthe`), vLLM's `token_strs`.
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::TruncationParams;

    /// A `tokenizer.json` that carries truncation does not cut prompts; single-token texts and
    /// round trips agree with the tokenizer itself.
    #[test]
    fn prompts_are_never_truncated() {
        let path = xdistill_testkit::tokenizer_json("llama2");
        let mut tok = Tokenizer::from_file(&path).unwrap();
        tok.with_truncation(Some(TruncationParams {
            max_length: 4,
            ..Default::default()
        }))
        .unwrap();
        let text = "one two three four five six seven eight";
        assert_eq!(tok.encode(text, false).unwrap().get_ids().len(), 4);
        let n = tok.get_vocab_size(true);
        let v = Vocab::build(tok, n).unwrap();
        let ids = v.encode(text, false).unwrap();
        assert!(ids.len() > 4, "{ids:?}");
        assert_eq!(v.decode(&ids).unwrap(), text);
        let one = ids[1];
        assert_eq!(v.text(one), v.decode(&[one]).unwrap());
        assert_eq!(v.text(u32::MAX), "");
    }

    /// A decoder that panics on one of the vocabulary's tokens (`Strip` cutting more than the
    /// token holds: the crate slices `chars[2..0]` for "HH") is a load error naming the id.
    #[test]
    fn a_decoder_that_panics_is_a_load_error() {
        let file = |stop: usize| {
            format!(
                r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": null, "post_processor": null,
                "decoder": {{"type": "Strip", "content": "H", "start": 2, "stop": {stop}}},
                "model": {{"type": "WordLevel", "unk_token": "a", "vocab": {{"a": 0, "HH": 1}}}}}}"#
            )
        };
        let parse = |stop| xdistill_shared::tokenizer_json::parse(file(stop).as_bytes()).unwrap();
        let v = Vocab::build(parse(0), 2).expect("stop 0 cuts nothing past the token");
        assert_eq!((v.text(0), v.text(1)), ("a", ""));
        let err = Vocab::build(parse(2), 2).expect_err("the decoder panics on \"HH\"");
        assert!(
            err.contains("malformed tokenizer.json") && err.contains("id 1"),
            "{err}"
        );
    }
}
