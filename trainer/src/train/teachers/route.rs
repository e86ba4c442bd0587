//! Routing: which source (one teacher, or the mixture of all) scores a record, checked once for
//! the whole dataset at start, and each source's pairing, limits and name.

use super::{Teacher, Teachers};
use crate::config::TeacherMode;
use crate::data::Record;
use crate::train::pairing::{Item, Limits, Pairing};
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// Who scores a group of records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The teacher at this index.
    One(usize),
    /// The weighted mixture of every teacher (same tokenizer as the student).
    Mixture,
}

impl Teachers {
    /// Several teachers are routed per record.
    pub fn routed(&self) -> bool {
        self.mode == TeacherMode::Route && self.list.len() > 1
    }

    /// The source of `r`: its named teacher, the default, or (ensemble) the mixture; the error
    /// says why it has none.
    pub fn source_of(&self, r: &Record) -> std::result::Result<Source, String> {
        // An ensemble of one teacher goes through the ensemble's path too (where its mixture is
        // that teacher's answer itself).
        if self.mode == TeacherMode::Ensemble {
            return Ok(Source::Mixture);
        }
        if self.list.len() == 1 {
            return Ok(Source::One(0));
        }
        let named = r
            .teacher
            .as_deref()
            .and_then(|n| self.by_name.get(n).copied());
        match (named, self.default, &r.teacher) {
            (Some(i), _, _) => Ok(Source::One(i)),
            (None, Some(d), _) => Ok(Source::One(d)),
            (None, None, Some(n)) => Err(format!(
                "names teacher {n:?}, which is not configured (teachers: {}); fix the record or set data.default_teacher",
                self.names()
            )),
            (None, None, None) => Err(
                "names no teacher (data.teacher_field) and there is no data.default_teacher".to_string()
            ),
        }
    }

    fn names(&self) -> String {
        self.list
            .iter()
            .map(|t| format!("{:?}", t.name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks at start that every record has a teacher: the first that has none is the error;
    /// records naming an unknown teacher that go to the default are counted in one warning.
    pub fn check_records(&self, records: &[Record], what: &str) -> Result<()> {
        if !self.routed() {
            return Ok(());
        }
        let mut unknown: BTreeMap<&str, usize> = BTreeMap::new();
        let mut per: BTreeMap<usize, usize> = BTreeMap::new();
        for r in records {
            match self.source_of(r) {
                Ok(Source::One(i)) => *per.entry(i).or_default() += 1,
                Ok(Source::Mixture) => {}
                Err(e) => bail!("{what} record at line {} {e}", r.line),
            }
            if let Some(n) = r
                .teacher
                .as_deref()
                .filter(|n| !self.by_name.contains_key(*n))
            {
                *unknown.entry(n).or_default() += 1;
            }
        }
        if !unknown.is_empty() {
            let d = self.default.map_or("", |d| self.list[d].name.as_str());
            tracing::warn!(
                "{what} records naming no configured teacher go to the default {d:?}: {unknown:?}"
            );
        }
        let counts: Vec<String> = per
            .iter()
            .map(|(&i, n)| format!("{} {n}", self.list[i].name))
            .collect();
        tracing::info!("{what} records per teacher: {}", counts.join(", "));
        Ok(())
    }

    /// The teacher of a source (the mixture: the first).
    pub(crate) fn of(&self, s: Source) -> &Teacher {
        match s {
            Source::One(i) => &self.list[i],
            Source::Mixture => &self.list[0],
        }
    }

    /// How a source's answers lie against the student's tokens: the same tokenizer, another
    /// one (with its projection), or a chunk-level ensemble's virtual teacher.
    pub fn pairing(&self, s: Source) -> Pairing<'_> {
        match (s, &self.chunk_projection) {
            (Source::Mixture, Some(p)) => Pairing::Mixture(p),
            (Source::Mixture, None) if self.list.len() == 1 => self.list[0].pairing(),
            (Source::Mixture, None) => Pairing::Same,
            (Source::One(i), _) => self.list[i].pairing(),
        }
    }

    /// Whether a source's records are aligned across tokenizers (its loss is `[loss_cross]`).
    pub fn is_cross(&self, s: Source) -> bool {
        self.pairing(s).is_cross()
    }

    /// Whether `r` is over its teacher's or the student's token limits (an ensemble: any
    /// teacher's); records without a teacher are not (they fail the start's check).
    pub fn too_long(&self, r: &Record) -> bool {
        match self.source_of(r) {
            Ok(Source::Mixture) => self
                .list
                .iter()
                .any(|t| t.tokenization.too_long(r, t.limits)),
            Ok(s) => self.of(s).tokenization.too_long(r, self.limits(s)),
            Err(_) => false,
        }
    }

    /// The student tokenizer (every teacher's tokenization holds the same one).
    pub fn student_tokenizer(&self) -> &tokenizers::Tokenizer {
        self.list[0].tokenization.student_tokenizer()
    }

    /// Limits of a source's records (the mixture: the tightest teacher's).
    pub fn limits(&self, s: Source) -> Limits {
        match s {
            Source::One(i) => self.list[i].limits,
            Source::Mixture => {
                let mut l = self.list[0].limits;
                for t in &self.list {
                    l.max_teacher_tokens = l.max_teacher_tokens.min(t.limits.max_teacher_tokens);
                }
                l
            }
        }
    }

    /// The name metrics use for a source.
    pub fn name(&self, s: Source) -> &str {
        match s {
            Source::One(i) => &self.list[i].name,
            Source::Mixture => "ensemble",
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
