//! The run's teachers: one connection per `[[teachers]]` entry (or `[teacher]`), each with its
//! own tokenizer relation to the student (same, or cross with its own projection), and which of
//! them scores each record: the teacher a record names (`route`) or the mixture of all of them
//! (`ensemble`: exact on the union of their top-k when they share the student's tokenizer, at the
//! chunk level otherwise).
//!
//! - [`connect`]: the handshake (health, replicas' `/v1/info`, tokenizer, projection) and the
//!   checks that the teachers fit the run's losses and mode.
//! - [`route`]: which source (one teacher, or the mixture) scores a record, and its limits.
//! - [`score`]: a step's groups scored on the [`TeacherPool`], every teacher's requests awaited
//!   together.
//! - [`ensemble`]: combining several teachers' answers into one target.
//! - [`hidden`]: the hidden-state transport's head (checked, fetched, put on the device).

pub mod connect;
pub mod ensemble;
pub mod hidden;
pub mod route;
pub mod score;

pub use crate::client::ScoreError;
pub use connect::Teacher;
pub use route::{Group, Source};

use crate::client::TeacherPool;
use crate::config::TeacherMode;
use crate::loss::Projection;
use std::collections::HashMap;

/// The run's teachers, their connections on one [`TeacherPool`], and how records are assigned
/// to them.
pub struct Teachers {
    pub list: Vec<Teacher>,
    pub mode: TeacherMode,
    /// Every teacher's client (teacher `i` of `list` is the pool's `i`), on one runtime.
    pool: TeacherPool,
    /// An ensemble with a teacher of another tokenizer: the identity projection of its virtual
    /// teacher in the student's tokenization (mixed at the chunk level, trained with first_kl).
    chunk_projection: Option<Projection>,
    by_name: HashMap<String, usize>,
    default: Option<usize>,
}

impl Teachers {
    /// The pool the teachers' requests run on (to await several sources' scoring together).
    pub fn pool(&self) -> &TeacherPool {
        &self.pool
    }

    /// Whether `source`'s records are mixed at the chunk level (an ensemble with a teacher of
    /// another tokenizer): each teacher scores its own tokenization of them.
    pub fn is_chunk_mixture(&self, source: Source) -> bool {
        source == Source::Mixture && self.chunk_projection.is_some()
    }
}
