//! A chunk-level ensemble's virtual teacher: teachers of different tokenizers mixed at the
//! chunks common to all of them ([`crate::train::teachers::ensemble`]), laid out in the
//! student's own tokenization. Its record is built from every teacher's aligned record
//! ([`crate::train::teachers::ensemble::virtual_item`]); it trains like [`super::cross`]
//! through the identity projection
//! ([`identity_projection`]) and validates with first-token KL (its rows exist only at chunk
//! starts).

use crate::loss::{KdConfig, Projection};
use anyhow::Result;

/// What the mixture's validation reports: first-token KL (it trains as the cross-tokenizer
/// pairing, [`super::cross::CrossBatch`]).
pub fn validation_kd() -> KdConfig {
    KdConfig::FirstKl {}
}

/// The identity projection of a vocabulary (`v × v`, each token its own first token).
pub fn identity_projection(v: usize) -> Result<Projection> {
    let indptr: Vec<usize> = (0..=v).collect();
    let indices: Vec<u32> = (0..v as u32).collect();
    Ok(
        Projection::from_csr(v, v, &indptr, &indices, &vec![1.0; v])?
            .with_teacher_first((0..v as u32).map(Some).collect())?,
    )
}
