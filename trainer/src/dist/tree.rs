//! The one summation order of the exact mode: a pairwise tree, left to right, level by level
//! (`[a, b, c, d]` → `(a + b) + (c + d)`). A step's gradient is this tree over its virtual
//! shards; N processes each build the subtree of their contiguous shards and the ranks'
//! results are combined by the same tree in rank order. With N a power of two dividing the
//! shard count, every process count adds the same numbers in the same order: the weights are
//! the same bit for bit.

/// `parts` summed element-wise by the pairwise tree, in place into `parts[0]`.
/// `[P][n]` → `[n]`. Empty `parts` is a no-op.
pub fn tree_sum_in_place(parts: &mut [Vec<f32>]) {
    let mut width = parts.len();
    while width > 1 {
        let half = width.div_ceil(2);
        for i in 0..width / 2 {
            let (lo, hi) = parts.split_at_mut(2 * i + 1);
            let (dst, src) = (&mut lo[2 * i], &hi[0]);
            for (d, s) in dst.iter_mut().zip(src) {
                *d += *s;
            }
            if i > 0 {
                parts.swap(i, 2 * i);
            }
        }
        if width % 2 == 1 {
            parts.swap(half - 1, width - 1);
        }
        width = half;
    }
}

/// What a [`TreeAccumulator`] sums: a host buffer, or a step's gradients as tensors.
pub trait Summand: Sized {
    type Error;
    /// `self ← self + rhs`, element-wise, in f32 (the same bits as `tree_sum_in_place`'s adds).
    fn add_assign(&mut self, rhs: &Self) -> Result<(), Self::Error>;
}

impl Summand for Vec<f32> {
    type Error = std::convert::Infallible;
    fn add_assign(&mut self, rhs: &Self) -> Result<(), Self::Error> {
        for (l, r) in self.iter_mut().zip(rhs) {
            *l += *r;
        }
        Ok(())
    }
}

/// A running pairwise tree over leaves pushed one at a time (a binary counter): it holds at
/// most `log2(leaves) + 1` partial sums and ends with exactly the sum [`tree_sum_in_place`]
/// gives over the same leaves.
#[derive(Debug)]
pub struct TreeAccumulator<T = Vec<f32>> {
    /// `(level, partial sum)`, levels strictly decreasing from the bottom of the stack.
    stack: Vec<(u32, T)>,
    leaves: usize,
}

impl<T> Default for TreeAccumulator<T> {
    fn default() -> Self {
        TreeAccumulator {
            stack: Vec::new(),
            leaves: 0,
        }
    }
}

impl<T: Summand> TreeAccumulator<T> {
    pub fn new() -> TreeAccumulator<T> {
        TreeAccumulator::default()
    }

    /// Adds the next leaf (`[n]`, the same `n` every time).
    pub fn push(&mut self, leaf: T) -> Result<(), T::Error> {
        let mut node = (0u32, leaf);
        while let Some((level, _)) = self.stack.last() {
            if *level != node.0 {
                break;
            }
            let (level, mut left) = self.stack.pop().expect("checked non-empty");
            left.add_assign(&node.1)?;
            node = (level + 1, left);
        }
        self.stack.push(node);
        self.leaves += 1;
        Ok(())
    }

    pub fn leaves(&self) -> usize {
        self.leaves
    }

    /// The sum of every leaf pushed: the partials (subtrees, largest first) folded from the
    /// right, which is [`tree_sum_in_place`]'s tree for any leaf count. `None` without leaves.
    pub fn finish(self) -> Result<Option<T>, T::Error> {
        let mut parts = self.stack.into_iter().rev().map(|(_, v)| v);
        let Some(mut acc) = parts.next() else {
            return Ok(None);
        };
        for mut left in parts {
            left.add_assign(&acc)?;
            acc = left;
        }
        Ok(Some(acc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree written as recursion over halves, in f32: the definition.
    fn reference(parts: &[Vec<f32>]) -> Vec<f32> {
        fn rec(p: &[Vec<f32>]) -> Vec<f32> {
            if p.len() == 1 {
                return p[0].clone();
            }
            // Level-by-level pairing = split at the largest power of two below len.
            let split = p.len().next_power_of_two() / 2;
            let (l, r) = (rec(&p[..split]), rec(&p[split..]));
            l.iter().zip(&r).map(|(a, b)| a + b).collect()
        }
        rec(parts)
    }

    fn leaves(count: usize, n: usize, seed: u32) -> Vec<Vec<f32>> {
        // Values spanning magnitudes, so that the order of additions shows in the bits.
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..count)
            .map(|_| {
                (0..n)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 17;
                        s ^= s << 5;
                        let m = (s % 2001) as f32 / 1000.0 - 1.0;
                        m * 10f32.powi((s % 9) as i32 - 4)
                    })
                    .collect()
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn in_place_tree_matches_its_definition() {
        for count in 1..=13 {
            let l = leaves(count, 37, count as u32);
            let mut p = l.clone();
            tree_sum_in_place(&mut p);
            assert_eq!(bits(&p[0]), bits(&reference(&l)), "{count} leaves");
        }
    }

    #[test]
    fn accumulator_equals_the_tree() {
        for count in 1..=17 {
            let l = leaves(count, 53, 7 + count as u32);
            let mut acc = TreeAccumulator::<Vec<f32>>::new();
            for x in &l {
                acc.push(x.clone()).unwrap();
            }
            assert_eq!(acc.stack.len(), count.count_ones() as usize);
            assert_eq!(bits(&acc.finish().unwrap().unwrap()), bits(&reference(&l)));
        }
    }

    #[test]
    fn any_power_of_two_split_gives_the_same_bits() {
        // 16 virtual shards over 1, 2, 4, 8 and 16 "ranks": each rank accumulates its
        // contiguous share, the ranks' sums meet in the same tree.
        let l = leaves(16, 101, 3);
        let one = reference(&l);
        for ranks in [1, 2, 4, 8, 16] {
            let share = 16 / ranks;
            let mut per_rank: Vec<Vec<f32>> = l
                .chunks(share)
                .map(|c| {
                    let mut a = TreeAccumulator::<Vec<f32>>::new();
                    c.iter().for_each(|x| a.push(x.clone()).unwrap());
                    a.finish().unwrap().unwrap()
                })
                .collect();
            tree_sum_in_place(&mut per_rank);
            assert_eq!(bits(&per_rank[0]), bits(&one), "{ranks} ranks");
        }
        // A sequential left fold is a different sum: the test above could fail.
        let fold = l[1..].iter().fold(l[0].clone(), |mut a, x| {
            a.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            a
        });
        assert_ne!(bits(&fold), bits(&one));
        // And the tree is the sum to f32 accuracy (f64 reference).
        for (j, y) in one.iter().enumerate() {
            let exact: f64 = l.iter().map(|v| v[j] as f64).sum();
            assert!(
                (*y as f64 - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                "{j}"
            );
        }
    }
}
