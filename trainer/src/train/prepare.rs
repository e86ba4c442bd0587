//! Turning a batch of records into token ids for both sides and the teacher request.
//!
//! Runs on the prefetch thread, so tokenization and alignment overlap the training step.

use super::pairing::{Item, Limits, Tokenization};
use super::teachers::ensemble::virtual_item;
use super::teachers::{Group, Source, Teachers};
use crate::data::{Batch, Record};

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

/// Tokenizes one record as its pairing does; `None` (with a log line) when it cannot be used.
pub fn prepare_record(r: &Record, tok: &Tokenization, lim: Limits) -> Option<Item> {
    match tok.item(r, lim) {
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
        let (g, used) = prepare_group(teachers, source, &records, teachers.limits(source));
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

/// Tokenizes `records` for `source` (the chunk-level ensemble: for every teacher, and the
/// virtual teacher's record from them); returns the group and the indices of the records it
/// holds (the others could not be tokenized, or their tokenizations disagree on the
/// student's tokens; each is logged).
pub fn prepare_group(
    teachers: &Teachers,
    source: Source,
    records: &[&Record],
    lim: Limits,
) -> (Group, Vec<usize>) {
    let mut g = Group {
        source,
        items: vec![],
        parts: vec![],
    };
    let mut used = vec![];
    if !teachers.is_chunk_mixture(source) {
        let tok = &teachers.of(source).tokenization;
        for (i, r) in records.iter().enumerate() {
            if let Some(item) = prepare_record(r, tok, lim) {
                g.items.push(item);
                used.push(i);
            }
        }
        return (g, used);
    }
    g.parts = vec![vec![]; teachers.list.len()];
    for (i, r) in records.iter().enumerate() {
        let each: Option<Vec<Item>> = teachers
            .list
            .iter()
            .map(|t| {
                prepare_record(
                    r,
                    &t.tokenization,
                    Limits {
                        max_teacher_tokens: t.limits.max_teacher_tokens,
                        ..lim
                    },
                )
            })
            .collect();
        let Some(each) = each else { continue };
        match virtual_item(&each) {
            Ok(item) => {
                g.items.push(item);
                for (p, it) in g.parts.iter_mut().zip(each) {
                    p.push(it);
                }
                used.push(i);
            }
            Err(e) => tracing::warn!("record at line {} skipped: {e}", r.line),
        }
    }
    (g, used)
}
