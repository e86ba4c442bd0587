//! The training loop and its objectives.
//!
//! [`runner::run`] is the one loop (session, validation cadence, metrics, checkpoints, final
//! save); [`off_policy`], [`on_policy`] and [`sft`] implement [`runner::Objective`]. Data flows
//! one way: dataset → [`prepare`] (tokenize, align, teacher request) → [`teachers`] (routing;
//! every group scored together on one teacher pool, prefetched) → [`step`] (loss on the
//! student, its LM head in chunks: [`head_chunks`]) → [`runner::Runner`] (clip, schedule, AdamW,
//! checkpoint). Same vs cross-tokenizer vs chunk-mixture pairing is decided once per source and
//! lives in [`pairing`], which owns each pairing's items, collation, losses and validation
//! figures. What both distillation objectives share (setup, record filter, group loss, held-out
//! KL) is in [`distill`].

pub mod distill;
pub mod head_chunks;
pub mod micro;
pub mod off_policy;
pub mod on_policy;
pub mod pairing;
pub mod phases;
pub mod prepare;
pub mod runner;
pub mod sft;
pub mod step;
pub mod teachers;
#[cfg(test)]
pub(crate) mod testutil;
pub mod xpieces;
