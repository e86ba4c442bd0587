//! The trainer's integration tests, one binary (one link): the student, alignment, losses,
//! generation, the teacher client against a real `teacher`, pruning, projections, fixtures from
//! transformers. Each file is a module; `cargo nextest run -E 'test(/^student::/)'` runs one.

mod align_common;
mod common;

mod align_cli;
mod align_pairs;
mod align_props;
mod generate;
mod hf_fixtures;
mod loss_train;
mod projection;
mod prune;
mod student;
mod teacher_client;
