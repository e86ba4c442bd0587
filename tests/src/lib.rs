//! What only the cross-process tests share beyond `xdistill_testkit` (binaries, a running
//! teacher, tiny models, tokenizers): the trainer configs of their short runs ([`distill`]).
//!
//! The tests run the workspace's binaries, found beside the test executable
//! (`xdistill_testkit::binaries`): `cargo test --workspace` builds them first, while
//! `cargo test -p xdistill-tests` alone does not (run `cargo build --workspace` first).

pub mod distill;
