//! The rows a fused attention call is built for: a sequence's length rounded up to a bucket.
//!
//! cuDNN builds one graph per shape (dims, strides, mask), 44–58 ms each the first time on an
//! H200 (2026-11-29, `shared/tests/cudnn_attention.rs`), and the shim keeps at most 1,024 of
//! them. A teacher serving text of every length, or a trainer padding each micro-batch to its
//! longest row, meets a new length at almost every batch: thousands of shapes, each paid once,
//! and past the cache's size paid again and again. A fixed-length benchmark never shows it.
//! So causal self-attention (queries and keys the same positions, top-left) runs over its rows
//! followed by zero rows up to a multiple of [`attention_bucket`] (32 by default): a real query
//! `i` sees keys `j ≤ i` only, so the rows after the sequence change none of its outputs (their
//! scores are masked; masked probabilities are exactly 0, and the zero rows' values are finite),
//! and a graph serves every length of its bucket: at most 256 shapes up to 8,192 positions. A
//! chunk over a KV cache (bottom-right: query `i` of `Sq` sees keys up to `Skv − Sq + i`) gets
//! the same zero rows appended to its queries and its keys, which keeps that alignment.
//!
//! The cost: the attention's work over up to 31 more rows, and a copy of q, k and v into the
//! padded buffers where the caller's rows do not already end on a bucket (the packed forward
//! lays its sequences out on bucket boundaries instead: `packed.rs`). A sequence's bucket
//! depends only on its own length, so batch invariance is kept.

use candle_core::{Result, Tensor};

/// Rows per bucket by default.
pub const ATTENTION_BUCKET: usize = 32;

/// `XDISTILL_ATTENTION_BUCKET`: rows per bucket of the fused attention's shapes (1: every
/// length its own graph, as before 2026-11-30), read once per process; [`ATTENTION_BUCKET`]
/// when unset or not a positive number (with one warning).
pub fn attention_bucket() -> usize {
    static CHOSEN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let value = std::env::var("XDISTILL_ATTENTION_BUCKET").ok();
        parse_bucket(value.as_deref()).unwrap_or_else(|why| {
            tracing::warn!("XDISTILL_ATTENTION_BUCKET: {why}; using {ATTENTION_BUCKET}");
            ATTENTION_BUCKET
        })
    })
}

/// The bucket a value of `XDISTILL_ATTENTION_BUCKET` names (unset: [`ATTENTION_BUCKET`]).
pub fn parse_bucket(value: Option<&str>) -> std::result::Result<usize, String> {
    match value.map(str::trim) {
        None => Ok(ATTENTION_BUCKET),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=4096).contains(&n) => Ok(n),
            _ => Err(format!("{v:?} is not a number of rows from 1 to 4096")),
        },
    }
}

/// `n` rounded up to a multiple of `bucket` (at least one bucket).
pub fn bucketed(n: usize, bucket: usize) -> usize {
    let b = bucket.max(1);
    n.max(1).div_ceil(b) * b
}

/// `x` with zero rows appended along `dim` up to `to` rows, contiguous; `x` itself (made
/// contiguous) when it has `to` rows already.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn pad_rows(x: &Tensor, dim: usize, to: usize) -> Result<Tensor> {
    let n = x.dim(dim)?;
    if n == to {
        return x.contiguous();
    }
    if n > to {
        candle_core::bail!("pad_rows: {n} rows along dim {dim} do not fit {to}");
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = to - n;
    let zeros = Tensor::zeros(dims, x.dtype(), x.device())?;
    // Contiguous parts, so that the result is contiguous too (candle concatenates strided
    // parts along a transposed layout).
    Tensor::cat(&[&x.contiguous()?, &zeros], dim)
}

#[cfg(test)]
mod tests {
    use super::super::blockwise::{self, Causal};
    use super::super::test_tensors::{data, values};
    use super::*;
    use candle_core::{DType, Device};

    /// `dims` of noise in [-1, 1) (the crate's LCG), f64.
    fn random(dims: &[usize], seed: u64) -> Tensor {
        data(seed, dims, 2.0)
    }

    /// The largest absolute difference between `a` and `b` (one shape).
    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (values(a), values(b));
        a.iter().zip(&b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
    }

    /// What the bucketing rests on: causal attention over a sequence's rows followed by zero
    /// rows, cut back to its rows, equals the attention over its rows alone, forward and
    /// backward (with a zero gradient at the padded outputs), with and without a window and
    /// grouped-query heads; f64, against the blockwise kernel (the CPU's training attention).
    #[test]
    fn zero_rows_after_a_sequence_change_none_of_its_outputs() {
        for (t, window, hq, hkv) in [(5, None, 2, 2), (37, Some(8), 4, 2), (64, None, 2, 1)] {
            let d = 8;
            let (q, k, v) = (
                random(&[2, hq, t, d], 1),
                random(&[2, hkv, t, d], 2),
                random(&[2, hkv, t, d], 3),
            );
            let g = random(&[2, hq, t, d], 4);
            let scale = 0.35;
            let c = |t| Causal::for_shape(2, hq, t, window);
            let want = blockwise::forward(&q, &k, &v, scale, c(t)).unwrap();
            let want_grads = blockwise::backward(&q, &k, &v, &g, scale, c(t)).unwrap();
            let tb = bucketed(t, 32);
            assert_eq!(tb % 32, 0);
            let pad = |x: &Tensor| pad_rows(x, 2, tb).unwrap();
            let (qp, kp, vp) = (pad(&q), pad(&k), pad(&v));
            assert_eq!(qp.dims(), [2, hq, tb, d]);
            let got = blockwise::forward(&qp, &kp, &vp, scale, c(tb))
                .unwrap()
                .narrow(2, 0, t)
                .unwrap();
            let (dq, dk, dv) = blockwise::backward(&qp, &kp, &vp, &pad(&g), scale, c(tb)).unwrap();
            let what = format!("t {t}, window {window:?}, heads {hq}/{hkv}");
            assert!(max_diff(&got, &want) < 1e-12, "{what}: output");
            for (name, got, want) in [
                ("dq", &dq, &want_grads.0),
                ("dk", &dk, &want_grads.1),
                ("dv", &dv, &want_grads.2),
            ] {
                let got = got.narrow(2, 0, t).unwrap();
                assert!(max_diff(&got, want) < 1e-12, "{what}: {name}");
            }
            // The padded keys get no gradient at all.
            if tb > t {
                let rest = dk.narrow(2, t, tb - t).unwrap();
                assert_eq!(
                    rest.abs()
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap(),
                    0.0
                );
            }
        }
    }

    /// Softmax attention in f64 by loops, one head: `q` `[sq, d]` over `k`, `v` `[skv, d]`,
    /// query `i` seeing keys `j ≤ skv − sq + i` (bottom-right, a KV cache's chunk) within
    /// `window`.
    fn naive(
        q: &[Vec<f64>],
        k: &[Vec<f64>],
        v: &[Vec<f64>],
        window: Option<usize>,
    ) -> Vec<Vec<f64>> {
        let (sq, skv) = (q.len(), k.len());
        (0..sq)
            .map(|i| {
                let last = skv - sq + i;
                let first = window.map_or(0, |w| (last + 1).saturating_sub(w));
                let s: Vec<f64> = (first..=last)
                    .map(|j| q[i].iter().zip(&k[j]).map(|(a, b)| a * b).sum::<f64>() * 0.3)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                (0..q[i].len())
                    .map(|c| (first..=last).zip(&e).map(|(j, p)| p / z * v[j][c]).sum())
                    .collect()
            })
            .collect()
    }

    /// The padding of a chunk over a KV cache: the same zero rows appended to its queries and
    /// to the keys keep the bottom-right alignment, so every real query sees exactly the keys
    /// it saw (and no padded one).
    #[test]
    fn a_cached_chunk_padded_on_both_sides_keeps_its_keys() {
        let rows = |n: usize, seed: u64| -> Vec<Vec<f64>> {
            let t = random(&[n, 4], seed);
            t.to_vec2::<f64>().unwrap()
        };
        for (sq, past, window) in [(5, 11, None), (16, 25, Some(8)), (1, 3, None)] {
            let skv = past + sq;
            let (q, k, v) = (rows(sq, 7), rows(skv, 8), rows(skv, 9));
            let want = naive(&q, &k, &v, window);
            let extra = bucketed(sq, 32) - sq;
            let zero = vec![0.0; 4];
            let pad = |x: &[Vec<f64>]| -> Vec<Vec<f64>> {
                x.iter()
                    .cloned()
                    .chain(std::iter::repeat_n(zero.clone(), extra))
                    .collect()
            };
            let got = naive(&pad(&q), &pad(&k), &pad(&v), window);
            for i in 0..sq {
                for c in 0..4 {
                    assert!(
                        (got[i][c] - want[i][c]).abs() < 1e-12,
                        "sq {sq}, past {past}"
                    );
                }
            }
        }
    }

    #[test]
    fn buckets_and_the_setting() {
        assert_eq!(bucketed(1, 32), 32);
        assert_eq!(bucketed(32, 32), 32);
        assert_eq!(bucketed(33, 32), 64);
        assert_eq!(bucketed(511, 32), 512);
        assert_eq!(bucketed(7, 1), 7);
        assert_eq!(parse_bucket(None), Ok(ATTENTION_BUCKET));
        assert_eq!(parse_bucket(Some("1")), Ok(1));
        assert_eq!(parse_bucket(Some(" 128 ")), Ok(128));
        for bad in ["0", "-3", "x", "100000"] {
            assert!(parse_bucket(Some(bad)).is_err(), "{bad}");
        }
        let x = Tensor::ones((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        let p = pad_rows(&x, 1, 5).unwrap();
        assert_eq!(p.dims(), [2, 5, 4]);
        assert!(p.is_contiguous());
        // A strided view (a KV cache's keys read tokens first) comes back contiguous too.
        let strided = pad_rows(&x.transpose(1, 2).unwrap(), 1, 6).unwrap();
        assert_eq!(strided.dims(), [2, 6, 3]);
        assert!(strided.is_contiguous());
        assert_eq!(p.sum_all().unwrap().to_scalar::<f32>().unwrap(), 24.0);
        assert!(pad_rows(&x, 1, 2).is_err());
    }
}
