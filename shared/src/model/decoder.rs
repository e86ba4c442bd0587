//! Llama / Qwen2 / Qwen3 decoder returning hidden states for **all** positions.
//!
//! Layout follows transformers: `model.embed_tokens`, `model.layers.N.{self_attn,mlp}`,
//! `model.norm`, `lm_head` (or the tied embedding). Padding: right-pad and rely on the causal mask
//! (real tokens never attend to later pads), or pass `key_valid` for left-padded batches.

use super::params::param_specs;
use crate::hf::{Arch, ModelConfig};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};

/// Which kernels to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ops {
    /// candle's fused rms_norm / softmax / rope: fast, but they have no backward pass.
    Fused,
    /// Ops composed of differentiable primitives, so gradients reach every parameter.
    Differentiable,
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, ops: Ops) -> Result<Tensor> {
    match ops {
        Ops::Fused => candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32),
        Ops::Differentiable => {
            // Normalise in f32 (or f64) as transformers does, then scale in the compute dtype.
            let dt = x.dtype();
            let xf = x.to_dtype(accum_dtype(dt))?;
            let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
            let normed = xf.broadcast_mul(&(ms + eps)?.sqrt()?.recip()?)?;
            normed.to_dtype(dt)?.broadcast_mul(w)
        }
    }
}

/// Dtype for reductions: f32, or f64 when computing in f64 (gradient checks).
fn accum_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn softmax_last(x: &Tensor, ops: Ops) -> Result<Tensor> {
    match ops {
        Ops::Fused => candle_nn::ops::softmax_last_dim(x),
        Ops::Differentiable => candle_nn::ops::softmax(x, D::Minus1),
    }
}

/// RoPE (rotate-half form). `x`: [B, H, T, D]; `cos`, `sin`: [T, D/2] or [B, T, D/2].
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
    match ops {
        Ops::Fused => candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin),
        Ops::Differentiable => {
            let cos = Tensor::cat(&[cos, cos], D::Minus1)?;
            let sin = Tensor::cat(&[sin, sin], D::Minus1)?;
            // [T, D] -> [1, 1, T, D]; [B, T, D] -> [B, 1, T, D]
            let (cos, sin) = if cos.rank() == 2 {
                (
                    cos.unsqueeze(0)?.unsqueeze(0)?,
                    sin.unsqueeze(0)?.unsqueeze(0)?,
                )
            } else {
                (cos.unsqueeze(1)?, sin.unsqueeze(1)?)
            };
            let half = x.dim(D::Minus1)? / 2;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
        }
    }
}

/// Inverse frequencies, with Llama 3 frequency scaling when configured.
fn inv_freqs(cfg: &ModelConfig) -> Vec<f64> {
    let d = cfg.head_dim();
    let theta = cfg.rope_theta();
    let mut inv: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d as f64))
        .collect();
    // `validate` has refused every other scaling type and a malformed `rope_parameters`.
    if let Ok(Some(rs)) = cfg.rope_scaling() {
        if rs.rope_type == "llama3" {
            let old = rs.original_max_position_embeddings as f64;
            let low_wl = old / rs.low_freq_factor;
            let high_wl = old / rs.high_freq_factor;
            for f in inv.iter_mut() {
                let wl = 2.0 * std::f64::consts::PI / *f;
                if wl > low_wl {
                    *f /= rs.factor;
                } else if wl >= high_wl {
                    let smooth = (old / wl - rs.low_freq_factor)
                        / (rs.high_freq_factor - rs.low_freq_factor);
                    *f = (1.0 - smooth) * *f / rs.factor + smooth * *f;
                }
            }
        }
    }
    inv
}

/// Key/value cache for incremental decoding: per layer `k`, `v` of shape [B, Hkv, S, D].
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    pub fn new(n_layers: usize) -> Self {
        KvCache {
            layers: vec![None; n_layers],
        }
    }
    /// Number of cached positions.
    pub fn seq_len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map(|(k, _)| k.dim(2).unwrap_or(0))
            .unwrap_or(0)
    }
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3: RMSNorm over head_dim of q and k, before RoPE.
    qk_norm: Option<(Tensor, Tensor)>,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Layer {
    input_norm: Tensor,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

/// The decoder. Cheap to clone (tensors are reference counted).
pub struct Decoder {
    cfg: ModelConfig,
    arch: Arch,
    ops: Ops,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// [V, H]; the embedding itself when tied.
    lm_head: Tensor,
    /// [max_pos, D/2] each.
    cos: Tensor,
    sin: Tensor,
    dtype: DType,
    device: Device,
}

fn linear(
    vb: &VarBuilder,
    name: &str,
    in_dim: usize,
    out_dim: usize,
    bias: bool,
) -> Result<Linear> {
    let w = vb.get((out_dim, in_dim), &format!("{name}.weight"))?;
    let b = if bias {
        Some(vb.get(out_dim, &format!("{name}.bias"))?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

impl Decoder {
    /// Builds the decoder from `vb` (safetensors or a `VarMap`); names as in transformers.
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, ops: Ops) -> Result<Decoder> {
        let arch = cfg.arch().map_err(candle_core::Error::wrap)?;
        cfg.validate().map_err(candle_core::Error::wrap)?;
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.kv_heads(),
            cfg.head_dim(),
        );
        let qkv_bias = arch == Arch::Qwen2 || (arch == Arch::Llama && cfg.attention_bias);
        let o_bias = arch == Arch::Llama && cfg.attention_bias;
        let embed = vb.get((cfg.vocab_size, h), "model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let lv = vb.pp(format!("model.layers.{l}"));
            let av = lv.pp("self_attn");
            let qk_norm = if arch == Arch::Qwen3 {
                Some((av.get(d, "q_norm.weight")?, av.get(d, "k_norm.weight")?))
            } else {
                None
            };
            let attn = Attention {
                q: linear(&av, "q_proj", h, hq * d, qkv_bias)?,
                k: linear(&av, "k_proj", h, hkv * d, qkv_bias)?,
                v: linear(&av, "v_proj", h, hkv * d, qkv_bias)?,
                o: linear(&av, "o_proj", hq * d, h, o_bias)?,
                qk_norm,
                n_heads: hq,
                n_kv: hkv,
                head_dim: d,
            };
            let mv = lv.pp("mlp");
            let mlp = Mlp {
                gate: linear(&mv, "gate_proj", h, cfg.intermediate_size, false)?,
                up: linear(&mv, "up_proj", h, cfg.intermediate_size, false)?,
                down: linear(&mv, "down_proj", cfg.intermediate_size, h, false)?,
            };
            layers.push(Layer {
                input_norm: lv.get(h, "input_layernorm.weight")?,
                attn,
                post_norm: lv.get(h, "post_attention_layernorm.weight")?,
                mlp,
            });
        }
        let norm = vb.get(h, "model.norm.weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            vb.get((cfg.vocab_size, h), "lm_head.weight")?
        };
        let inv = inv_freqs(cfg);
        let max_pos = cfg.max_position_embeddings.max(1);
        let mut cos = Vec::with_capacity(max_pos * inv.len());
        let mut sin = Vec::with_capacity(max_pos * inv.len());
        for p in 0..max_pos {
            for f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let device = vb.device().clone();
        let dtype = vb.dtype();
        let cos = Tensor::from_vec(cos, (max_pos, inv.len()), &device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_pos, inv.len()), &device)?.to_dtype(dtype)?;
        Ok(Decoder {
            cfg: cfg.clone(),
            arch,
            ops,
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            dtype,
            device,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn arch(&self) -> Arch {
        self.arch
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn ops(&self) -> Ops {
        self.ops
    }
    /// Names of all parameters this decoder reads (for checks that every one gets a gradient).
    pub fn param_names(&self) -> Vec<String> {
        param_specs(&self.cfg, 0.0)
            .into_iter()
            .map(|p| p.name)
            .collect()
    }

    /// Hidden states after the final norm. `ids`: [B, T] u32 → [B, T, H].
    ///
    /// - `cache`: when given, the new positions follow the cached ones and are appended to it.
    /// - `positions`: [B, T] u32 RoPE positions per row (left-padded batches); default
    ///   `past..past+T` for every row.
    /// - `key_valid`: [B, past+T] (any dtype, nonzero = real token); keys that are zero are
    ///   masked out (each position may always attend to itself, so pad rows stay finite).
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        mut cache: Option<&mut KvCache>,
        positions: Option<&Tensor>,
        key_valid: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let past = cache.as_ref().map(|c| c.seq_len()).unwrap_or(0);
        if let Some(c) = cache.as_mut() {
            if c.layers.len() != self.layers.len() {
                c.layers = vec![None; self.layers.len()];
            }
        }
        if past + t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {} positions exceeds max_position_embeddings {}",
                past + t,
                self.cfg.max_position_embeddings
            );
        }
        let (cos, sin) = match positions {
            None => (self.cos.narrow(0, past, t)?, self.sin.narrow(0, past, t)?),
            Some(p) => {
                // Gather per-row tables: [B*T] -> [B, T, D/2].
                let flat = p.flatten_all()?;
                let half = self.cos.dim(1)?;
                (
                    self.cos.index_select(&flat, 0)?.reshape((b, t, half))?,
                    self.sin.index_select(&flat, 0)?.reshape((b, t, half))?,
                )
            }
        };
        let mask = self.attention_bias(b, t, past, key_valid)?;
        let mut x = self.embed.index_select(&ids.flatten_all()?, 0)?.reshape((
            b,
            t,
            self.cfg.hidden_size,
        ))?;
        for (li, layer) in self.layers.iter().enumerate() {
            let kv = cache.as_mut().map(|c| &mut c.layers[li]);
            let residual = x.clone();
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps, self.ops)?;
            let h = self.attention(&layer.attn, &h, &cos, &sin, mask.as_ref(), kv)?;
            x = (residual + h)?;
            let residual = x.clone();
            let h = rms_norm(&x, &layer.post_norm, self.cfg.rms_norm_eps, self.ops)?;
            let m = &layer.mlp;
            let h = m
                .down
                .forward(&(m.gate.forward(&h)?.silu()? * m.up.forward(&h)?)?)?;
            x = (residual + h)?;
        }
        rms_norm(&x, &self.norm, self.cfg.rms_norm_eps, self.ops)
    }

    /// Logits of the hidden states: [..., H] → [..., V] (in the model dtype).
    ///
    /// Computed as one rank-2 matmul against the transposed *view* of the head, which the
    /// matmul reads in place (a rank-3 broadcast would copy the whole [H, V] head each call).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let dims = hidden.dims().to_vec();
        let h = *dims.last().unwrap_or(&0);
        let rows = hidden.elem_count() / h.max(1);
        let out = hidden.reshape((rows, h))?.matmul(&self.lm_head.t()?)?;
        let mut shape = dims;
        if let Some(last) = shape.last_mut() {
            *last = self.lm_head.dim(0)?;
        }
        out.reshape(shape)
    }

    /// Convenience: logits for all positions, [B, T] → [B, T, V].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits(&self.forward_hidden(ids, None, None, None)?)
    }

    /// Additive attention bias [B|1, 1, T, past+T] (0 or -inf), or None when nothing is masked.
    fn attention_bias(
        &self,
        b: usize,
        t: usize,
        past: usize,
        key_valid: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let s = past + t;
        let valid: Option<Vec<Vec<f32>>> = match key_valid {
            Some(kv) => Some(kv.to_dtype(DType::F32)?.to_vec2::<f32>()?),
            None => None,
        };
        if t == 1 && valid.is_none() {
            return Ok(None); // one new token attends to everything cached
        }
        let rows = if valid.is_some() { b } else { 1 };
        let mut bias = vec![0f32; rows * t * s];
        for r in 0..rows {
            for i in 0..t {
                for j in 0..s {
                    let causal_ok = j <= past + i;
                    let key_ok =
                        j == past + i || valid.as_ref().map(|v| v[r][j] != 0.0).unwrap_or(true);
                    if !(causal_ok && key_ok) {
                        bias[(r * t + i) * s + j] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(Some(Tensor::from_vec(bias, (rows, 1, t, s), &self.device)?))
    }

    /// Self-attention of one layer. `x`: [B, T, H] → [B, T, H].
    fn attention(
        &self,
        a: &Attention,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        kv: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let d = a.head_dim;
        // 1. Project: [B, T, H] -> [B, T, heads, D]
        let mut q = a.q.forward(x)?.reshape((b, t, a.n_heads, d))?;
        let mut k = a.k.forward(x)?.reshape((b, t, a.n_kv, d))?;
        let v = a.v.forward(x)?.reshape((b, t, a.n_kv, d))?;
        if let Some((qn, kn)) = &a.qk_norm {
            q = rms_norm(&q, qn, self.cfg.rms_norm_eps, self.ops)?;
            k = rms_norm(&k, kn, self.cfg.rms_norm_eps, self.ops)?;
        }
        // 2. Heads first: [B, heads, T, D], then RoPE.
        let q = rope(&q.transpose(1, 2)?.contiguous()?, cos, sin, self.ops)?;
        let k = rope(&k.transpose(1, 2)?.contiguous()?, cos, sin, self.ops)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        // 3. Append to the cache: [B, Hkv, past+T, D].
        let (k, v) = match kv {
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                *slot = Some((k.clone(), v.clone()));
                (k, v)
            }
            None => (k, v),
        };
        // 4. Grouped-query: repeat kv heads to [B, Hq, S, D].
        let rep = a.n_heads / a.n_kv;
        let (k, v) = if rep == 1 {
            (k, v)
        } else {
            (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?)
        };
        // 5. Scores [B, Hq, T, S] in f32, masked softmax, weighted sum -> [B, Hq, T, D].
        let scale = 1.0 / (d as f64).sqrt();
        let acc = accum_dtype(q.dtype());
        let mut att = (q.matmul(&k.t()?)? * scale)?.to_dtype(acc)?;
        if let Some(m) = mask {
            att = att.broadcast_add(&m.to_dtype(acc)?)?;
        }
        let att = softmax_last(&att, self.ops)?.to_dtype(v.dtype())?;
        let out = att.matmul(&v)?;
        // 6. Merge heads: [B, T, Hq*D] -> o_proj.
        let out = out.transpose(1, 2)?.reshape((b, t, a.n_heads * d))?;
        a.o.forward(&out)
    }
}

/// [B, Hkv, S, D] -> [B, Hkv*rep, S, D], each kv head repeated `rep` times consecutively.
fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    let (b, h, s, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, h, rep, s, d))?
        .reshape((b, h * rep, s, d))
}
