//! Collation: texts → token ids for one side, padded batches, and teacher rows laid out against
//! student positions.
//!
//! Convention everywhere: position `t` of a `[B, T]` batch holds token `ids[t]`, and its logits
//! predict `ids[t + 1]`; `mask[t] = 1` when `ids[t + 1]` is a trained token. The teacher answers
//! the same convention (row `r` of a `start = 0` request predicts token `r + 1`).

use candle_core::{Device, Tensor};
use tokenizers::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum CollateError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("text tokenizes to {0} token(s); at least 2 are needed for one prediction")]
    TooShort(usize),
    /// An id the model has no embedding row for: a tokenizer that does not belong with the
    /// model's `config.json` (on a GPU the lookup would be a device-side assert, not an error).
    #[error(
        "row {row}: token id {id} is outside the model's vocabulary of {vocab} ids; does the \
         tokenizer belong with the model's config.json (its vocab_size)?"
    )]
    OutOfVocab { row: usize, id: u32, vocab: usize },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// One text tokenized for one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    /// First token index that is a training target (tokens before it are context only).
    pub loss_from: usize,
}

/// Tokenizes `text` (with the tokenizer's special tokens, e.g. BOS) in one pass — so prompt and
/// completion join without spurious spaces — and finds the first token that ends after
/// `loss_start_byte` (a token straddling the prompt/completion boundary is trained on).
/// Truncates to `max_len` tokens.
pub fn encode(
    tok: &Tokenizer,
    text: &str,
    loss_start_byte: usize,
    max_len: usize,
) -> Result<Encoded, CollateError> {
    let enc = tok
        .encode(text, true)
        .map_err(|e| CollateError::Tokenizer(e.to_string()))?;
    let mut ids = enc.get_ids().to_vec();
    let special = enc.get_special_tokens_mask();
    let offsets = enc.get_offsets();
    let mut loss_from = ids.len();
    for (i, &(_, end)) in offsets.iter().enumerate() {
        if special.get(i).copied().unwrap_or(0) == 0 && end > loss_start_byte {
            loss_from = i;
            break;
        }
    }
    // Special tokens after the text (e.g. an EOS post-processor) are targets too.
    if loss_from == ids.len() {
        loss_from = ids.len().saturating_sub(1);
    }
    ids.truncate(max_len);
    if ids.len() < 2 {
        return Err(CollateError::TooShort(ids.len()));
    }
    Ok(Encoded {
        loss_from: loss_from.max(1).min(ids.len()),
        ids,
    })
}

/// A right-padded batch. Shapes: `ids`, `targets` `[B, T]` u32; `mask` `[B, T]` f32.
pub struct TokenBatch {
    pub ids: Tensor,
    pub targets: Tensor,
    pub mask: Tensor,
    /// `targets` and `mask` row-major on the host, as they were built (read them here, not
    /// back from the device: a read waits for the GPU's queue).
    pub host_targets: Vec<u32>,
    pub host_mask: Vec<f32>,
    /// Real length of each row.
    pub lens: Vec<usize>,
    /// Number of trained positions (sum of `mask`).
    pub n_targets: usize,
}

/// Pads `examples` to the longest (pad id `pad`; pads are never attended to by real tokens under
/// the causal mask and never trained on). Every id must be below `vocab`, the model's
/// vocabulary: every training batch passes here before its ids reach the embedding.
pub fn pad_batch(
    examples: &[Encoded],
    pad: u32,
    vocab: usize,
    device: &Device,
) -> Result<TokenBatch, CollateError> {
    let b = examples.len();
    let t = examples.iter().map(|e| e.ids.len()).max().unwrap_or(1);
    let mut ids = vec![pad; b * t];
    let mut targets = vec![pad; b * t];
    let mut mask = vec![0f32; b * t];
    let mut n_targets = 0;
    for (r, e) in examples.iter().enumerate() {
        if let Some(&id) = e.ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(CollateError::OutOfVocab { row: r, id, vocab });
        }
        ids[r * t..r * t + e.ids.len()].copy_from_slice(&e.ids);
        for p in 0..e.ids.len().saturating_sub(1) {
            targets[r * t + p] = e.ids[p + 1];
            if p + 1 >= e.loss_from {
                mask[r * t + p] = 1.0;
                n_targets += 1;
            }
        }
    }
    Ok(TokenBatch {
        ids: Tensor::from_vec(ids, (b, t), device)?,
        targets: Tensor::from_slice(&targets, (b, t), device)?,
        mask: Tensor::from_slice(&mask, (b, t), device)?,
        host_targets: targets,
        host_mask: mask,
        lens: examples.iter().map(|e| e.ids.len()).collect(),
        n_targets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(name: &str) -> Tokenizer {
        Tokenizer::from_file(xdistill_testkit::tokenizer_json(name)).unwrap()
    }

    #[test]
    fn completion_boundary_found_in_one_joint_encoding() {
        for name in ["llama2", "qwen3", "llama3"] {
            let t = tok(name);
            let prompt = "Q: 47+38=?\nA:";
            let text = format!("{prompt} 85");
            let e = encode(&t, &text, prompt.len(), 100).unwrap();
            // Tokens from loss_from on decode to exactly the completion (plus nothing of the prompt).
            let tail = t.decode(&e.ids[e.loss_from..], true).unwrap();
            assert_eq!(tail.trim(), "85", "{name}: {tail:?}");
            let head = t.decode(&e.ids[..e.loss_from], true).unwrap();
            assert!(head.trim_end().ends_with("A:"), "{name}: {head:?}");
        }
    }

    #[test]
    fn mask_marks_exactly_the_completion_targets() {
        let examples = vec![
            Encoded {
                ids: vec![5, 6, 7, 8],
                loss_from: 2,
            },
            Encoded {
                ids: vec![9, 10],
                loss_from: 1,
            },
        ];
        let b = pad_batch(&examples, 0, 11, &Device::Cpu).unwrap();
        let mask: Vec<Vec<f32>> = b.mask.to_vec2().unwrap();
        assert_eq!(
            mask,
            vec![vec![0.0, 1.0, 1.0, 0.0], vec![1.0, 0.0, 0.0, 0.0]]
        );
        let tg: Vec<Vec<u32>> = b.targets.to_vec2().unwrap();
        assert_eq!(tg[0][..3], [6, 7, 8]);
        assert_eq!(b.n_targets, 3);
        // An id past the model's vocabulary is an error naming it, before any tensor is made
        // (an embedding lookup on a GPU would be a device-side assert).
        match pad_batch(&examples, 0, 10, &Device::Cpu) {
            Err(
                e @ CollateError::OutOfVocab {
                    row: 1,
                    id: 10,
                    vocab: 10,
                },
            ) => {
                assert!(e.to_string().contains("config.json"), "{e}")
            }
            other => panic!("{:?}", other.map(|b| b.lens)),
        }
    }

    #[test]
    fn too_short_is_an_error() {
        let t = tok("qwen3");
        assert!(matches!(
            encode(&t, "", 0, 10),
            Err(CollateError::TooShort(_))
        ));
    }
}
