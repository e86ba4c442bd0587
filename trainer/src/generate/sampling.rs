//! Next-token sampling on one CPU-side logits row: temperature, top-k, top-p (nucleus), greedy.
//!
//! The returned log-prob is always `log_softmax(z / τ)[x]` over the **whole** supported vocabulary,
//! before top-k/top-p truncation (τ = 1 for greedy). That is the `lp_S_old(x_t)` on-policy
//! distillation needs: the student's own distribution, which the training loss recomputes with
//! gradients, not the truncated proposal the sampler drew from.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("logits row has a NaN or +inf at token {0} (did the model diverge?)")]
    NonFinite(usize),
    #[error("no token has a finite logit (all {0} candidates are masked)")]
    AllMasked(usize),
    #[error("invalid sampling parameters: {0}")]
    Params(String),
}

/// How to turn a logits row into a token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature τ; 0 means greedy (argmax, lowest id on ties).
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability (after top-k) reaches
    /// `top_p` (1 = no limit). Always keeps at least one token.
    pub top_p: f64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SampleError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SampleError::Params(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SampleError::Params(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A drawn token and its log-prob under the untruncated `softmax(z / τ)` (τ = 1 when greedy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprob: f32,
}

/// `log_softmax(z / τ)` of every entry of `row`, in f64 (test and reference helper).
pub fn log_softmax(row: &[f32], temperature: f64) -> Vec<f64> {
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let s: Vec<f64> = row.iter().map(|&z| z as f64 / t).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    s.iter().map(|x| x - lse).collect()
}

/// Draws the next token from `row` (the logits of the supported vocabulary: callers pass only
/// the ids the tokenizer can decode). `-inf` entries are never drawn; NaN or `+inf` is an error.
pub fn sample_token(
    row: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Result<Sampled, SampleError> {
    if let Some(i) = row.iter().position(|z| z.is_nan() || *z == f32::INFINITY) {
        return Err(SampleError::NonFinite(i));
    }
    // 1. Unnormalised probabilities w_i = exp((z_i - max) / τ), one f32 exp per entry (the hot
    //    loop over 150k tokens), summed in f64.
    let tau = if p.is_greedy() { 1.0 } else { p.temperature };
    // Plain loops: they stay fast in the unoptimised test profile too.
    let mut zmax = f32::NEG_INFINITY;
    for &z in row {
        zmax = zmax.max(z);
    }
    if zmax == f32::NEG_INFINITY {
        return Err(SampleError::AllMasked(row.len()));
    }
    let inv_tau = (1.0 / tau) as f32;
    let mut w = Vec::with_capacity(row.len());
    let mut total = 0f64;
    for &z in row {
        let e = ((z - zmax) * inv_tau).exp();
        w.push(e);
        total += e as f64;
    }
    let ln_total = total.ln();
    // log_softmax(z / τ)_i = (z_i - max) / τ - ln Σ w.
    let logprob = |i: usize| ((row[i] - zmax) as f64 / tau - ln_total) as f32;

    // 2. Greedy: first maximum.
    if p.is_greedy() {
        let best = row.iter().position(|&z| z == zmax).unwrap_or(0);
        return Ok(Sampled {
            id: best as u32,
            logprob: logprob(best),
        });
    }

    // 3. Untruncated: inverse CDF over the whole row, no sort needed.
    let k = if p.top_k == 0 { row.len() } else { p.top_k };
    if k >= row.len() && p.top_p >= 1.0 {
        let u = rng.random::<f64>() * total;
        let id = draw(u, w.iter().map(|&x| x as f64).enumerate());
        return Ok(Sampled {
            id: id as u32,
            logprob: logprob(id),
        });
    }

    // 4. Candidates by decreasing score (ties: lower id first); top-k by partial selection.
    let by_score = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..row.len()).filter(|&i| row[i].is_finite()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_score);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_score);

    // 5. Nucleus: smallest prefix whose mass reaches top_p of the (top-k) candidates' mass.
    let w: Vec<f64> = idx.iter().map(|&i| w[i] as f64).collect();
    let mut kept = w.len();
    if p.top_p < 1.0 {
        let cand_total: f64 = w.iter().sum();
        let mut cum = 0.0;
        for (j, x) in w.iter().enumerate() {
            cum += x;
            if cum >= p.top_p * cand_total {
                kept = j + 1;
                break;
            }
        }
    }
    let kept_total: f64 = w[..kept].iter().sum();
    let u = rng.random::<f64>() * kept_total;
    let id = draw(
        u,
        idx[..kept].iter().copied().zip(w[..kept].iter().copied()),
    );
    Ok(Sampled {
        id: id as u32,
        logprob: logprob(id),
    })
}

/// The first candidate whose cumulative weight exceeds `u` (the last positive one if rounding
/// leaves `u` past the end).
fn draw(u: f64, candidates: impl Iterator<Item = (usize, f64)>) -> usize {
    let mut cum = 0.0;
    let mut last = 0;
    for (i, w) in candidates {
        if w > 0.0 {
            cum += w;
            last = i;
            if u < cum {
                return i;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(temperature: f64, top_k: usize, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    /// A fixed, irregular logits row (values from a small LCG, so nothing is special-cased).
    fn row(n: usize) -> Vec<f32> {
        let mut x: u64 = 12345;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f64 / (1u64 << 31) as f64 * 6.0 - 3.0) as f32
            })
            .collect()
    }

    fn counts(r: &[f32], p: &SamplingParams, draws: usize, seed: u64) -> Vec<usize> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut c = vec![0; r.len()];
        for _ in 0..draws {
            c[sample_token(r, p, &mut rng).unwrap().id as usize] += 1;
        }
        c
    }

    /// Pearson chi-square of observed counts against expected probabilities.
    fn chi_square(c: &[usize], probs: &[f64]) -> f64 {
        let n: usize = c.iter().sum();
        c.iter()
            .zip(probs)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn temperature_sampling_matches_softmax() {
        // 12 categories → 11 degrees of freedom; the 99.9% quantile of chi²(11) is 31.3.
        let r = row(12);
        for tau in [0.5, 1.0, 2.0] {
            let expected: Vec<f64> = log_softmax(&r, tau).iter().map(|l| l.exp()).collect();
            let c = counts(&r, &params(tau, 0, 1.0), 40_000, 7);
            let chi = chi_square(&c, &expected);
            assert!(chi < 31.3, "tau {tau}: chi2 {chi}, counts {c:?}");
        }
    }

    #[test]
    fn top_k_and_top_p_sample_the_renormalised_truncation() {
        let r = row(12);
        // Reference: sort ids by logit, keep top 4, renormalise softmax(z/τ) over them.
        let tau = 0.8;
        let mut order: Vec<usize> = (0..12).collect();
        order.sort_by(|&a, &b| r[b].partial_cmp(&r[a]).unwrap());
        let lp = log_softmax(&r, tau);
        let mut expected = vec![0.0; 12];
        let z: f64 = order[..4].iter().map(|&i| lp[i].exp()).sum();
        for &i in &order[..4] {
            expected[i] = lp[i].exp() / z;
        }
        let c = counts(&r, &params(tau, 4, 1.0), 20_000, 3);
        assert!(order[4..].iter().all(|&i| c[i] == 0));
        // 3 degrees of freedom: 99.9% quantile 16.3.
        assert!(chi_square(&c, &expected) < 16.3, "{c:?}");

        // top_p: the smallest prefix reaching top_p of the mass.
        let probs: Vec<f64> = lp.iter().map(|l| l.exp()).collect();
        let mut cum = 0.0;
        let mut n_keep = 0;
        for &i in &order {
            cum += probs[i];
            n_keep += 1;
            if cum >= 0.6 {
                break;
            }
        }
        let c = counts(&r, &params(tau, 0, 0.6), 20_000, 4);
        let support = c.iter().filter(|&&x| x > 0).count();
        assert_eq!(support, n_keep);
        assert!(order[..n_keep].iter().all(|&i| c[i] > 0));
    }

    #[test]
    fn logprob_is_untruncated_log_softmax_over_temperature() {
        let r = row(50);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for p in [
            params(0.7, 0, 1.0),
            params(0.7, 3, 1.0),
            params(1.3, 0, 0.5),
        ] {
            let lp = log_softmax(&r, p.temperature);
            for _ in 0..20 {
                let s = sample_token(&r, &p, &mut rng).unwrap();
                assert!((s.logprob as f64 - lp[s.id as usize]).abs() < 1e-5);
            }
        }
        let g = sample_token(&r, &params(0.0, 0, 1.0), &mut rng).unwrap();
        let lp1 = log_softmax(&r, 1.0);
        assert!((g.logprob as f64 - lp1[g.id as usize]).abs() < 1e-5);
    }

    #[test]
    fn greedy_top_k1_and_tiny_top_p_agree() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for n in [5, 64, 1000] {
            let r = row(n);
            let argmax = (0..n).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as u32;
            assert_eq!(
                sample_token(&r, &params(0.0, 0, 1.0), &mut rng).unwrap().id,
                argmax
            );
            for _ in 0..10 {
                assert_eq!(
                    sample_token(&r, &params(1.5, 1, 1.0), &mut rng).unwrap().id,
                    argmax
                );
                assert_eq!(
                    sample_token(&r, &params(1.5, 0, 1e-9), &mut rng)
                        .unwrap()
                        .id,
                    argmax
                );
            }
        }
        // Ties: the lowest id, for greedy and top-k=1 alike.
        let tie = [0.0, 2.0, 1.0, 2.0];
        assert_eq!(
            sample_token(&tie, &params(0.0, 0, 1.0), &mut rng)
                .unwrap()
                .id,
            1
        );
        assert_eq!(
            sample_token(&tie, &params(1.0, 1, 1.0), &mut rng)
                .unwrap()
                .id,
            1
        );
    }

    #[test]
    fn masked_and_bad_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let r = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        let c = counts(&r, &params(1.0, 0, 1.0), 2000, 5);
        assert_eq!((c[0], c[2]), (0, 0));
        let c = counts(&r, &params(1.0, 3, 0.9), 2000, 5);
        assert_eq!((c[0], c[2]), (0, 0));
        assert!(matches!(
            sample_token(&[0.0, f32::NAN], &params(1.0, 0, 1.0), &mut rng),
            Err(SampleError::NonFinite(1))
        ));
        assert!(matches!(
            sample_token(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0), &mut rng),
            Err(SampleError::AllMasked(3))
        ));
        assert!(params(-1.0, 0, 1.0).validate().is_err());
        assert!(params(1.0, 0, 0.0).validate().is_err());
        assert!(params(f64::NAN, 0, 1.0).validate().is_err());
    }
}
