//! The cuDNN path of [`Attention`] at inference (CUDA builds): q, k and v stay in the
//! projections' `[B, T, H, D]` layout (RoPE applied there, `rope_thd`), cuDNN's fused SDPA reads
//! them through strides with grouped-query heads unrepeated and builds the causal mask and the
//! window itself, and its `[B, T, Hq, D]` result goes straight into `o_proj`: no transposes, no
//! repeated K/V, no `[B, H, T, S]` scores and no mask tensor.

use super::attn_rows::{attention_bucket, bucketed, pad_rows};
use super::device_ops;
use super::layers::{Attention, AttnBackend, AttnInputs, Ops};
use candle_core::{DType, Device, Result, Tensor, D};
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use xdistill_cudnn::{Causal, Params};

/// cuDNN's version once loaded, or why not; logged once per process.
fn cudnn() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| match xdistill_cudnn::load() {
        Ok(v) => {
            tracing::info!("attention: cuDNN {v} (fused SDPA)");
            true
        }
        Err(why) => {
            tracing::warn!("attention: cuDNN unavailable ({why}); using the eager attention");
            false
        }
    })
}

/// The shapes cuDNN refused in this process (inference and training), each a description of
/// its dims, dtype and mask.
fn refusals() -> &'static Mutex<HashSet<String>> {
    static REFUSED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    REFUSED.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Whether cuDNN refused the shape `key` before.
pub(super) fn refused(key: &str) -> bool {
    refusals().lock().is_ok_and(|set| set.contains(key))
}

/// Remembers that cuDNN refused the shape `key` (and why, in one warning): it takes `fallback`
/// from then on.
pub(super) fn refuse(key: String, why: &dyn std::fmt::Display, fallback: &str) {
    tracing::warn!("cuDNN refused {key} ({why}); {fallback} runs it");
    if let Ok(mut set) = refusals().lock() {
        set.insert(key);
    }
}

/// The shapes cuDNN has refused in this process, sorted: each runs on the eager or blockwise
/// attention instead. Empty where every shape ran through cuDNN (the GPU tests that compare it
/// with another path check this, so that a refusal cannot pass for agreement).
pub fn refused_shapes() -> Vec<String> {
    let mut v: Vec<String> = refusals()
        .lock()
        .map(|set| set.iter().cloned().collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// cuDNN's attention of `q` [B, T, Hq, D]-strided views, `k`, `v` as [`xdistill_cudnn::sdpa`]
/// takes them (`[B, Sq, Hq, D]`), or `None` where cuDNN refuses the shape (its graph does not
/// build or run): that shape (dims, dtype, mask) is remembered and takes the eager attention
/// from then on, with one warning, so a request is never failed for a shape cuDNN does not
/// support. Causal attention whose queries are not a whole number of buckets runs over
/// zero-padded copies of q, k and v ([`super::attn_rows`]: one graph per bucket, not per
/// length), its output cut back to the real rows: the same rows appended to the queries and
/// the keys, so that a chunk over a KV cache (bottom-right: query `i` sees keys up to
/// `Skv − Sq + i`) keeps its alignment and no real query reaches a padded key.
pub(super) fn sdpa_or_eager(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: Params,
) -> Result<Option<Tensor>> {
    let (sq, skv) = (q.dim(2)?, k.dim(2)?);
    let extra = bucketed(sq, attention_bucket()) - sq;
    let aligned = match params.causal {
        Causal::TopLeft => sq == skv,
        Causal::BottomRight => sq <= skv,
        Causal::None => false,
    };
    if extra > 0 && aligned {
        // Padded in the projections' layout [B, S, H, D] (the graph's strides then depend on
        // the padded lengths only), read as [B, H, S, D].
        let pad = |t: &Tensor, rows: usize| {
            pad_rows(&t.transpose(1, 2)?, 1, t.dim(2)? + rows)?.transpose(1, 2)
        };
        return sdpa_exact(&pad(q, extra)?, &pad(k, extra)?, &pad(v, extra)?, params)?
            .map(|out| out.narrow(1, 0, sq))
            .transpose();
    }
    sdpa_exact(q, k, v, params)
}

/// [`sdpa_or_eager`] for the shapes as given.
fn sdpa_exact(q: &Tensor, k: &Tensor, v: &Tensor, params: Params) -> Result<Option<Tensor>> {
    let key = format!(
        "attention q {:?} k {:?} {:?} {:?} window {:?}",
        q.dims(),
        k.dims(),
        q.dtype(),
        params.causal,
        params.window
    );
    if refused(&key) {
        return Ok(None);
    }
    match xdistill_cudnn::sdpa(q, k, v, params) {
        Ok(out) => Ok(Some(out)),
        Err(e) => {
            refuse(key, &e, "the eager attention");
            Ok(None)
        }
    }
}

/// Whether cuDNN's attention can run on `device` in `dtype`: a CUDA device, bf16 or f16, and
/// cuDNN loaded.
pub(super) fn cudnn_ready(device: &Device, dtype: DType) -> bool {
    device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && cudnn()
}

impl Attention {
    /// The cuDNN path applies: inference, the backend chosen, a plain causal mask, more than
    /// one new position (a decoding step's one query stays eager: a cuDNN graph per cache
    /// length would cost more than it saves), full rotary, a head size cuDNN takes.
    pub(super) fn cudnn_applies(&self, x: &Tensor, inp: &AttnInputs<'_>) -> Result<bool> {
        Ok(inp.ops == Ops::Fused
            && inp.backend == AttnBackend::Cudnn
            && inp.plain
            && x.dim(1)? > 1
            && inp.cos.dim(D::Minus1)? * 2 == self.head_dim
            && self.head_dim.is_multiple_of(8)
            && self.head_dim <= 256
            && cudnn_ready(x.device(), x.dtype()))
    }

    /// `x` [B, T, H] → q [B, T, Hq, D], k and v [B, T, Hkv, D]: projected, normed and rotated
    /// in the projections' layout (the fused RoPE where it runs, else candle's `rope_thd`:
    /// full rotary only, as [`Attention::cudnn_applies`] asks).
    pub(super) fn project_rotated(
        &self,
        x: &Tensor,
        inp: &AttnInputs<'_>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = self.project_heads(x, inp)?;
        let (q, k) = if device_ops::applies(&q) && inp.cos.dtype() == q.dtype() {
            (
                device_ops::rope(&q, inp.cos, inp.sin, false)?,
                device_ops::rope(&k, inp.cos, inp.sin, false)?,
            )
        } else {
            (
                candle_nn::rotary_emb::rope_thd(&q.contiguous()?, inp.cos, inp.sin)?,
                candle_nn::rotary_emb::rope_thd(&k.contiguous()?, inp.cos, inp.sin)?,
            )
        };
        Ok((q, k, v))
    }

    /// `x` [B, T, H] → [B, T, H] through cuDNN; `kv` as in [`Attention::forward`] (the cache
    /// keeps its `[B, Hkv, S, D]` layout). `None` where cuDNN refuses the shape
    /// ([`sdpa_or_eager`]): the cache is then untouched and the caller runs the eager attention.
    pub(super) fn forward_cudnn(
        &self,
        x: &Tensor,
        inp: &AttnInputs<'_>,
        kv: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Option<Tensor>> {
        let (b, t, _) = x.dims3()?;
        let (q, k, v) = self.project_rotated(x, inp)?; // [B, T, H, D]
                                                       // [B, Hkv, S, D]: views of the new positions, or the cache with them appended (stored
                                                       // once cuDNN has run).
        let (k, v) = match &kv {
            Some(slot) => {
                let (k, v) = (
                    k.transpose(1, 2)?.contiguous()?,
                    v.transpose(1, 2)?.contiguous()?,
                );
                match slot.as_ref() {
                    Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
                    None => (k, v),
                }
            }
            None => (k.transpose(1, 2)?, v.transpose(1, 2)?),
        };
        let causal = if k.dim(2)? == t {
            Causal::TopLeft
        } else {
            Causal::BottomRight
        };
        let params = Params {
            scale: self.scale as f32,
            causal,
            window: self.window,
        };
        let Some(out) = sdpa_or_eager(&q.transpose(1, 2)?, &k, &v, params)? else {
            return Ok(None);
        }; // [B, T, Hq, D]
        if let Some(slot) = kv {
            *slot = Some((k.detach(), v.detach()));
        }
        let out = self
            .o
            .forward(&out.reshape((b, t, self.n_heads * self.head_dim))?, inp.ops)?;
        Ok(Some(out))
    }
}
