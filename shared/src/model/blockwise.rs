//! Blockwise attention for training, memory linear in the sequence: queries in blocks, each
//! block's softmax over only the keys it can see, and a hand-written backward that recomputes
//! each block's probabilities instead of keeping them. The CPU's training attention, and on a
//! GPU the reference and the fallback where cuDNN's fused attention does not apply
//! ([`super::train_attention`]).
//!
//! Plain autograd attention keeps `[B, H, T, T]` scores (several copies) until the backward
//! runs. Here at most one block's `[B, H, bq, kn]` exists at a time, `kn ≤ T` the keys the
//! block's queries can see (causal: up to the block's last query; sliding window: from the
//! first query's window start), so key blocks that are wholly masked are never touched. The
//! softmax of a block is the exact row softmax over its visible keys (every query sees itself),
//! so no online rescaling is needed.
//!
//! This is not FlashAttention: a block's scores and probabilities are whole tensors in device
//! memory (about 14 tensor ops per block forward and 30 backward), not tiles kept in on-chip
//! memory by one fused kernel. Only the backward's equations are FlashAttention's, per query
//! block, from the recomputed probabilities `P`: `dV += Pᵀ·dO`, `dP = dO·Vᵀ`,
//! `dS = P ∘ (dP − rowsum(P ∘ dP))`, `dQ = s·dS·K`, `dK += s·dSᵀ·Q`. All of it is candle tensor
//! code, so CPU and CUDA run the same thing.

use super::layers::{accum_dtype, repeat_kv};
use candle_core::{DType, Device, Result, Tensor, D};

/// Bytes of f32 scores one block may hold (`[B, Hq, bq, S]`): small enough that a few copies of
/// it are negligible beside the activations, big enough that a block's matmuls stay efficient.
const BLOCK_BUDGET: usize = 32 << 20;

thread_local! {
    /// Queries per block on this thread when nonzero (tests: several blocks on tiny models).
    static BLOCK_OVERRIDE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Makes training attention on this thread use `n` queries per block (0: the budget's choice),
/// so that tests on tiny models cross block boundaries.
#[doc(hidden)]
pub fn override_block(n: usize) {
    BLOCK_OVERRIDE.with(|o| o.set(n));
}

/// Which keys each query sees: causal, and with `window` only the last `window` positions
/// (counting its own), as transformers' sliding-window mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Causal {
    pub window: Option<usize>,
    /// Queries per block.
    pub block: usize,
}

impl Causal {
    /// The block size for `b` rows of `heads` heads over `t` positions under [`BLOCK_BUDGET`]
    /// (a multiple of 16, at least 16, at most `t`).
    pub fn for_shape(b: usize, heads: usize, t: usize, window: Option<usize>) -> Causal {
        let per_query = (b * heads * t * 4).max(1);
        let block = match BLOCK_OVERRIDE.with(|o| o.get()) {
            0 => (BLOCK_BUDGET / per_query / 16 * 16).max(16),
            n => n,
        };
        Causal {
            window,
            block: block.min(t.max(1)),
        }
    }

    /// The keys `[start, end)` that queries `q0..q1` see between them.
    fn keys(&self, q0: usize, q1: usize) -> (usize, usize) {
        let start = self.window.map_or(0, |w| (q0 + 1).saturating_sub(w));
        (start, q1)
    }

    /// Additive bias `[1, 1, q1-q0, k1-k0]`: 0 where query `i` sees key `j`, −∞ elsewhere.
    fn bias(
        &self,
        q: (usize, usize),
        k: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let visible = visible(q, k, self.window, device)?;
        let zero = Tensor::zeros(visible.shape(), dtype, device)?;
        let ninf = Tensor::full(f32::NEG_INFINITY, visible.shape(), device)?.to_dtype(dtype)?;
        visible.where_cond(&zero, &ninf)?.unsqueeze(0)?.unsqueeze(0)
    }
}

/// `[q1-q0, k1-k0]` u8: 1 where query position `i` may see key position `j` (`j ≤ i`, and with a
/// window `w`, `i − j < w` as transformers' `kv_idx > q_idx - w`). Built on `device` from
/// position ranges: no host round trip.
pub(crate) fn visible(
    (q0, q1): (usize, usize),
    (k0, k1): (usize, usize),
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    // Positions as f32 are exact up to 2^24, far beyond any context.
    let qi = Tensor::arange(q0 as f32, q1 as f32, device)?.unsqueeze(1)?; // [bq, 1]
    let kj = Tensor::arange(k0 as f32, k1 as f32, device)?.unsqueeze(0)?; // [1, kn]
    let visible = kj.broadcast_le(&qi)?;
    match window {
        // q − j < w  ⇔  j > q − w
        Some(w) => visible * kj.broadcast_gt(&(qi - w as f64)?)?,
        None => Ok(visible),
    }
}

/// Softmax probabilities `[B, H, bq, kn]` (accumulation dtype) of queries `q` `[B, H, bq, D]`
/// over keys `k` `[B, H, kn, D]` with the additive `bias`, computed as [`super::layers`]'
/// plain attention computes them (scores in the compute dtype, softmax in f32 or f64).
fn probs(q: &Tensor, k: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let acc = accum_dtype(q.dtype());
    let s = (q.matmul(&k.t()?)? * scale)?.to_dtype(acc)?;
    candle_nn::ops::softmax_last_dim(&s.broadcast_add(bias)?)
}

/// The inverse of [`repeat_kv`] for gradients: sums each group of `rep` heads.
fn fold_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    x.reshape((b, h / rep, rep, s, d))?.sum(2)
}

/// Causal attention of `q` `[B, Hq, T, D]` over `k`, `v` `[B, Hkv, T, D]` (grouped-query when
/// `Hkv < Hq`): `[B, Hq, T, D]`, without gradient graph (inputs are used detached).
pub(crate) fn forward(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, c: Causal) -> Result<Tensor> {
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let t = q.dim(2)?;
    let rep = q.dim(1)? / k.dim(1)?.max(1);
    let (k, v) = (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?);
    let acc = accum_dtype(q.dtype());
    let mut out = Vec::with_capacity(t.div_ceil(c.block.max(1)));
    for q0 in (0..t).step_by(c.block.max(1)) {
        let q1 = (q0 + c.block).min(t);
        let (k0, k1) = c.keys(q0, q1);
        let bias = c.bias((q0, q1), (k0, k1), acc, q.device())?;
        let qb = q.narrow(2, q0, q1 - q0)?.contiguous()?;
        let kb = k.narrow(2, k0, k1 - k0)?.contiguous()?;
        let vb = v.narrow(2, k0, k1 - k0)?.contiguous()?;
        let p = probs(&qb, &kb, &bias, scale)?.to_dtype(vb.dtype())?;
        out.push(p.matmul(&vb)?);
    }
    Tensor::cat(&out, 2)
}

/// Gradients `(dq, dk, dv)` of [`forward`] at `q`, `k`, `v` given the output's gradient `dout`
/// `[B, Hq, T, D]`, each block's probabilities recomputed. Shapes and dtypes as the inputs.
pub(crate) fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dout: &Tensor,
    scale: f64,
    c: Causal,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (q, k, v, dout) = (q.detach(), k.detach(), v.detach(), dout.detach());
    let dt = q.dtype();
    let acc = accum_dtype(dt);
    let t = q.dim(2)?;
    let rep = q.dim(1)? / k.dim(1)?.max(1);
    let (kr, vr) = (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?);
    // dK, dV accumulate over query blocks in the accumulation dtype.
    let dk = Tensor::zeros(kr.shape(), acc, q.device())?;
    let dv = Tensor::zeros(vr.shape(), acc, q.device())?;
    let mut dq = Vec::with_capacity(t.div_ceil(c.block.max(1)));
    for q0 in (0..t).step_by(c.block.max(1)) {
        let q1 = (q0 + c.block).min(t);
        let (k0, k1) = c.keys(q0, q1);
        let kn = k1 - k0;
        let bias = c.bias((q0, q1), (k0, k1), acc, q.device())?;
        let qb = q.narrow(2, q0, q1 - q0)?.contiguous()?;
        let dob = dout.narrow(2, q0, q1 - q0)?.contiguous()?;
        let kb = kr.narrow(2, k0, kn)?.contiguous()?;
        let vb = vr.narrow(2, k0, kn)?.contiguous()?;
        // 1. P [B, H, bq, kn] recomputed; dV += Pᵀ·dO.
        let p = probs(&qb, &kb, &bias, scale)?;
        let p_dt = p.to_dtype(dt)?;
        add_at(&dv, &p_dt.t()?.matmul(&dob)?.to_dtype(acc)?, k0)?;
        // 2. dS = P ∘ (dP − rowsum(P ∘ dP)), with dP = dO·Vᵀ.
        let dp = dob.matmul(&vb.t()?)?.to_dtype(acc)?;
        let row = (&p * &dp)?.sum_keepdim(D::Minus1)?;
        let ds = (p * dp.broadcast_sub(&row)?)?;
        // 3. Through the scaled scores (in the compute dtype, as the plain path's cast back).
        let ds = (ds.to_dtype(dt)? * scale)?;
        dq.push(ds.matmul(&kb)?);
        add_at(&dk, &ds.t()?.matmul(&qb)?.to_dtype(acc)?, k0)?;
    }
    let dq = Tensor::cat(&dq, 2)?;
    let dk = fold_kv(&dk, rep)?.to_dtype(dt)?;
    let dv = fold_kv(&dv, rep)?.to_dtype(dt)?;
    Ok((dq, dk, dv))
}

/// `acc[:, :, at..at+n] += x` in place (`x` `[B, H, n, D]`).
fn add_at(acc: &Tensor, x: &Tensor, at: usize) -> Result<()> {
    let n = x.dim(2)?;
    let sum = (acc.narrow(2, at, n)? + x)?.contiguous()?;
    acc.slice_set(&sum, 2, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::lcg_noise;
    use candle_core::Var;

    fn rand(dims: (usize, usize, usize, usize), seed: u64, dt: DType) -> Tensor {
        let n = dims.0 * dims.1 * dims.2 * dims.3;
        let v: Vec<f64> = lcg_noise(seed, n, 1.0).into_iter().map(f64::from).collect();
        Tensor::from_vec(v, dims, &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    }

    /// The reference: all scores at once with the dense mask, through candle's autograd.
    fn dense(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, window: Option<usize>) -> Tensor {
        let t = q.dim(2).unwrap();
        let rep = q.dim(1).unwrap() / k.dim(1).unwrap();
        let c = Causal { window, block: t };
        let bias = c
            .bias((0, t), (0, t), accum_dtype(q.dtype()), q.device())
            .unwrap();
        let (k, v) = (repeat_kv(k, rep).unwrap(), repeat_kv(v, rep).unwrap());
        let acc = accum_dtype(q.dtype());
        let s = (q.matmul(&k.t().unwrap()).unwrap() * scale)
            .unwrap()
            .to_dtype(acc)
            .unwrap();
        let p = candle_nn::ops::softmax(&s.broadcast_add(&bias).unwrap(), D::Minus1).unwrap();
        p.to_dtype(v.dtype()).unwrap().matmul(&v).unwrap()
    }

    use xdistill_testkit::reference::f64s as flat;

    fn worst(a: &Tensor, b: &Tensor) -> f64 {
        flat(a)
            .iter()
            .zip(flat(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// Forward and all three gradients equal candle's autograd of the dense attention, in f64
    /// to 1e-12 and in f32 to 2e-6, for GQA, sliding windows and uneven blocks.
    #[test]
    fn blocks_equal_dense_attention_and_its_autograd() {
        let (b, hq, hkv, t, d) = (2usize, 4usize, 2usize, 19usize, 8usize);
        for (dt, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-6)] {
            for window in [None, Some(5), Some(1)] {
                for block in [1usize, 4, 7, 19, 32] {
                    let q = Var::from_tensor(&rand((b, hq, t, d), 1, dt)).unwrap();
                    let k = Var::from_tensor(&rand((b, hkv, t, d), 2, dt)).unwrap();
                    let v = Var::from_tensor(&rand((b, hkv, t, d), 3, dt)).unwrap();
                    let g = rand((b, hq, t, d), 4, dt);
                    let reference = dense(&q, &k, &v, 0.4, window);
                    let grads = (&reference * &g)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let c = Causal { window, block };
                    let out = forward(&q, &k, &v, 0.4, c).unwrap();
                    let case = format!("{dt:?} window {window:?} block {block}");
                    assert!(worst(&out, &reference) < tol, "forward, {case}");
                    let (dq, dk, dv) = backward(&q, &k, &v, &g, 0.4, c).unwrap();
                    for (name, got, var) in [("dq", &dq, &q), ("dk", &dk, &k), ("dv", &dv, &v)] {
                        let want = grads.get(var.as_tensor()).unwrap();
                        assert_eq!(got.dims(), want.dims());
                        assert!(
                            worst(got, want) < tol,
                            "{name}, {case}: {}",
                            worst(got, want)
                        );
                    }
                }
            }
        }
    }

    /// The gradients against central finite differences of the forward, in f64: an independent
    /// check of the hand-written backward (not of autograd).
    #[test]
    fn backward_matches_finite_differences() {
        let (b, hq, hkv, t, d) = (1usize, 2usize, 1usize, 6usize, 3usize);
        let c = Causal {
            window: Some(4),
            block: 4,
        };
        let q = rand((b, hq, t, d), 11, DType::F64);
        let k = rand((b, hkv, t, d), 12, DType::F64);
        let v = rand((b, hkv, t, d), 13, DType::F64);
        let g = rand((b, hq, t, d), 14, DType::F64);
        let objective = |q: &Tensor, k: &Tensor, v: &Tensor| -> f64 {
            let o = forward(q, k, v, 0.7, c).unwrap();
            (o * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let (dq, dk, dv) = backward(&q, &k, &v, &g, 0.7, c).unwrap();
        let h = 1e-6;
        for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
            let analytic = flat(grad);
            let base = [flat(&q), flat(&k), flat(&v)];
            for i in 0..analytic.len() {
                let bump = |delta: f64| {
                    let mut xs = base.clone();
                    xs[which][i] += delta;
                    let mk = |x: &Vec<f64>, like: &Tensor| {
                        Tensor::from_vec(x.clone(), like.shape(), &Device::Cpu).unwrap()
                    };
                    objective(&mk(&xs[0], &q), &mk(&xs[1], &k), &mk(&xs[2], &v))
                };
                let numeric = (bump(h) - bump(-h)) / (2.0 * h);
                assert!(
                    (numeric - analytic[i]).abs() < 1e-7,
                    "input {which} element {i}: {numeric} vs {}",
                    analytic[i]
                );
            }
        }
    }

    /// Block sizes under the budget: linear in nothing but the budget, 16-aligned, never past T.
    #[test]
    fn block_size_follows_the_budget() {
        assert_eq!(Causal::for_shape(1, 16, 4096, None).block, 128);
        assert_eq!(Causal::for_shape(1, 16, 8192, None).block, 64);
        assert_eq!(Causal::for_shape(4, 32, 32768, None).block, 16);
        assert_eq!(Causal::for_shape(1, 2, 10, None).block, 10);
    }
}
