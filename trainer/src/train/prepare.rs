//! Turning a batch of records into token ids for both sides and the teacher request.
//!
//! Runs on the prefetch thread, so tokenization and alignment overlap the training step.

use crate::align::{canonical_text, tokenize_pair, AlignTokenizer, PairOptions, TokenizedPair};
use crate::collate::{encode, Encoded};
use crate::data::{Batch, Record};
use tokenizers::Tokenizer;
use xdistill_shared::protocol::{TopkRequest, ValuesKind};

/// How records are tokenized: one tokenizer for both sides, or two aligned ones.
#[allow(clippy::large_enum_variant)] // one value per run
pub enum Tokenization {
    Same(Tokenizer),
    Cross {
        student: AlignTokenizer,
        teacher: AlignTokenizer,
    },
}

impl Tokenization {
    pub fn is_cross(&self) -> bool {
        matches!(self, Tokenization::Cross { .. })
    }
}

/// One record ready for the step.
#[derive(Debug, Clone)]
pub enum Item {
    /// Same tokenizer: the teacher scores exactly these ids.
    Same(Encoded),
    /// Different tokenizers: both tokenizations of the same (canonical) text and their chunks;
    /// `loss_start` is the byte of that text where training starts (0: everything).
    Cross {
        pair: TokenizedPair,
        loss_start: usize,
    },
}

impl Item {
    /// The ids sent to the teacher.
    pub fn teacher_ids(&self) -> &[u32] {
        match self {
            Item::Same(e) => &e.ids,
            Item::Cross { pair, .. } => &pair.teacher_ids,
        }
    }
}

/// A batch of records, tokenized, with its teacher request.
#[derive(Debug)]
pub struct Prepared {
    pub batch: Batch,
    pub items: Vec<Item>,
    pub request: TopkRequest,
    /// Records of this batch that could not be tokenized (counted, never fatal).
    pub skipped: u64,
}

/// Length limits, in tokens, per side.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_student_tokens: usize,
    pub max_teacher_tokens: usize,
}

/// Tokenizes one record; `None` (with a log line) when it cannot be used.
pub fn prepare_record(r: &Record, tok: &Tokenization, lim: Limits) -> Option<Item> {
    let text = r.text();
    let loss_start = r.loss_start_byte();
    let item = match tok {
        Tokenization::Same(t) => {
            let max = lim.max_student_tokens.min(lim.max_teacher_tokens);
            encode(t, &text, loss_start, max)
                .map(Item::Same)
                .map_err(|e| e.to_string())
        }
        Tokenization::Cross { student, teacher } => {
            let opts = PairOptions {
                add_special_tokens: true,
                max_student_tokens: Some(lim.max_student_tokens),
                max_teacher_tokens: Some(lim.max_teacher_tokens),
            };
            // Canonicalisation (e.g. Unicode normalisation) may move bytes: locate the loss start
            // in the canonical text through the canonical prompt.
            let canon_start = if loss_start == 0 {
                Ok(0)
            } else {
                canonical_text(
                    &text[..loss_start.min(text.len())],
                    &student.bytes,
                    &teacher.bytes,
                )
                .map(|p| p.len())
                .map_err(|e| e.to_string())
            };
            canon_start.and_then(|ls| {
                tokenize_pair(&text, student, teacher, opts)
                    .map_err(|e| e.to_string())
                    .and_then(|pair| {
                        if pair.student_ids.len() < 2 || pair.teacher_ids.len() < 2 {
                            Err("fewer than 2 tokens on a side".to_string())
                        } else {
                            Ok(Item::Cross {
                                pair,
                                loss_start: ls,
                            })
                        }
                    })
            })
        }
    };
    match item {
        Ok(i) => Some(i),
        Err(e) => {
            tracing::warn!("record at line {} skipped: {e}", r.line);
            None
        }
    }
}

/// Tokenizes a batch and builds its teacher request (`start = 0`: every position).
pub fn prepare(
    batch: Batch,
    tok: &Tokenization,
    lim: Limits,
    k: usize,
    temperature: f32,
) -> Prepared {
    let mut items = Vec::with_capacity(batch.records.len());
    let mut skipped = 0;
    for r in &batch.records {
        match prepare_record(r, tok, lim) {
            Some(i) => items.push(i),
            None => skipped += 1,
        }
    }
    let request = TopkRequest {
        sequences: items.iter().map(|i| i.teacher_ids().to_vec()).collect(),
        k,
        temperature,
        start: 0,
        starts: None,
        values: ValuesKind::Logprobs,
        ids: None,
    };
    Prepared {
        batch,
        items,
        request,
        skipped,
    }
}
