//! Training loops and the pieces they share.
//!
//! Data flows one way: dataset → [`prepare`] (tokenize, align, teacher request) → teacher client
//! (prefetched) → [`step`] (loss on the student) → [`runner::Runner`] (clip, schedule, AdamW,
//! checkpoint).

pub mod off_policy;
pub mod on_policy;
pub mod prepare;
pub mod runner;
pub mod sft;
pub mod step;
