//! The token after a sequence (the compatible routes' `max_tokens: 1`): chosen from the row
//! after the last token ([`choose_next`]), which is then scored with it as its target.

use super::params::{CandidateRows, NextToken, ScoreParams};
use super::{host_f32, score_rows, with_host_f32, Phase, Scorer, ScoringError, Timing};
use candle_core::Tensor;
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

impl Scorer {
    /// The row after the last token, from its hidden state `row` [1, H]: the next token chosen
    /// as `params.next` says, and the row's scores with that token as its target.
    pub(super) fn score_next(
        &self,
        decoder: &Decoder,
        row: &Tensor,
        cands: CandidateRows<'_>,
        params: &ScoreParams,
        timing: &mut Timing,
    ) -> Result<(SequenceScores, u32), ScoringError> {
        let Some(how) = params.next else {
            unreachable!("score_next without a next token asked for");
        };
        let logits = timing.in_phase(Phase::Head, || decoder.logits(row))?;
        let logits = timing.in_phase(Phase::Copy, || host_f32(&logits))?;
        let scored = timing.in_phase(Phase::Topk, || {
            with_host_f32(&logits, |row| {
                let token = choose_next(&row[..self.valid()], params.temperature, how);
                let q = params.rows(self.valid());
                let s = score_rows(row, self.logits_size, &[token], cands, &q);
                (s.into(), token)
            })
        })?;
        Ok(scored)
    }
}

/// The token after a sequence, from its last logit row `row` \[valid\]: the first maximum
/// (greedy), or a draw from `softmax(row / temperature)` by the inverse CDF of a uniform made
/// from `seed` (SplitMix64), summed in f64.
pub fn choose_next(row: &[f32], temperature: f32, how: NextToken) -> u32 {
    let first_max = || {
        let mut best = 0usize;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best as u32
    };
    match how {
        NextToken::Greedy => first_max(),
        NextToken::Sample { seed } => {
            let inv_t = 1.0 / temperature as f64;
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let total: f64 = row.iter().map(|&x| ((x as f64 - m) * inv_t).exp()).sum();
            let u = unit_uniform(seed) * total;
            let mut acc = 0.0;
            for (i, &x) in row.iter().enumerate() {
                acc += ((x as f64 - m) * inv_t).exp();
                if acc > u {
                    return i as u32;
                }
            }
            first_max() // u within rounding of the total
        }
    }
}

/// A uniform in `[0, 1)` from a seed: one SplitMix64 step, 53 bits.
fn unit_uniform(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_the_first_maximum() {
        assert_eq!(
            choose_next(&[0.0, 2.0, 1.0, 2.0], 1.0, NextToken::Greedy),
            1
        );
    }

    /// Seeded draws are reproducible and follow softmax(z / τ): empirical frequencies over
    /// 20,000 seeds against the f64 probabilities (5 standard errors).
    #[test]
    fn sampling_follows_the_tempered_softmax() {
        let row = [0.0f32, 1.0, -1.0, 0.5];
        let t = 0.7f32;
        let mut counts = [0usize; 4];
        let n = 20_000;
        for seed in 0..n as u64 {
            counts[choose_next(&row, t, NextToken::Sample { seed }) as usize] += 1;
        }
        let w: Vec<f64> = row.iter().map(|&x| (x as f64 / t as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = w[i] / total;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            let f = c as f64 / n as f64;
            assert!((f - p).abs() < 5.0 * se, "id {i}: {f} vs {p}");
        }
        let s = NextToken::Sample { seed: 42 };
        assert_eq!(choose_next(&row, t, s), choose_next(&row, t, s));
    }
}
