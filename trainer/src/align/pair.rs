//! One text tokenized by both tokenizers, aligned, and truncated at a common chunk boundary.

use std::path::Path;
use tokenizers::Tokenizer;

use super::chunks::{align_known, textual_specials, Chunk};
use super::token_bytes::TokenBytes;
use super::{AlignError, Side};

/// A tokenizer together with its byte table.
pub struct AlignTokenizer {
    pub tokenizer: Tokenizer,
    pub bytes: TokenBytes,
}

impl AlignTokenizer {
    /// Wraps a loaded tokenizer (its own truncation and padding are switched off: alignment
    /// truncates both sides itself).
    pub fn new(mut tokenizer: Tokenizer) -> Result<AlignTokenizer, AlignError> {
        tokenizer
            .with_truncation(None)
            .map_err(|e| AlignError::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(None);
        let bytes = TokenBytes::from_tokenizer(&tokenizer)?;
        Ok(AlignTokenizer { tokenizer, bytes })
    }

    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<AlignTokenizer, AlignError> {
        let tok = xdistill_shared::hf::load_tokenizer(path)
            .map_err(|e| AlignError::Tokenizer(e.to_string()))?;
        AlignTokenizer::new(tok)
    }

    /// Token ids of `text` (with the post-processor's BOS/EOS when `add_special_tokens`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, AlignError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| AlignError::Tokenizer(e.to_string()))
    }
}

/// How to tokenize a text for both sides.
#[derive(Debug, Clone, Copy)]
pub struct PairOptions {
    /// Let each tokenizer add its BOS/EOS as its post-processor says.
    pub add_special_tokens: bool,
    /// Keep at most this many student tokens (cut at a chunk boundary).
    pub max_student_tokens: Option<usize>,
    /// Keep at most this many teacher tokens (cut at the same chunk boundary).
    pub max_teacher_tokens: Option<usize>,
}

impl Default for PairOptions {
    fn default() -> Self {
        PairOptions {
            add_special_tokens: true,
            max_student_tokens: None,
            max_teacher_tokens: None,
        }
    }
}

/// A text tokenized for both sides and aligned.
#[derive(Debug, Clone)]
pub struct TokenizedPair {
    /// The canonical text both token sequences spell (after truncation).
    pub text: String,
    pub student_ids: Vec<u32>,
    pub teacher_ids: Vec<u32>,
    /// In order; together they cover every token except masked specials.
    pub chunks: Vec<Chunk>,
    /// Whether tokens were cut to fit the limits.
    pub truncated: bool,
}

/// The text in the form both tokenizers' tokens will spell: both sides' Unicode normalization
/// applied, literal `▁` read as a space when either side is SentencePiece.
pub fn canonical_text<'t>(
    text: &'t str,
    student: &TokenBytes,
    teacher: &TokenBytes,
) -> Result<std::borrow::Cow<'t, str>, AlignError> {
    let once = student
        .canonicalize(&teacher.canonicalize(text))
        .into_owned();
    let twice = student
        .canonicalize(&teacher.canonicalize(&once))
        .into_owned();
    if once != twice {
        return Err(AlignError::IncompatibleNormalizers(format!(
            "{:?} vs {:?}",
            student.unicode_norm(),
            teacher.unicode_norm()
        )));
    }
    Ok(if once == text {
        std::borrow::Cow::Borrowed(text)
    } else {
        std::borrow::Cow::Owned(once)
    })
}

/// Tokenizes `text` for both sides, checks that both spell it exactly, aligns, and truncates
/// both at the last chunk boundary within both limits (never by token count on one side).
pub fn tokenize_pair(
    text: &str,
    student: &AlignTokenizer,
    teacher: &AlignTokenizer,
    opts: PairOptions,
) -> Result<TokenizedPair, AlignError> {
    let text = canonical_text(text, &student.bytes, &teacher.bytes)?;
    let student_ids = student.encode(&text, opts.add_special_tokens)?;
    let teacher_ids = teacher.encode(&text, opts.add_special_tokens)?;
    let chunks = align_text(&text, &student_ids, &teacher_ids, student, teacher)?;
    let mut pair = TokenizedPair {
        text: text.into_owned(),
        student_ids,
        teacher_ids,
        chunks,
        truncated: false,
    };
    pair.truncate(opts.max_student_tokens, opts.max_teacher_tokens);
    Ok(pair)
}

impl TokenizedPair {
    /// Cuts both sides at the last chunk boundary within both limits (never by token count on
    /// one side alone): tokens, chunks and text all end at the same text offset.
    pub fn truncate(&mut self, max_student: Option<usize>, max_teacher: Option<usize>) {
        let max_s = max_student.unwrap_or(usize::MAX);
        let max_t = max_teacher.unwrap_or(usize::MAX);
        if self.student_ids.len() <= max_s && self.teacher_ids.len() <= max_t {
            return;
        }
        let keep = truncate_point(&self.chunks, max_s, max_t);
        let (s_end, t_end, b_end) = match keep.checked_sub(1).map(|k| &self.chunks[k]) {
            Some(c) => (c.student.end, c.teacher.end, c.bytes.end),
            None => (0, 0, 0),
        };
        self.chunks.truncate(keep);
        self.student_ids.truncate(s_end);
        self.teacher_ids.truncate(t_end);
        // A chunk end is a token boundary on both sides, so it is a character boundary unless
        // both tokenizers split the same character there (then the text keeps a U+FFFD).
        let cut = self.text.as_bytes().get(..b_end).unwrap_or_default();
        self.text = String::from_utf8_lossy(cut).into_owned();
        self.truncated = true;
    }
}

/// Aligns two tokenizations of `text` exactly: checks that both spell it, tells typed special
/// strings from inserted BOS/EOS on each side, then walks ([`align_known`]).
pub fn align_text(
    text: &str,
    student_ids: &[u32],
    teacher_ids: &[u32],
    student: &AlignTokenizer,
    teacher: &AlignTokenizer,
) -> Result<Vec<Chunk>, AlignError> {
    let fs = textual_specials(student_ids, &student.bytes, text.as_bytes(), Side::Student)?;
    let ft = textual_specials(teacher_ids, &teacher.bytes, text.as_bytes(), Side::Teacher)?;
    align_known(
        student_ids,
        teacher_ids,
        &student.bytes,
        &teacher.bytes,
        &fs,
        &ft,
    )
}

/// Number of leading chunks that fit in `max_s` student and `max_t` teacher tokens.
pub fn truncate_point(chunks: &[Chunk], max_s: usize, max_t: usize) -> usize {
    chunks.partition_point(|c| c.student.end <= max_s && c.teacher.end <= max_t)
}
