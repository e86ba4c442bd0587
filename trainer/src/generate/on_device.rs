//! Greedy and untruncated sampling on the logits' own device, so that a decoding step moves a
//! few numbers per row to the host instead of the whole `[B, V]` logits.
//!
//! The draw is [`super::sampling::sample_token`]'s inverse CDF in two levels: the device sums
//! the weights `w = exp((z − max) / τ)` in blocks of [`BLOCK`] tokens (`[B, V/BLOCK]` to the
//! host), the host picks the block where the row's uniform falls (in f64, as the host sampler
//! does), then reads that block's logits (`[B, BLOCK]`) and picks the token inside it. The same
//! one uniform per sampled token is drawn from each row's RNG, so rollouts stay reproducible
//! and independent of the batch they run in. Top-k and top-p need a sort of the vocabulary:
//! those stay on the host path.

use super::sampling::{Sampled, SamplingParams};
use candle_core::{DType, Tensor, D};

/// Tokens per block of the two-level draw: a step moves `V/BLOCK + BLOCK` floats per row
/// (about 800 for a 152k vocabulary, instead of 152k).
pub const BLOCK: usize = 512;

/// Whether `p` samples on the device: greedy, or temperature sampling without truncation.
pub fn supported(p: &SamplingParams) -> bool {
    p.is_greedy() || (p.top_k == 0 && p.top_p >= 1.0)
}

/// What the device step returns per row: a token and its log-prob, or a row the host must
/// look at (a NaN, `+inf` or a fully masked row; the host sampler names the problem).
pub enum Draw {
    Token(Sampled),
    Host,
}

/// Samples one token per row of `logits` `[B, V]` (the supported vocabulary) with `u[r]` the
/// row's uniform in `[0, 1)` (ignored when greedy). Only for [`supported`] parameters.
pub fn sample_rows(
    logits: &Tensor,
    p: &SamplingParams,
    u: &[f64],
) -> candle_core::Result<Vec<Draw>> {
    let (b, v) = logits.dims2()?;
    if u.len() != b {
        candle_core::bail!("{} uniforms for {b} rows", u.len());
    }
    let dev = logits.device();
    let z = logits.to_dtype(DType::F32)?.contiguous()?;
    let tau = if p.is_greedy() { 1.0 } else { p.temperature };
    // 1. w = exp((z − max) / τ) [B, V]; its block sums [B, nb] (NaN or ±inf rows show there).
    let zmax = z.max_keepdim(D::Minus1)?; // [B, 1]
    let w = (z.broadcast_sub(&zmax)? * (1.0 / tau))?.exp()?;
    let nb = v.div_ceil(BLOCK);
    let w = if nb * BLOCK > v {
        Tensor::cat(
            &[&w, &Tensor::zeros((b, nb * BLOCK - v), DType::F32, dev)?],
            1,
        )?
    } else {
        w
    };
    let sums: Vec<Vec<f32>> = w.reshape((b, nb, BLOCK))?.sum(2)?.to_vec2()?;
    let zmax_t = zmax;
    let zmax: Vec<f32> = zmax_t.squeeze(1)?.to_vec1()?;
    let total: Vec<f64> = sums
        .iter()
        .map(|s| s.iter().map(|&x| x as f64).sum())
        .collect();
    let ok = |r: usize| total[r].is_finite() && total[r] > 0.0 && zmax[r].is_finite();
    // logprob of token i: (z_i − max) / τ − ln Σ w.
    let logprob = |r: usize, zi: f32| ((zi - zmax[r]) as f64 / tau - total[r].ln()) as f32;
    // 2. Greedy: the lowest id holding the maximum.
    if p.is_greedy() {
        let idx = Tensor::arange(0f32, v as f32, dev)?.unsqueeze(0)?; // [1, V]
        let at_max = z.broadcast_eq(&zmax_t)?;
        let far = Tensor::full(v as f32, (b, v), dev)?;
        let first: Vec<f32> = at_max
            .where_cond(&idx.broadcast_as((b, v))?.contiguous()?, &far)?
            .min(D::Minus1)?
            .to_vec1()?;
        return Ok((0..b)
            .map(|r| match ok(r) {
                true => Draw::Token(Sampled {
                    id: first[r] as u32,
                    logprob: logprob(r, zmax[r]),
                }),
                false => Draw::Host,
            })
            .collect());
    }
    // 3. The block where u·Σw falls, per row (the last block with weight if rounding runs past).
    let mut picks = Vec::with_capacity(b);
    for r in 0..b {
        let target = u[r] * total[r];
        let mut cum = 0.0;
        let mut pick = None;
        for (j, &s) in sums[r].iter().enumerate() {
            if s > 0.0 {
                if target < cum + s as f64 {
                    pick = Some((j, target - cum));
                    break;
                }
                cum += s as f64;
                pick = Some((j, f64::INFINITY));
            }
        }
        picks.push(pick.unwrap_or((0, 0.0)));
    }
    // 4. Those blocks' logits [B, BLOCK] to the host; the token inside by the host rule.
    let rows: Vec<u32> = picks
        .iter()
        .enumerate()
        .map(|(r, (j, _))| (r * nb + j) as u32)
        .collect();
    let zpad = if nb * BLOCK > v {
        let ninf = Tensor::full(f32::NEG_INFINITY, (b, nb * BLOCK - v), dev)?;
        Tensor::cat(&[&z, &ninf], 1)?
    } else {
        z
    };
    let blocks: Vec<Vec<f32>> = zpad
        .reshape((b * nb, BLOCK))?
        .index_select(&Tensor::new(rows.as_slice(), dev)?, 0)?
        .to_vec2()?;
    let inv_tau = (1.0 / tau) as f32;
    Ok((0..b)
        .map(|r| {
            if !ok(r) {
                return Draw::Host;
            }
            let (j, mut left) = picks[r];
            let mut chosen = None;
            for (i, &zi) in blocks[r].iter().enumerate() {
                let wi = ((zi - zmax[r]) * inv_tau).exp() as f64;
                if wi > 0.0 {
                    chosen = Some(i);
                    if left < wi {
                        break;
                    }
                    left -= wi;
                }
            }
            match chosen {
                Some(i) => Draw::Token(Sampled {
                    id: (j * BLOCK + i) as u32,
                    logprob: logprob(r, blocks[r][i]),
                }),
                None => Draw::Host,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::sampling::sample_token;
    use super::*;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Logits rows with a long tail, a few masked entries and a vocabulary that is not a
    /// multiple of the block.
    fn logits(b: usize, v: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..b)
            .map(|_| {
                (0..v)
                    .map(|i| {
                        if i % 97 == 5 {
                            f32::NEG_INFINITY
                        } else {
                            (rng.random::<f32>() * 6.0 - 3.0) * if i < 40 { 2.0 } else { 1.0 }
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// With the same uniform, the device draw picks the host sampler's token (the block sums
    /// are f32 on the device, so a uniform within rounding of a boundary may differ: allowed
    /// once in 2,000 draws) and the same log-prob to f32 rounding.
    #[test]
    fn device_draw_equals_the_host_sampler() {
        let (b, v) = (5usize, 1300usize);
        let mut differ = 0;
        let mut draws = 0;
        for (seed, temperature) in [(1u64, 1.0), (2, 0.7), (3, 1.6), (4, 0.0)] {
            let p = SamplingParams {
                temperature,
                top_k: 0,
                top_p: 1.0,
            };
            assert!(supported(&p));
            let rows = logits(b, v, seed);
            let t = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
            for round in 0..80 {
                let mut host_rngs: Vec<ChaCha8Rng> = (0..b)
                    .map(|r| ChaCha8Rng::seed_from_u64(seed * 1000 + round * 10 + r as u64))
                    .collect();
                let mut dev_rngs = host_rngs.clone();
                let u: Vec<f64> = dev_rngs
                    .iter_mut()
                    .map(|g| {
                        if p.is_greedy() {
                            0.0
                        } else {
                            g.random::<f64>()
                        }
                    })
                    .collect();
                let got = sample_rows(&t, &p, &u).unwrap();
                for r in 0..b {
                    let want = sample_token(&rows[r], &p, &mut host_rngs[r]).unwrap();
                    let Draw::Token(s) = &got[r] else {
                        panic!("row {r} handed back to the host")
                    };
                    draws += 1;
                    if s.id != want.id {
                        differ += 1;
                        continue;
                    }
                    assert!((s.logprob - want.logprob).abs() < 1e-4, "{s:?} vs {want:?}");
                }
            }
        }
        assert!(differ * 2000 <= draws, "{differ} of {draws} draws differ");
    }

    /// Rows the host must judge (NaN, +inf, everything masked) are handed back.
    #[test]
    fn bad_rows_go_to_the_host() {
        let mut rows = logits(3, 600, 9);
        rows[0][7] = f32::NAN;
        rows[1][3] = f32::INFINITY;
        rows[2] = vec![f32::NEG_INFINITY; 600];
        let t = Tensor::new(rows, &Device::Cpu).unwrap();
        for temperature in [0.0, 1.0] {
            let p = SamplingParams {
                temperature,
                ..Default::default()
            };
            let got = sample_rows(&t, &p, &[0.5, 0.5, 0.5]).unwrap();
            assert!(got.iter().all(|d| matches!(d, Draw::Host)));
        }
    }

    /// Greedy takes the lowest id among tied maxima, as the host sampler documents.
    #[test]
    fn greedy_ties_take_the_lowest_id() {
        let mut row = vec![0f32; 1100];
        row[900] = 5.0;
        row[600] = 5.0;
        let t = Tensor::new(vec![row], &Device::Cpu).unwrap();
        let p = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let Draw::Token(s) = &sample_rows(&t, &p, &[0.0]).unwrap()[0] else {
            panic!("handed back")
        };
        assert_eq!(s.id, 600);
    }
}
