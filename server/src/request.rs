//! The validated request: what every route's body becomes ([`ValidTopkRequest`], checked by
//! [`crate::validation`] against [`RequestLimits`]) and what it asks of every row
//! ([`ScoreParams`]). A leaf: the routes, the validation, the engine, the batcher and the
//! scoring all import it, and it imports none of them.

use std::sync::Arc;
use xdistill_shared::protocol::ValuesKind;

/// The limits a request is checked against.
#[derive(Debug, Clone)]
pub struct RequestLimits {
    /// Valid ids are `< vocab_size` (the tokenizer's vocabulary, not the padded LM head).
    pub vocab_size: usize,
    pub max_k: usize,
    pub max_seq_len: usize,
    pub max_queue_tokens: usize,
    /// Most sequences in one request.
    pub max_sequences: usize,
    /// Most bytes of scores one answer may hold (see [`ValidTopkRequest::answer_bytes`]).
    pub max_answer_bytes: usize,
}

/// Candidate ids of one sequence, `[rows, m]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates {
    pub m: usize,
    pub ids: Arc<[u32]>,
}

/// One sequence to score: rows `start..S-1` (row `p` is the distribution predicting token
/// `p + 1`), plus the row at `S - 1` when a next token is asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSequence {
    pub ids: Arc<[u32]>,
    pub start: usize,
    /// Also score the position after the last token (the compatible routes' `max_tokens: 1`).
    pub next_row: bool,
    pub candidates: Option<Candidates>,
}

impl ValidSequence {
    /// Number of result rows, `S - 1 - start` (+ 1 with a next row).
    pub fn rows(&self) -> usize {
        self.ids.len() - 1 - self.start + self.next_row as usize
    }
    /// Tokens the model must read: `S - 1` (the last token predicts nothing we return), or all
    /// `S` with a next row; 0 when there are no rows (no forward at all).
    pub fn input_tokens(&self) -> usize {
        if self.rows() == 0 {
            0
        } else {
            self.ids.len() - 1 + self.next_row as usize
        }
    }
    /// What the sequence costs against the queue budget: its input tokens, and at least 1, so
    /// that sequences without rows (no forward, but still an answer entry) are not free.
    pub fn cost(&self) -> usize {
        self.input_tokens().max(1)
    }
}

#[derive(Debug, Clone)]
pub struct ValidTopkRequest {
    pub sequences: Vec<ValidSequence>,
    pub params: ScoreParams,
}

impl ValidTopkRequest {
    pub fn input_tokens(&self) -> usize {
        self.sequences.iter().map(|s| s.input_tokens()).sum()
    }
    /// The request's cost against the queue budget (every sequence counts, see
    /// [`ValidSequence::cost`]).
    pub fn cost(&self) -> usize {
        self.sequences.iter().map(ValidSequence::cost).sum()
    }
    /// Bytes of scores the answer will hold: per row k ids and values, the target log-prob, the
    /// logsumexp, the candidates' log-probs and a rank (4 bytes each), plus 64 per sequence.
    /// Encoded answers are this size (MessagePack) or larger (JSON).
    pub fn answer_bytes(&self) -> usize {
        let p = &self.params;
        self.sequences
            .iter()
            .map(|s| {
                let m = s.candidates.as_ref().map_or(0, |c| c.m);
                64 + s.rows() * 4 * (2 * p.k + 2 + m + p.ranks as usize)
            })
            .sum()
    }
}

/// Bytes of JSON one 4-byte score takes at most in the native JSON answer: a shortest f32
/// (`-1.17549435e-38`, 15 characters) and its separator.
pub const JSON_BYTES_PER_SCORE: usize = 16;

impl ValidTopkRequest {
    /// The native answer's size as sent: MessagePack carries the scores as blobs
    /// ([`ValidTopkRequest::answer_bytes`]); JSON writes each as a number of up to
    /// [`JSON_BYTES_PER_SCORE`] bytes, plus 128 bytes of keys per sequence.
    pub fn native_answer_bytes(&self, json: bool) -> usize {
        let raw = self.answer_bytes();
        if !json {
            return raw;
        }
        let n = self.sequences.len();
        let scores = (raw - 64 * n) / 4;
        scores.saturating_mul(JSON_BYTES_PER_SCORE) + 128 * n
    }
}

/// What a request asks for, shared by all its sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    /// Top entries per row (0: only target log-probs and logsumexps).
    pub k: usize,
    pub temperature: f32,
    pub values: ValuesKind,
    /// Also report each target's rank over the vocabulary (vLLM's `rank`).
    pub ranks: bool,
    /// Score one row past the last token and choose the next token from it (the compatible
    /// routes' `max_tokens: 1`).
    pub next: Option<NextToken>,
    /// Return each row's final-norm hidden state instead of scores (`/hidden_states`; then
    /// `k` is 0 and nothing else is computed).
    pub hidden: bool,
}

impl ScoreParams {
    /// `/hidden_states`' parameters: hidden states only.
    pub fn hidden_states() -> ScoreParams {
        ScoreParams {
            hidden: true,
            ..ScoreParams::native(0, 1.0, ValuesKind::Logprobs)
        }
    }

    /// What the row scorers (host and device) compute for each row of a vocabulary whose
    /// first `valid` columns are real tokens.
    pub fn rows(&self, valid: usize) -> xdistill_shared::topk::RowQuery {
        xdistill_shared::topk::RowQuery {
            k: self.k,
            temperature: self.temperature,
            valid,
            values: self.values,
            ranks: self.ranks,
        }
    }

    /// The native route's parameters: no ranks, no next token.
    pub fn native(k: usize, temperature: f32, values: ValuesKind) -> ScoreParams {
        ScoreParams {
            k,
            temperature,
            values,
            ranks: false,
            next: None,
            hidden: false,
        }
    }
}

/// How the token after a sequence is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NextToken {
    /// The most likely token (the lowest id among equal maxima).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, reproducible from the seed.
    Sample { seed: u64 },
}
