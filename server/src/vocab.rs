//! The teacher's tokenizer as the compatible routes need it: text prompts to ids, ids to text,
//! and every id's text decoded alone (vLLM's `decoded_token`), built once at load so that
//! answers with thousands of entries copy strings instead of running the decoder.

use rayon::prelude::*;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// The tokenizer plus a table of single-token texts.
pub struct Vocab {
    pub tokenizer: Arc<Tokenizer>,
    /// `texts[id]`: `decode([id])` with special tokens kept; invalid UTF-8 pieces become U+FFFD.
    texts: Vec<Box<str>>,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab")
            .field("ids", &self.texts.len())
            .finish()
    }
}

impl Vocab {
    /// Decodes ids `0..n` (n = the valid vocabulary) once, in parallel.
    pub fn build(tokenizer: Tokenizer, n: usize) -> Vocab {
        let texts = (0..n as u32)
            .into_par_iter()
            .map(|id| {
                tokenizer
                    .decode(&[id], false)
                    .unwrap_or_default()
                    .into_boxed_str()
            })
            .collect();
        Vocab {
            tokenizer: Arc::new(tokenizer),
            texts,
        }
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
