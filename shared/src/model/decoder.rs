//! The decoder: embedding, the blocks of one architecture, the final norm and the LM head,
//! returning hidden states for **all** positions. One forward loop serves every architecture;
//! each architecture's file says how its blocks are built.
//!
//! Layout follows transformers: `model.embed_tokens`, `model.layers.N.{self_attn,mlp}`,
//! `model.norm`, `lm_head` (or the tied embedding). Padding: right-pad and rely on the causal mask
//! (real tokens never attend to later pads), or pass `key_valid` for left-padded batches.

use super::config::{stored_name, Arch, LayerKind, ModelConfig};
use super::layers::{matmul_nt, takes_matmul_nt, AttnBackend, AttnInputs, Block, Ffn, Norm, Ops};
use super::rope::Rope;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

/// Key/value cache for incremental decoding: per layer `k`, `v` of shape [B, Hkv, S, D].
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// The whole sequence's length when known up front (scoring in chunks): RoPE types that
    /// depend on the length (LongRoPE) then treat every chunk as part of that sequence.
    planned_len: usize,
}

impl KvCache {
    pub fn new(n_layers: usize) -> Self {
        KvCache {
            layers: vec![None; n_layers],
            planned_len: 0,
        }
    }
    /// A cache for a sequence of `len` positions fed in chunks.
    pub fn for_sequence(len: usize) -> Self {
        KvCache {
            layers: Vec::new(),
            planned_len: len,
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

/// The weights of a decoder, as stored (the RoPE tables are derived, not stored).
pub(crate) struct Weights {
    pub embed: Tensor,
    pub layers: Vec<Block>,
    pub norm: Norm,
    /// [V, H]; the embedding itself when tied.
    pub lm_head: Tensor,
}

impl Weights {
    /// Reads every parameter of `cfg` from `vb`, named as transformers names them.
    pub fn load(cfg: &ModelConfig, vb: &VarBuilder) -> Result<Weights> {
        let facts = cfg.facts().map_err(candle_core::Error::wrap)?;
        let kinds = cfg.layer_kinds().map_err(candle_core::Error::wrap)?;
        let h = cfg.hidden_size;
        let embed = vb.get((cfg.vocab_size, h), "model.embed_tokens.weight")?;
        let layers = kinds
            .iter()
            .enumerate()
            .map(|(l, &kind)| {
                let spec = cfg.layer_spec(l, kind).map_err(candle_core::Error::wrap)?;
                (facts.block)(&spec, &vb.pp(format!("model.layers.{l}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = Norm::load(
            &vb.pp("model"),
            "norm",
            h,
            cfg.rms_norm_eps,
            facts.norm_plus_one,
        )?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            vb.get((cfg.vocab_size, h), "lm_head.weight")?
        };
        Ok(Weights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

/// The decoder. Cheap to clone (tensors are reference counted).
pub struct Decoder {
    pub(super) cfg: ModelConfig,
    pub(super) arch: Arch,
    pub(super) ops: Ops,
    /// The attention kernel at inference and of a training pass's attention core
    /// ([`AttnBackend::from_env`] unless set).
    pub(super) attn: AttnBackend,
    pub(super) w: Weights,
    /// Gemma: the embedding is multiplied by √hidden (rounded to the model dtype).
    pub(super) embed_scale: Option<f64>,
    /// RoPE of full-attention layers, and of sliding ones when there are any (Gemma 3's local
    /// base differs; the others repeat the full one).
    pub(super) rope_full: Rope,
    pub(super) rope_sliding: Option<Rope>,
    /// The layer kind of each block.
    pub(super) kinds: Vec<LayerKind>,
    pub(super) dtype: DType,
    pub(super) device: Device,
}

impl Decoder {
    /// Builds the decoder from `vb` (safetensors or a `VarMap`); names as in transformers.
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, ops: Ops) -> Result<Decoder> {
        Self::build(cfg, vb, ops, None)
    }

    /// A decoder of the same model over other weights (`vb`, e.g. the trainer's compute copy
    /// after an optimizer step, or untracked weights for generation), reusing this one's RoPE
    /// tables when device and dtype agree: they depend on the config only, and rebuilding them
    /// on the host costs `max_position_embeddings × head_dim` f64 work each time.
    pub fn with_weights(&self, vb: VarBuilder, ops: Ops) -> Result<Decoder> {
        let same = vb.dtype() == self.dtype && vb.device().same_device(&self.device);
        let ropes = same.then(|| (self.rope_full.clone(), self.rope_sliding.clone()));
        Self::build(&self.cfg, vb, ops, ropes)
    }

    fn build(
        cfg: &ModelConfig,
        vb: VarBuilder,
        ops: Ops,
        ropes: Option<(Rope, Option<Rope>)>,
    ) -> Result<Decoder> {
        let arch = cfg.arch().map_err(candle_core::Error::wrap)?;
        cfg.validate().map_err(candle_core::Error::wrap)?;
        let vb = match cfg.weight_prefix.clone() {
            Some(prefix) => vb.rename_f(move |name| stored_name(&prefix, name)),
            None => vb,
        };
        let w = Weights::load(cfg, &vb)?;
        let kinds = cfg.layer_kinds().map_err(candle_core::Error::wrap)?;
        let device = vb.device().clone();
        let dtype = vb.dtype();
        let embed_scale = arch.facts().embed_scale.then(|| {
            let s = (cfg.hidden_size as f64).sqrt();
            match dtype {
                DType::BF16 => half::bf16::from_f64(s).to_f64(),
                DType::F16 => half::f16::from_f64(s).to_f64(),
                DType::F32 => s as f32 as f64,
                _ => s,
            }
        });
        let rope = |kind: LayerKind| -> Result<Rope> {
            let p = cfg.rope(kind).map_err(candle_core::Error::wrap)?;
            let rot = cfg.rotary_dim(kind).map_err(candle_core::Error::wrap)?;
            Rope::new(&p, rot, cfg.max_position_embeddings, dtype, &device)
        };
        let (rope_full, rope_sliding) = match ropes {
            Some(r) => r,
            None => (
                rope(LayerKind::Full)?,
                if kinds.contains(&LayerKind::Sliding) {
                    Some(rope(LayerKind::Sliding)?)
                } else {
                    None
                },
            ),
        };
        Ok(Decoder {
            cfg: cfg.clone(),
            arch,
            ops,
            attn: AttnBackend::from_env(),
            w,
            embed_scale,
            rope_full,
            rope_sliding,
            kinds,
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
    /// The attention kernel of inference (fused ops) and of a training pass's attention core.
    pub fn attention(&self) -> AttnBackend {
        self.attn
    }
    /// Chooses the attention kernel of inference and of a training pass's attention core;
    /// [`AttnBackend::Cudnn`] falls back to the eager path (inference) or the blockwise one
    /// (training) wherever it does not apply.
    pub fn set_attention(&mut self, backend: AttnBackend) {
        self.attn = backend;
    }
    /// Runs the linear layers named in `quantized` (weight names as transformers spells them,
    /// `model.layers.N.self_attn.q_proj.weight` → `[out, in]` in a block format) with candle's
    /// quantized matmuls instead of their dense weights: a GGUF teacher whose matrices stay
    /// quantized (`--gguf-weights quantized`). The dense weights built first may be placeholders
    /// (a broadcast zero: [`crate::gguf::GgufModel::quantized_tensors`]), so every entry must
    /// replace exactly one layer; one that matches none is an error. Only the attention and MLP
    /// projections can be quantized: the embedding, the norms and the LM head stay dense, and so
    /// do Qwen3-MoE's experts. The decoder then serves inference only (no backward pass).
    pub fn quantize_linears(
        &mut self,
        mut quantized: std::collections::HashMap<String, std::sync::Arc<QTensor>>,
    ) -> Result<()> {
        for block in &mut self.w.layers {
            let mut linears = block.attn.linears_mut();
            if let Ffn::Dense(mlp) = &mut block.ffn {
                linears.extend(mlp.linears_mut());
            }
            for lin in linears {
                if let Some(q) = quantized.remove(lin.name()) {
                    lin.quantize(q)?;
                }
            }
        }
        let mut left: Vec<&String> = quantized.keys().collect();
        left.sort();
        if let Some(name) = left.first() {
            candle_core::bail!(
                "{name}: not a linear layer this decoder can quantize ({} left in all)",
                left.len()
            );
        }
        Ok(())
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
        let planned = cache.as_ref().map(|c| c.planned_len).unwrap_or(0);
        if let Some(c) = cache.as_mut() {
            if c.layers.len() != self.w.layers.len() {
                c.layers = vec![None; self.w.layers.len()];
            }
        }
        if past + t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {} positions exceeds max_position_embeddings {}",
                past + t,
                self.cfg.max_position_embeddings
            );
        }
        let total = planned.max(past + t);
        let full = self.rope_slice(&self.rope_full, total, past, t, positions)?;
        let sliding = match &self.rope_sliding {
            Some(r) => Some(self.rope_slice(r, total, past, t, positions)?),
            None => None,
        };
        // One mask per distinct window (full layers: none).
        let mut masks: Vec<(Option<usize>, Option<Tensor>)> = Vec::new();
        for block in &self.w.layers {
            let wnd = block.attn.window;
            if !masks.iter().any(|(w, _)| *w == wnd) {
                masks.push((
                    wnd,
                    attention_bias(b, t, past, key_valid, wnd, &self.device)?,
                ));
            }
        }
        let mut x = self
            .w
            .embed
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.hidden_size))?;
        if let Some(s) = self.embed_scale {
            x = (x * s)?;
        }
        for (li, block) in self.w.layers.iter().enumerate() {
            let kv = cache.as_mut().map(|c| &mut c.layers[li]);
            let (cos, sin) = match (self.kinds[li], &sliding) {
                (LayerKind::Sliding, Some(s)) => (&s.0, &s.1),
                _ => (&full.0, &full.1),
            };
            let mask = masks
                .iter()
                .find(|(w, _)| *w == block.attn.window)
                .and_then(|(_, m)| m.as_ref());
            let inp = AttnInputs {
                cos,
                sin,
                mask,
                plain: key_valid.is_none(),
                backend: self.attn,
                ops: self.ops,
            };
            let residual = x.clone();
            let mut h = block.input_norm.forward(&x, self.ops)?;
            h = block.attn.forward(&h, &inp, kv)?;
            if let Some(n) = &block.post_attn_norm {
                h = n.forward(&h, self.ops)?;
            }
            x = (residual + h)?;
            let residual = x.clone();
            let mut h = block.ffn_norm.forward(&x, self.ops)?;
            h = block.ffn.forward(&h, self.ops)?;
            if let Some(n) = &block.post_ffn_norm {
                h = n.forward(&h, self.ops)?;
            }
            x = (residual + h)?;
        }
        self.w.norm.forward(&x, self.ops)
    }

    /// The cos/sin rows of this forward: `past..past+T` for every row, or gathered per row from
    /// `positions` ([B, T] → [B, T, R/2]).
    pub(super) fn rope_slice(
        &self,
        rope: &Rope,
        total: usize,
        past: usize,
        t: usize,
        positions: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = rope.tables(total);
        match positions {
            None => Ok((cos.narrow(0, past, t)?, sin.narrow(0, past, t)?)),
            Some(p) => {
                let (b, t) = p.dims2()?;
                let flat = p.flatten_all()?;
                let half = cos.dim(1)?;
                Ok((
                    cos.index_select(&flat, 0)?.reshape((b, t, half))?,
                    sin.index_select(&flat, 0)?.reshape((b, t, half))?,
                ))
            }
        }
    }

    /// Logits of the hidden states: [..., H] → [..., V] (in the model dtype).
    ///
    /// Computed as one rank-2 matmul against the transposed *view* of the head, which the
    /// matmul reads in place (a rank-3 broadcast would copy the whole [H, V] head each call).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        if self.ops == Ops::Differentiable {
            // One node whose backward writes the head's `[V, H]` gradient as it is laid out
            // (through `hidden.matmul(head.t())` it came back as a transposed view, added to
            // zeros element by element, and the logits' gradient went through two reshapes).
            return super::autograd::linear(hidden, &self.w.lm_head);
        }
        let dims = hidden.dims().to_vec();
        let h = *dims.last().unwrap_or(&0);
        let rows = hidden.elem_count() / h.max(1);
        let out = self.head_matmul(&hidden.reshape((rows, h))?, &self.w.lm_head)?;
        let mut shape = dims;
        if let Some(last) = shape.last_mut() {
            *last = self.w.lm_head.dim(0)?;
        }
        out.reshape(shape)
    }

    /// Whether a training pass can sum its head's gradient into a sink
    /// ([`Decoder::logits_into`]): differentiable ops, the fused ops running for the head (a
    /// CUDA device with the project's kernels on, or a test forcing them: on the CPU the
    /// accumulation is an f64 reference loop), and the head a leaf (a weight read through a
    /// tracked cast owes its gradient to the master behind it).
    pub fn head_sinks(&self) -> bool {
        let head = &self.w.lm_head;
        self.ops == Ops::Differentiable
            && super::device_ops::applies(head)
            && (head.is_variable() || !head.track_op())
    }

    /// [`Decoder::logits`] of a training pass whose backward sums the head's gradient into
    /// `sink` (`[V, H]`, f32, or f64 for f64 models) in place instead of returning it
    /// ([`super::autograd::linear_into`]): over a pass's head chunks, the head's gradient is
    /// `sink` at the end. Only `hidden` gets a gradient through the graph.
    pub fn logits_into(&self, hidden: &Tensor, sink: &Tensor) -> Result<Tensor> {
        super::autograd::linear_into(hidden, &self.w.lm_head, sink)
    }

    /// [`Decoder::logits_into`]'s logits with nothing recorded for autograd: a head chunk whose
    /// loss and backward run by hand ([`Decoder::head_backward_into`]) reads them, and may
    /// overwrite them (a buffer of their own).
    pub fn logits_untracked(&self, hidden: &Tensor) -> Result<Tensor> {
        super::autograd::linear_untracked(hidden, &self.w.lm_head)
    }

    /// The backward of [`Decoder::logits_untracked`] written by hand, as
    /// [`Decoder::logits_into`]'s node runs it: the head's gradient `gradᵀ · hidden` summed
    /// into `sink` in place, and the hidden states' gradient `grad · head` returned.
    pub fn head_backward_into(
        &self,
        hidden: &Tensor,
        grad: &Tensor,
        sink: &Tensor,
    ) -> Result<Tensor> {
        super::autograd::linear_backward_into(
            &hidden.detach(),
            &self.w.lm_head.detach(),
            sink,
            grad,
        )
    }

    /// The LM head `[V, H]` (the embedding itself when tied), for kernels that read it in place.
    pub fn lm_head(&self) -> &Tensor {
        &self.w.lm_head
    }

    /// Logits of `hidden` [c, H] at the head's rows `cols` only: [c, cols.len()] (in the model
    /// dtype). The fused scoring pass calls it a vocabulary tile at a time, so that `[c, V]`
    /// never exists at once; like [`Decoder::logits`] it reads the head in place.
    pub fn logits_cols(&self, hidden: &Tensor, cols: std::ops::Range<usize>) -> Result<Tensor> {
        let head = self.w.lm_head.narrow(0, cols.start, cols.len())?; // [n, H]
        self.head_matmul(hidden, &head)
    }

    /// `hidden [c, H] · headᵀ` (`head` `[n, H]`, read in place): at inference on f32 host
    /// tensors the blocked kernel the linear layers and the head kernel (AVX-512 or AVX2) sum in
    /// ([`xdistill_cpu_kernels::matmul::matmul_nt`], the same bits at every SIMD level; candle's gemm lost
    /// 2.6× more against f64 here, issue 49), else candle's matmul.
    fn head_matmul(&self, hidden: &Tensor, head: &Tensor) -> Result<Tensor> {
        if takes_matmul_nt(hidden, head, self.ops)? {
            return matmul_nt(hidden, head);
        }
        hidden.matmul(&head.t()?)
    }

    /// Convenience: logits for all positions, [B, T] → [B, T, V].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits(&self.forward_hidden(ids, None, None, None)?)
    }
}

/// Additive attention bias [B|1, 1, T, past+T] (0 or -inf, f32), or None when nothing is masked.
///
/// Query `i` (absolute position `past + i`) sees key `j` when `j <= past + i`, the key is valid
/// (`key_valid`) or is the query itself, and, with a window `w`, `past + i - j < w` (as
/// transformers' `sliding_window_overlay`: `kv_idx > q_idx - w`). Built on `device` from
/// position ranges and `key_valid` itself: no host round trip per decoding step.
pub(super) fn attention_bias(
    b: usize,
    t: usize,
    past: usize,
    key_valid: Option<&Tensor>,
    window: Option<usize>,
    device: &Device,
) -> Result<Option<Tensor>> {
    let s = past + t;
    let window_masks_something = window.is_some_and(|w| s > w);
    if t == 1 && key_valid.is_none() && !window_masks_something {
        return Ok(None); // one new token attends to everything cached
    }
    let visible = super::blockwise::visible((past, s), (0, s), window, device)?; // [T, S] u8
    let visible = match key_valid {
        Some(kv) => {
            let (kb, ks) = kv.dims2()?;
            if kb != b || ks != s {
                candle_core::bail!("key_valid is [{kb}, {ks}], expected [{b}, {s}]");
            }
            // A key counts when valid, or when it is the query itself (pad rows stay finite).
            let valid = kv.to_device(device)?.to_dtype(DType::F32)?.ne(0f32)?; // [B, S]
            let qi = Tensor::arange(past as f32, s as f32, device)?.unsqueeze(1)?; // [T, 1]
            let kj = Tensor::arange(0f32, s as f32, device)?.unsqueeze(0)?; // [1, S]
            let own = kj.broadcast_eq(&qi)?; // [T, S]
            let key_ok = valid.unsqueeze(1)?.broadcast_maximum(&own.unsqueeze(0)?)?; // [B, T, S]
            key_ok.broadcast_mul(&visible.unsqueeze(0)?)?
        }
        None => visible.unsqueeze(0)?, // [1, T, S]
    };
    let zero = Tensor::zeros(visible.shape(), DType::F32, device)?;
    let ninf = Tensor::full(f32::NEG_INFINITY, visible.shape(), device)?;
    Ok(Some(visible.where_cond(&zero, &ninf)?.unsqueeze(1)?))
}
