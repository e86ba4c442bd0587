//! One training example ([`Record`]) and the counts of records skipped while reading.

use serde::{Deserialize, Serialize};

/// What a record holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Content {
    /// One text; loss on every token.
    Text { text: String },
    /// A prompt (separator already appended) and its completion.
    Pair { prompt: String, completion: String },
}

/// One training example.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// 1-based line of the source file where the record starts (for messages).
    pub line: usize,
    pub content: Content,
    /// With [`Content::Pair`]: the loss covers only the completion's tokens.
    pub completion_only_loss: bool,
    /// The teacher this record names (`data.teacher_field`), when it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher: Option<String>,
}

impl Record {
    /// The full text to tokenize (prompt followed by completion).
    pub fn text(&self) -> String {
        match &self.content {
            Content::Text { text } => text.clone(),
            Content::Pair { prompt, completion } => format!("{prompt}{completion}"),
        }
    }
    /// Byte offset in [`Record::text`] where the loss starts: tokens that end at or before it
    /// are not trained on.
    pub fn loss_start_byte(&self) -> usize {
        match &self.content {
            Content::Pair { prompt, .. } if self.completion_only_loss => prompt.len(),
            _ => 0,
        }
    }
    pub fn len_bytes(&self) -> usize {
        match &self.content {
            Content::Text { text } => text.len(),
            Content::Pair { prompt, completion } => prompt.len() + completion.len(),
        }
    }
}

/// Why a record was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    Empty,
    InvalidUtf8,
    BadJson,
    MissingField,
    TooLongBytes,
    TooLongTokens,
}

/// Counts of skipped records, by reason; reported by the training loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SkipCounts {
    pub empty: u64,
    pub invalid_utf8: u64,
    pub bad_json: u64,
    /// The field is absent or not a string.
    pub missing_field: u64,
    pub too_long_bytes: u64,
    pub too_long_tokens: u64,
}

impl SkipCounts {
    pub fn total(&self) -> u64 {
        self.empty
            + self.invalid_utf8
            + self.bad_json
            + self.missing_field
            + self.too_long_bytes
            + self.too_long_tokens
    }
    pub fn add(&mut self, r: SkipReason) {
        match r {
            SkipReason::Empty => self.empty += 1,
            SkipReason::InvalidUtf8 => self.invalid_utf8 += 1,
            SkipReason::BadJson => self.bad_json += 1,
            SkipReason::MissingField => self.missing_field += 1,
            SkipReason::TooLongBytes => self.too_long_bytes += 1,
            SkipReason::TooLongTokens => self.too_long_tokens += 1,
        }
    }
}

impl std::fmt::Display for SkipCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} skipped: {} empty, {} invalid UTF-8, {} bad JSON, {} missing field, \
             {} too long (bytes), {} too long (tokens)",
            self.total(),
            self.empty,
            self.invalid_utf8,
            self.bad_json,
            self.missing_field,
            self.too_long_bytes,
            self.too_long_tokens
        )
    }
}
