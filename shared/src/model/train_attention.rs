//! The attention core of a training pass, `softmax(scale · q kᵀ + causal/window mask) · v`, and
//! its backward, both by hand (the pass keeps neither scores nor probabilities; see
//! [`super::train`]). Two kernels behind one seam:
//! - cuDNN's fused SDPA ([`xdistill_cudnn::sdpa_train`] and [`xdistill_cudnn::sdpa_backward`]:
//!   the softmax statistics kept, deterministic backward, grouped-query heads read unrepeated)
//!   where the decoder's [`AttnBackend`] is cuDNN and it applies: a CUDA build on a CUDA device,
//!   bf16 or f16, cuDNN loaded, a head size it takes, and both of the shape's graphs built (a
//!   shape cuDNN refuses in either direction, e.g. a backward with heads of 256 before Hopper,
//!   takes the blockwise kernel from then on, with one warning);
//! - the blockwise attention ([`super::blockwise`]) everywhere else: every device and dtype, and
//!   the reference the fused one is tested against.
//!
//! `q` is `[B, Hq, T, D]`, `k` and `v` `[B, Hkv, T, D]` (grouped-query when `Hkv < Hq`), the
//! output `[B, Hq, T, D]`; queries and keys are the same positions (causal, top-left).

#[cfg(feature = "cuda")]
use super::attn_rows::{attention_bucket, bucketed, pad_rows};
use super::blockwise::{self, Causal};
use super::layers::AttnBackend;
use candle_core::{DType, Device, Result, Tensor};

/// `x` `[B, H, T, D]` with zero positions appended up to `to` (`x` itself when it has them).
#[cfg(feature = "cuda")]
fn pad(x: &Tensor, to: usize) -> Result<Tensor> {
    if x.dim(2)? == to {
        return Ok(x.clone());
    }
    pad_rows(x, 2, to)
}

/// What a core's backward needs besides q, k, v and the output.
pub(crate) enum Saved {
    /// The blockwise kernel's blocks (it recomputes everything else).
    Blockwise(Causal),
    /// cuDNN's softmax statistics, f32 `[B, Hq, T', 1]`, and the call's parameters; where T
    /// is not a whole number of buckets ([`super::attn_rows`]) the call ran over T' padded
    /// positions, and `padded` keeps its whole output `[B, T', Hq, D]` (the backward reads
    /// the padded rows' outputs too).
    #[cfg(feature = "cuda")]
    Cudnn {
        stats: Tensor,
        params: xdistill_cudnn::Params,
        padded: Option<Tensor>,
    },
}

/// Whether the fused kernel runs training attention with `backend` on `device` in `dtype` with
/// heads of `head_dim`: cuDNN chosen, a CUDA device, bf16 or f16, cuDNN loaded, a head size it
/// takes (a multiple of 8, at most 256).
pub(crate) fn fused(backend: AttnBackend, device: &Device, dtype: DType, head_dim: usize) -> bool {
    #[cfg(feature = "cuda")]
    {
        backend == AttnBackend::Cudnn
            && head_dim.is_multiple_of(8)
            && head_dim <= 256
            && super::attn_cudnn::cudnn_ready(device, dtype)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (backend, device, dtype, head_dim);
        false
    }
}

/// What one layer's attention core computes besides q, k and v.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Core {
    pub backend: AttnBackend,
    /// Multiplies q·k.
    pub scale: f64,
    /// Keys further back than this many positions (counting the query's own) are masked.
    pub window: Option<usize>,
}

/// The attention of `q` over `k`, `v`, untracked: `[B, Hq, T, D]` and what [`backward`] needs.
pub(crate) fn forward(q: &Tensor, k: &Tensor, v: &Tensor, core: Core) -> Result<(Tensor, Saved)> {
    let Core {
        backend,
        scale,
        window,
    } = core;
    #[cfg(feature = "cuda")]
    if fused(backend, q.device(), q.dtype(), q.dim(3)?) {
        let params = xdistill_cudnn::Params {
            scale: scale as f32,
            causal: xdistill_cudnn::Causal::TopLeft,
            window,
        };
        let t = q.dim(2)?;
        let to = bucketed(t, attention_bucket());
        let (qp, kp, vp) = (pad(q, to)?, pad(k, to)?, pad(v, to)?);
        if cudnn_trains((&qp, &kp, &vp), params) {
            let (out, stats) = xdistill_cudnn::sdpa_train(&qp, &kp, &vp, params)?; // [B, T', Hq, D]
            let (o, padded) = match to == t {
                true => (out, None),
                false => (out.narrow(1, 0, t)?, Some(out)),
            };
            let saved = Saved::Cudnn {
                stats,
                params,
                padded,
            };
            return Ok((o.transpose(1, 2)?, saved));
        }
    }
    let _ = backend;
    let (b, h, t, _) = q.dims4()?;
    let c = Causal::for_shape(b, h, t, window);
    Ok((blockwise::forward(q, k, v, scale, c)?, Saved::Blockwise(c)))
}

/// Whether cuDNN builds both training graphs of this shape (dims, dtype, window); a shape it
/// refuses is remembered and takes the blockwise kernel from then on, with one warning, so that a
/// step never fails on a case cuDNN's heuristics do not cover.
#[cfg(feature = "cuda")]
fn cudnn_trains((q, k, v): (&Tensor, &Tensor, &Tensor), params: xdistill_cudnn::Params) -> bool {
    use super::attn_cudnn::{refuse, refused};
    let key = format!(
        "training attention q {:?} k {:?} {:?} window {:?}",
        q.dims(),
        k.dims(),
        q.dtype(),
        params.window
    );
    if refused(&key) {
        return false;
    }
    match xdistill_cudnn::prepare_train(q, k, v, params) {
        Ok(()) => true,
        Err(e) => {
            refuse(key, &e, "the blockwise kernel");
            false
        }
    }
}

/// Gradients `(dq, dk, dv)` at `q`, `k`, `v` (their shapes and dtype) of [`forward`], given its
/// output `out` `[B, Hq, T, D]` (any layout) and the gradient `dout` arriving there.
pub(crate) fn backward(
    saved: &Saved,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    dout: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    match saved {
        Saved::Blockwise(c) => {
            let _ = out;
            blockwise::backward(q, k, v, dout, scale, *c)
        }
        #[cfg(feature = "cuda")]
        Saved::Cudnn {
            stats,
            params,
            padded,
        } => {
            let _ = scale;
            let Some(o) = padded else {
                return xdistill_cudnn::sdpa_backward(
                    (q, k, v),
                    &out.transpose(1, 2)?,
                    stats,
                    &dout.transpose(1, 2)?,
                    *params,
                );
            };
            // The padded call's backward: zero gradient at the padded outputs, so the padded
            // rows give the real ones nothing (`attn_rows.rs`); the real rows' gradients cut
            // back out.
            let (t, to) = (q.dim(2)?, o.dim(1)?);
            let d_o = pad_rows(&dout.transpose(1, 2)?, 1, to)?; // [B, T', Hq, D]
            let (dq, dk, dv) = xdistill_cudnn::sdpa_backward(
                (&pad(q, to)?, &pad(k, to)?, &pad(v, to)?),
                o,
                stats,
                &d_o,
                *params,
            )?;
            let cut = |g: Tensor| g.narrow(2, 0, t)?.contiguous();
            Ok((cut(dq)?, cut(dk)?, cut(dv)?))
        }
    }
}
