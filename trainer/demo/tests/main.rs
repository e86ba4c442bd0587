//! The demo crate's tests, one binary (one link): `trainer sft` on the synthetic task.

mod sft;
