//! A chunk-level ensemble's virtual teacher: teachers of different tokenizers mixed at the
//! chunks common to all of them ([`crate::train::teachers::ensemble`]), laid out in the
//! student's own tokenization. Its record is built from every teacher's aligned record
//! ([`virtual_item`]); it trains like [`super::cross`] through the identity projection
//! ([`identity_projection`]) and validates with first-token KL (its rows exist only at chunk
//! starts).

use super::cross::Cross;
use super::Item;
use crate::loss::{KdConfig, Projection};
use crate::train::teachers::ensemble;
use anyhow::Result;
use std::collections::BTreeMap;

/// The mixture's collation: the cross-tokenizer one, validated with first-token KL.
pub fn collation(projection: &Projection) -> Cross<'_> {
    Cross {
        projection,
        validation_kd: KdConfig::FirstKl {},
    }
}

/// A teacher's chunk starts in its item (student token index → first teacher token index).
pub fn item_starts(item: &Item) -> BTreeMap<usize, usize> {
    ensemble::chunk_starts(item.aligned().map(|(p, _)| p), item.student_ids().len())
}

/// The chunk-level ensemble's record from every teacher's tokenization of it: the first aligned
/// one is the reference; all must agree on the student's tokens.
pub fn virtual_item(each: &[Item]) -> std::result::Result<Item, String> {
    let Some((pair, loss_start)) = each.iter().find_map(Item::aligned) else {
        return Err("no teacher of the ensemble has another tokenizer".into());
    };
    if each.iter().any(|it| it.student_ids() != pair.student_ids) {
        return Err("the teachers' alignments disagree on the student's tokens (special tokens or truncation)".into());
    }
    let starts: Vec<BTreeMap<usize, usize>> = each.iter().map(item_starts).collect();
    let pair = ensemble::chunk_item(pair, &starts);
    Ok(Item::Cross { pair, loss_start })
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
