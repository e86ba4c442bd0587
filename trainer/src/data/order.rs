//! Seeded record orders: a Fisher–Yates shuffle on a version-independent uniform draw.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Uniform integer in `[0, bound)` by rejection (independent of `rand`'s version-specific
/// algorithms, so the order of a seed never changes under a dependency update).
fn below(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    // Largest multiple of `bound` that fits in u64; reject draws at or above it.
    let zone = u64::MAX - (u64::MAX % bound);
    loop {
        let x = rng.next_u64();
        if x < zone {
            return x % bound;
        }
    }
}

/// Fisher–Yates shuffle.
pub(super) fn shuffle<T>(v: &mut [T], rng: &mut ChaCha8Rng) {
    for i in (1..v.len()).rev() {
        let j = below(rng, i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

/// The order in which epoch `epoch` visits `n` records: a permutation seeded by `(seed, epoch)`,
/// or `0..n` without shuffling.
pub fn epoch_order(n: usize, seed: u64, epoch: u64, shuffled: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffled {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(epoch);
        shuffle(&mut order, &mut rng);
    }
    order
}
