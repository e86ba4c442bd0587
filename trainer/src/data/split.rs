//! The validation split: a seeded, resume-stable choice of held-out records.

use super::order::shuffle;
use super::{DataError, Dataset, LoadOptions, SkipCounts};
use crate::config::DataConfig;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

impl Dataset {
    /// Splits off `val_count` records chosen by a seeded permutation; both parts keep file order.
    /// The split depends only on the record count and the seed, so it is the same on resume.
    pub fn split_validation(
        self,
        val_count: usize,
        seed: u64,
    ) -> Result<(Dataset, Dataset), DataError> {
        let n = self.records.len();
        if val_count == 0 {
            return Ok((self, Dataset::default()));
        }
        if val_count >= n {
            return Err(DataError::SplitTooLarge {
                val: val_count,
                total: n,
            });
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(VAL_SPLIT_STREAM);
        let mut perm: Vec<usize> = (0..n).collect();
        shuffle(&mut perm, &mut rng);
        let mut is_val = vec![false; n];
        for &i in &perm[..val_count] {
            is_val[i] = true;
        }
        let (mut train, mut val) = (
            Vec::with_capacity(n - val_count),
            Vec::with_capacity(val_count),
        );
        for (r, v) in self.records.into_iter().zip(is_val) {
            if v {
                val.push(r)
            } else {
                train.push(r)
            }
        }
        Ok((
            Dataset {
                records: train,
                skipped: self.skipped,
            },
            Dataset {
                records: val,
                skipped: SkipCounts::default(),
            },
        ))
    }
}

/// Reads the training data and its validation part as `[data]` describes: `val_path` when set,
/// else `val_count` / `val_fraction` records held out of `train_path` by `seed`.
/// Returns (train, validation); the validation set may be empty.
pub fn load_train_val(d: &DataConfig, seed: u64) -> Result<(Dataset, Dataset), DataError> {
    let opts = LoadOptions::from_config(d);
    let all = Dataset::load(&d.train_path, &opts)?;
    match &d.val_path {
        Some(vp) => Ok((all, Dataset::load(vp, &opts)?)),
        None => {
            let n = val_size(all.records.len(), d.val_fraction, d.val_count);
            all.split_validation(n, seed)
        }
    }
}

/// Validation size: `count` when given, else `round(fraction · n)`.
pub fn val_size(n: usize, fraction: f64, count: Option<usize>) -> usize {
    count.unwrap_or_else(|| (fraction * n as f64).round() as usize)
}

/// The RNG stream used for the validation split (epochs use streams 0, 1, 2, ...).
const VAL_SPLIT_STREAM: u64 = u64::MAX;
