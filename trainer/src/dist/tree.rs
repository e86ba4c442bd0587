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

/// A running pairwise tree over leaves pushed one at a time (a binary counter): it holds at
/// most `log2(leaves) + 1` partial sums and ends with exactly the sum [`tree_sum_in_place`]
/// gives over the same leaves.
#[derive(Debug, Default)]
pub struct TreeAccumulator {
    /// `(level, partial sum)`, levels strictly decreasing from the bottom of the stack.
    stack: Vec<(u32, Vec<f32>)>,
    leaves: usize,
}

impl TreeAccumulator {
    pub fn new() -> TreeAccumulator {
        TreeAccumulator::default()
    }

    /// Adds the next leaf (`[n]`, the same `n` every time).
    pub fn push(&mut self, leaf: Vec<f32>) {
        let mut node = (0u32, leaf);
        while let Some((level, _)) = self.stack.last() {
            if *level != node.0 {
                break;
            }
            let (level, mut left) = self.stack.pop().expect("checked non-empty");
            for (l, r) in left.iter_mut().zip(&node.1) {
                *l += *r;
            }
            node = (level + 1, left);
        }
        self.stack.push(node);
        self.leaves += 1;
    }

    pub fn leaves(&self) -> usize {
        self.leaves
    }

    /// The sum of every leaf pushed: the partials (subtrees, largest first) folded from the
    /// right, which is [`tree_sum_in_place`]'s tree for any leaf count.
    pub fn finish(self) -> Option<Vec<f32>> {
        let mut parts = self.stack.into_iter().rev().map(|(_, v)| v);
        let mut acc = parts.next()?;
        for mut left in parts {
            for (l, r) in left.iter_mut().zip(&acc) {
                *l += *r;
            }
            acc = left;
        }
        Some(acc)
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
            let mut acc = TreeAccumulator::new();
            for x in &l {
                acc.push(x.clone());
            }
            assert_eq!(acc.stack.len(), count.count_ones() as usize);
            assert_eq!(bits(&acc.finish().unwrap()), bits(&reference(&l)));
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
                    let mut a = TreeAccumulator::new();
                    c.iter().for_each(|x| a.push(x.clone()));
                    a.finish().unwrap()
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
