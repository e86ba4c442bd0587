//! Turning a batch of records into token ids for both sides and the teacher request.
//!
//! Runs on the prefetch thread, so tokenization and alignment overlap the training step.

use super::teachers::{Source, Teachers};
use crate::align::{canonical_text, tokenize_pair, AlignTokenizer, PairOptions, TokenizedPair};
use crate::collate::{encode, Encoded};
use crate::data::{Batch, Record};
use tokenizers::Tokenizer;

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
    /// The student's tokenizer.
    pub fn student_tokenizer(&self) -> &Tokenizer {
        match self {
            Tokenization::Same(t) => t,
            Tokenization::Cross { student, .. } => &student.tokenizer,
        }
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

/// The records of a batch that one source (a teacher, or the ensemble) scores, tokenized for it.
#[derive(Debug)]
pub struct Group {
    pub source: Source,
    /// What the loss trains on (a chunk-level ensemble: its virtual teacher's records).
    pub items: Vec<Item>,
    /// A chunk-level ensemble: each teacher's own tokenization of the same records
    /// (`[teacher][record]`), which the teachers score; empty otherwise.
    pub parts: Vec<Vec<Item>>,
}

/// A batch of records, tokenized and split by teacher.
#[derive(Debug)]
pub struct Prepared {
    pub batch: Batch,
    /// One group per source with records, in source order.
    pub groups: Vec<Group>,
    /// Records of this batch that could not be tokenized (counted, never fatal).
    pub skipped: u64,
}

impl Prepared {
    /// Every group's items, in group order.
    pub fn items(&self) -> impl Iterator<Item = &Item> {
        self.groups.iter().flat_map(|g| &g.items)
    }
}

/// Length limits, in tokens, per side.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_student_tokens: usize,
    pub max_teacher_tokens: usize,
    /// Over-long records are truncated (both sides at one chunk boundary) instead of skipped
    /// (`data.truncate`).
    pub truncate: bool,
}

/// Margin for [`too_long`]'s shortcut: a text of `b` bytes has at most about `b` tokens, plus
/// the special tokens a tokenizer adds (BOS/EOS, a prefix-space piece).
const SPECIAL_TOKEN_MARGIN: usize = 16;

/// Whether `r` exceeds a token limit on either side (without truncation). Texts short enough in
/// bytes are not tokenized; a record that cannot be tokenized is not "too long" (it is skipped
/// later, when prepared, with its reason).
pub fn too_long(r: &Record, tok: &Tokenization, lim: Limits) -> bool {
    let max_s = lim.max_student_tokens;
    let max_t = lim.max_teacher_tokens;
    if r.len_bytes() + SPECIAL_TOKEN_MARGIN <= max_s.min(max_t) {
        return false;
    }
    match tok {
        Tokenization::Same(t) => {
            encode(t, &r.text(), 0, usize::MAX).is_ok_and(|e| e.ids.len() > max_s.min(max_t))
        }
        Tokenization::Cross { student, teacher } => {
            let opts = PairOptions {
                add_special_tokens: true,
                max_student_tokens: None,
                max_teacher_tokens: None,
            };
            tokenize_pair(&r.text(), student, teacher, opts)
                .is_ok_and(|p| p.student_ids.len() > max_s || p.teacher_ids.len() > max_t)
        }
    }
}

/// Tokenizes one record; `None` (with a log line) when it cannot be used.
pub fn prepare_record(r: &Record, tok: &Tokenization, lim: Limits) -> Option<Item> {
    let text = r.text();
    let loss_start = r.loss_start_byte();
    let item = match tok {
        Tokenization::Same(t) => {
            let max = lim.max_student_tokens.min(lim.max_teacher_tokens);
            let cut = if lim.truncate { max } else { usize::MAX };
            encode(t, &text, loss_start, cut)
                .map_err(|e| e.to_string())
                .and_then(|e| {
                    if e.ids.len() > max {
                        Err(format!("{} tokens exceed the limit of {max}", e.ids.len()))
                    } else {
                        Ok(Item::Same(e))
                    }
                })
        }
        Tokenization::Cross { student, teacher } => {
            let (max_s, max_t) = (lim.max_student_tokens, lim.max_teacher_tokens);
            let opts = PairOptions {
                add_special_tokens: true,
                max_student_tokens: lim.truncate.then_some(max_s),
                max_teacher_tokens: lim.truncate.then_some(max_t),
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
                        if pair.student_ids.len() > max_s || pair.teacher_ids.len() > max_t {
                            Err(format!(
                                "{} student / {} teacher tokens exceed the limits of {max_s} / {max_t}",
                                pair.student_ids.len(),
                                pair.teacher_ids.len()
                            ))
                        } else if pair.student_ids.len() < 2 || pair.teacher_ids.len() < 2 {
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

/// Splits a batch by teacher and tokenizes each record for its teacher. A record without a
/// teacher (only possible for records not checked at start) is skipped with its reason.
pub fn prepare(batch: Batch, teachers: &Teachers) -> Prepared {
    let mut skipped = 0;
    let mut by: std::collections::BTreeMap<Source, Vec<&Record>> = Default::default();
    for r in &batch.records {
        match teachers.source_of(r) {
            Ok(s) => by.entry(s).or_default().push(r),
            Err(e) => {
                tracing::warn!("record at line {} skipped: it {e}", r.line);
                skipped += 1;
            }
        }
    }
    let mut groups = vec![];
    for (source, records) in by {
        let (g, used) = teachers.prepare_group(source, &records, teachers.limits(source));
        skipped += (records.len() - used.len()) as u64;
        if !g.items.is_empty() {
            groups.push(g);
        }
    }
    Prepared {
        batch,
        groups,
        skipped,
    }
}
