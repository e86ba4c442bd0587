//! Cross-tokenizer alignment: two tokenizations of the same text split into chunks, the smallest
//! pairs of token runs that cover exactly the same bytes (see `docs/alignment.md`).
//!
//! - [`token_bytes`]: every vocabulary id → its bytes (built once per tokenizer).
//! - [`chunks`]: the linear walk over cumulative byte lengths ([`align`]).
//! - [`pair`]: tokenize one text for both sides, truncating both at a common chunk boundary.
//! - [`projection`]: the sparse vocabulary maps between two tokenizers ([`ProjectionMaps`]),
//!   built from the token bytes, saved and cached; the cross-tokenizer losses read them as a
//!   [`crate::loss::Projection`].
//! - [`cli`]: `trainer align` and `trainer build-projection`.

pub mod chunks;
pub mod cli;
pub mod pair;
pub mod projection;
pub mod token_bytes;

pub use chunks::{align, align_known, textual_specials, Chunk, ChunkKind};
pub use pair::{
    align_text, canonical_text, tokenize_pair, AlignTokenizer, PairOptions, TokenizedPair,
};
pub use projection::{Csr, ProjectionError, ProjectionMaps};
pub use token_bytes::{DummyPrefix, Piece, TokenBytes, TokenizerKind, UnicodeNorm};

/// Which tokenization an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Student,
    Teacher,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Student => "student",
            Side::Teacher => "teacher",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AlignError {
    #[error("unsupported tokenizer: {0}")]
    UnsupportedTokenizer(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{side} token {index}: id {id} is not in the vocabulary")]
    UnknownId { side: Side, index: usize, id: u32 },
    #[error("token {index}: id {id} is not in the vocabulary")]
    UnknownToken { index: usize, id: u32 },
    #[error("the tokenizations cover different text lengths: the {shorter} side ends at byte {at} while the other goes on")]
    LengthMismatch { shorter: Side, at: usize },
    #[error("the tokenizations spell different bytes in the chunk at byte {at} (student tokens {student_start}..{student_end}, teacher tokens {teacher_start}..{teacher_end})")]
    ByteMismatch {
        at: usize,
        student_start: usize,
        student_end: usize,
        teacher_start: usize,
        teacher_end: usize,
    },
    #[error("the {side} tokens do not spell the text: they differ from byte {at} on (the tokenizer changes the text in a way alignment cannot undo)")]
    TextMismatch { side: Side, at: usize },
    #[error("the two tokenizers normalize text differently ({0}); normalize the text upstream")]
    IncompatibleNormalizers(String),
    #[error("batch: {0}")]
    Batch(String),
}
