//! ZeRO-1's split of the optimiser state: whole parameter tensors, contiguous in the
//! optimiser's order, so that each rank holds AdamW's moments (and f32 masters) for about
//! `1/N` of the elements. The gradients are reduce-scattered along the same split and the
//! updated weights all-gathered; each element's update is the unsharded one, bit for bit.
//!
//! Whole tensors keep the update code the unsharded AdamW's; the price is balance: a rank's
//! share is off the ideal `1/N` by at most one tensor (the embedding, for small students).

use std::ops::Range;

/// Which parameters (by index) and which flat-gradient elements each rank owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    /// Per rank: the parameter indices it updates.
    pub vars: Vec<Range<usize>>,
    /// Per rank: the elements of the flat gradient those parameters cover.
    pub elems: Vec<Range<usize>>,
}

impl Ownership {
    /// Splits parameters of `sizes` elements over `world` ranks: rank `r`'s share ends at the
    /// first tensor boundary at or past `(r + 1)·total/N` elements.
    pub fn new(sizes: &[usize], world: usize) -> Ownership {
        let total: usize = sizes.iter().sum();
        let mut vars = Vec::with_capacity(world);
        let mut elems = Vec::with_capacity(world);
        let (mut v, mut e) = (0, 0);
        for r in 0..world {
            let target = ((r + 1) as u128 * total as u128 / world.max(1) as u128) as usize;
            let (v0, e0) = (v, e);
            while v < sizes.len() && (e < target || r + 1 == world) {
                e += sizes[v];
                v += 1;
            }
            vars.push(v0..v);
            elems.push(e0..e);
        }
        Ownership { vars, elems }
    }

    /// The largest share, in elements (what one rank's optimiser state is sized by).
    pub fn largest(&self) -> usize {
        self.elems.iter().map(|r| r.len()).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_tensor_once_in_order() {
        let sizes = [1000, 10, 10, 300, 300, 300, 300, 10, 1000];
        for world in 1..=6 {
            let o = Ownership::new(&sizes, world);
            assert_eq!(o.vars.len(), world);
            let flat: Vec<usize> = o.vars.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..sizes.len()).collect::<Vec<_>>());
            let mut at = 0;
            for (v, e) in o.vars.iter().zip(&o.elems) {
                assert_eq!(e.start, at);
                at += sizes[v.clone()].iter().sum::<usize>();
                assert_eq!(e.end, at);
            }
            assert_eq!(at, sizes.iter().sum::<usize>());
            // No share exceeds the ideal by more than the largest tensor.
            let ideal = at.div_ceil(world);
            assert!(o.largest() <= ideal + 1000, "{world}: {o:?}");
        }
        // More ranks than tensors: some ranks own nothing.
        let o = Ownership::new(&[5, 5], 4);
        assert_eq!(o.elems.iter().filter(|e| e.is_empty()).count(), 2);
    }
}
