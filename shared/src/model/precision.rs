//! Where an f32 forward loses accuracy against f64 (issue 49): [`Decoder::forward_hidden`]'s
//! forward retraced op by op, each op in f64 or in f32 — on the f64 state rounded to f32, with
//! the f32 decoder's weights and ops — chosen per kind of op, so that each kind's share of the
//! final error shows on its own ("only this kind in f32") and what making it exact would gain
//! ("every kind in f32 but this one"). With every kind in f32 the trace is the f32 decoder's
//! own forward, bit for bit ([`Trace::check`]), which keeps the trace true to what it measures.
//!
//! Dense decoders without Gemma's extra norms or embedding scale (Llama, Mistral, Qwen2/3,
//! SmolLM2); `shared/examples/f32_error_by_op.rs` prints the table for a GGUF model on text.

use super::decoder::attention_bias;
use super::layers::{repeat_kv, rope, Block, Ffn, GateUp, GatedMlp, Norm, Ops, Qkv};
use super::spec::Activation;
use super::Decoder;
use candle_core::{DType, Device, Result, Tensor, D};
use xdistill_cpu_kernels::host_ops;

/// The kinds of op a decoder's forward is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// RMSNorm: each block's two, q/k-norm (Qwen3) and the final one.
    Norm,
    /// The linear layers (q, k, v, o, gate, up, down).
    Linear,
    /// RoPE on q and k.
    Rope,
    /// The attention's scores `q · kᵀ · scale`.
    Scores,
    /// The attention's softmax over keys.
    Softmax,
    /// The attention's weighted sum of values `softmax · v`.
    Mix,
    /// The MLP's `silu(gate) · up`.
    SiluMul,
    /// The residual stream's additions.
    Residual,
    /// The LM head's matmul ([`Decoder::logits`]: on f32 host tensors with fused ops the bits of
    /// the head kernel (AVX-512 or AVX2)); the logits' log-softmax is taken in f64 on both sides, as the
    /// teacher's scoring sums in f64.
    Head,
}

impl OpKind {
    /// Every kind, in the forward's order.
    pub const ALL: [OpKind; 9] = [
        OpKind::Norm,
        OpKind::Linear,
        OpKind::Rope,
        OpKind::Scores,
        OpKind::Softmax,
        OpKind::Mix,
        OpKind::SiluMul,
        OpKind::Residual,
        OpKind::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Norm => "rms norm",
            OpKind::Linear => "linear layers",
            OpKind::Rope => "rope",
            OpKind::Scores => "attention scores q·kᵀ",
            OpKind::Softmax => "attention softmax",
            OpKind::Mix => "attention softmax·v",
            OpKind::SiluMul => "silu(gate)·up",
            OpKind::Residual => "residual adds",
            OpKind::Head => "lm head",
        }
    }
}

/// The same model in f64 (the reference, candle's ops) and in f32 (the forward measured: its
/// [`Ops`] and the process's SIMD level decide the f32 kernels).
pub struct Trace<'a> {
    f64: &'a Decoder,
    f32: &'a Decoder,
}

/// One side of the trace: a decoder and the dtype its ops run in.
#[derive(Clone, Copy)]
struct Side<'a> {
    d: &'a Decoder,
    dtype: DType,
}

impl<'a> Side<'a> {
    fn block(&self, l: usize) -> &'a Block {
        &self.d.w.layers[l]
    }

    /// Block `l`'s dense MLP ([`Trace::new`] checked that every block has one).
    fn mlp(&self, l: usize) -> &'a GatedMlp {
        match &self.block(l).ffn {
            Ffn::Dense(m) => m,
            Ffn::Moe(_) => unreachable!("checked in Trace::new"),
        }
    }
}

impl<'a> Trace<'a> {
    /// `f64`: the model in f64 with differentiable (candle's generic) ops; `f32`: the same
    /// weights in f32. Refuses architectures the trace does not follow.
    pub fn new(f64: &'a Decoder, f32: &'a Decoder) -> Result<Trace<'a>> {
        if f64.dtype != DType::F64 || f32.dtype != DType::F32 {
            candle_core::bail!("the trace takes an f64 and an f32 decoder");
        }
        if !f64.device.is_cpu() || !f32.device.is_cpu() {
            candle_core::bail!("the trace runs on the CPU");
        }
        if f64.embed_scale.is_some() || f64.rope_sliding.is_some() {
            candle_core::bail!("the trace follows dense decoders without Gemma's scale or windows");
        }
        for b in &f64.w.layers {
            let dense = matches!(&b.ffn, Ffn::Dense(m)
                if matches!(m.gate_up, GateUp::Separate { .. }) && m.act == Activation::Silu);
            if !dense
                || b.post_attn_norm.is_some()
                || b.post_ffn_norm.is_some()
                || !matches!(b.attn.qkv, Qkv::Separate { .. })
                || b.attn.window.is_some()
            {
                candle_core::bail!("the trace follows dense decoders with separate projections");
            }
        }
        Ok(Trace { f64, f32 })
    }

    /// Runs `op` on the f32 side (its inputs rounded to f32, its output back in f64) when
    /// `in_f32(kind)`, else on the f64 side.
    fn op(
        &self,
        kind: OpKind,
        in_f32: &dyn Fn(OpKind) -> bool,
        inputs: &[&Tensor],
        op: impl Fn(Side<'_>, &[Tensor]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (side, dt) = if in_f32(kind) {
            (self.f32, DType::F32)
        } else {
            (self.f64, DType::F64)
        };
        let xs = inputs
            .iter()
            .map(|x| x.to_dtype(dt))
            .collect::<Result<Vec<_>>>()?;
        op(Side { d: side, dtype: dt }, &xs)?.to_dtype(DType::F64)
    }

    /// The logits `[B, T, V]` (f64) of `ids` `[B, T]` (no padding, no cache), each op in f32
    /// where `in_f32` says so.
    pub fn logits(&self, ids: &Tensor, in_f32: &dyn Fn(OpKind) -> bool) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (d64, d32) = (self.f64, self.f32);
        let h = d64.cfg.hidden_size;
        let dev = Device::Cpu;
        let mask = attention_bias(b, t, 0, None, None, &dev)?;
        let (cos64, sin64) = d64.rope_slice(&d64.rope_full, t, 0, t, None)?;
        let (cos32, sin32) = d32.rope_slice(&d32.rope_full, t, 0, t, None)?;
        let tables = |s: Side<'_>| {
            if s.dtype == DType::F32 {
                (cos32.clone(), sin32.clone())
            } else {
                (cos64.clone(), sin64.clone())
            }
        };
        let ops = |s: Side<'_>| s.d.ops;
        // The embedding rows are exact in both dtypes (f64 holds the f32 weights).
        let mut x = d64
            .w
            .embed
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, h))?;
        let norm = |x: &Tensor, pick: &dyn Fn(&Block) -> &Norm, l: usize| {
            self.op(OpKind::Norm, in_f32, &[x], |s, v| {
                pick(s.block(l)).forward(&v[0], ops(s))
            })
        };
        for l in 0..d64.w.layers.len() {
            let a64 = &d64.w.layers[l].attn;
            let (hq, hkv, hd) = (a64.n_heads, a64.n_kv, a64.head_dim);
            let hn = norm(&x, &|b| &b.input_norm, l)?;
            let proj = |which: usize| {
                self.op(OpKind::Linear, in_f32, &[&hn], |s, v| {
                    let Qkv::Separate { q, k, v: vp } = &s.block(l).attn.qkv else {
                        unreachable!("checked in Trace::new")
                    };
                    [q, k, vp][which].forward(&v[0], ops(s))
                })
            };
            let mut q = proj(0)?.reshape((b, t, hq, hd))?;
            let mut k = proj(1)?.reshape((b, t, hkv, hd))?;
            let v = proj(2)?.reshape((b, t, hkv, hd))?;
            if a64.qk_norm.is_some() {
                let qk = |x: &Tensor, which: usize| {
                    self.op(OpKind::Norm, in_f32, &[x], |s, v| {
                        let (qn, kn) = s.block(l).attn.qk_norm.as_ref().expect("q/k norms");
                        [qn, kn][which].forward(&v[0], ops(s))
                    })
                };
                q = qk(&q, 0)?;
                k = qk(&k, 1)?;
            }
            let rot = |x: &Tensor| {
                let x = x.transpose(1, 2)?.contiguous()?;
                self.op(OpKind::Rope, in_f32, &[&x], |s, v| {
                    let (cos, sin) = tables(s);
                    rope(&v[0], &cos, &sin, ops(s))
                })
            };
            let q = rot(&q)?;
            let k = repeat_kv(&rot(&k)?, hq / hkv)?;
            let v = repeat_kv(&v.transpose(1, 2)?.contiguous()?, hq / hkv)?;
            // As `layers::attend`: scores in the compute dtype, the mask added, the softmax,
            // `softmax · v`.
            let scale = a64.scale;
            let scores = self.op(OpKind::Scores, in_f32, &[&q, &k], |_, v| {
                let s = (v[0].contiguous()?.matmul(&v[1].t()?)? * scale)?;
                match &mask {
                    Some(m) => s.broadcast_add(&m.to_dtype(s.dtype())?),
                    None => Ok(s),
                }
            })?;
            let att = self.op(OpKind::Softmax, in_f32, &[&scores], |s, v| match ops(s) {
                Ops::Fused => host_ops::softmax_last_dim(&v[0]),
                Ops::Differentiable => candle_nn::ops::softmax(&v[0], D::Minus1),
            })?;
            let mixed = self.op(OpKind::Mix, in_f32, &[&att, &v], |_, v| v[0].matmul(&v[1]))?;
            let merged = mixed.transpose(1, 2)?.reshape((b, t, hq * hd))?;
            let o = self.op(OpKind::Linear, in_f32, &[&merged], |s, v| {
                s.block(l).attn.o.forward(&v[0], ops(s))
            })?;
            x = self.op(OpKind::Residual, in_f32, &[&x, &o], |_, v| &v[0] + &v[1])?;
            let hn = norm(&x, &|b| &b.ffn_norm, l)?;
            let gate_up = |which: usize| {
                self.op(OpKind::Linear, in_f32, &[&hn], |s, v| {
                    let GateUp::Separate { gate, up } = &s.mlp(l).gate_up else {
                        unreachable!("checked in Trace::new")
                    };
                    [gate, up][which].forward(&v[0], ops(s))
                })
            };
            let (gate, up) = (gate_up(0)?, gate_up(1)?);
            let act = self.op(OpKind::SiluMul, in_f32, &[&gate, &up], |s, v| {
                match ops(s) {
                    Ops::Fused => host_ops::silu_mul(&v[0], &v[1]),
                    Ops::Differentiable => v[0].silu()? * &v[1],
                }
            })?;
            let down = self.op(OpKind::Linear, in_f32, &[&act], |s, v| {
                s.mlp(l).down.forward(&v[0], ops(s))
            })?;
            x = self.op(OpKind::Residual, in_f32, &[&x, &down], |_, v| &v[0] + &v[1])?;
        }
        let hidden = self.op(OpKind::Norm, in_f32, &[&x], |s, v| {
            s.d.w.norm.forward(&v[0], ops(s))
        })?;
        self.op(OpKind::Head, in_f32, &[&hidden], |s, v| s.d.logits(&v[0]))
    }

    /// Checks that the trace with every op in f32 is the f32 decoder's forward bit for bit
    /// (its hidden states through its head): the trace follows the forward it measures.
    pub fn check(&self, ids: &Tensor) -> Result<()> {
        let traced = self.logits(ids, &|_| true)?;
        let hidden = self.f32.forward_hidden(ids, None, None, None)?;
        let direct = self.f32.logits(&hidden)?.to_dtype(DType::F64)?;
        let diff = (traced - direct)?.abs()?.max_all()?.to_scalar::<f64>()?;
        if diff != 0.0 {
            candle_core::bail!("the trace differs from the decoder's forward by up to {diff:e}");
        }
        Ok(())
    }
}

/// Worst absolute errors of a side's scores against f64 ones, over every position, as
/// `bench/f32_accuracy.py` reads them: the log-probs of the reference's top `k`, the target
/// log-probs and the logsumexps.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScoreErrors {
    pub topk: f64,
    pub target: f64,
    pub logsumexp: f64,
}

impl ScoreErrors {
    pub fn worst(&self) -> f64 {
        self.topk.max(self.target).max(self.logsumexp)
    }

    /// Errors of `logits` against `reference` (both `[B, T, V]` f64) for the next tokens of
    /// `ids` `[B, T]` (the last position has no target and is left out).
    pub fn of(logits: &Tensor, reference: &Tensor, ids: &Tensor, k: usize) -> Result<ScoreErrors> {
        let (b, t) = ids.dims2()?;
        let v = reference.dim(D::Minus1)?;
        let ids = ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let rows = |x: &Tensor| -> Result<Vec<Vec<f64>>> {
            x.reshape((b * t, v))?
                .to_dtype(DType::F64)?
                .to_vec2::<f64>()
        };
        let (got, want) = (rows(logits)?, rows(reference)?);
        let lse = |r: &[f64]| {
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
        };
        let mut e = ScoreErrors::default();
        let top = k.min(v);
        for bi in 0..b {
            for ti in 0..t.saturating_sub(1) {
                let (g, w) = (&got[bi * t + ti], &want[bi * t + ti]);
                let (lg, lw) = (lse(g), lse(w));
                e.logsumexp = e.logsumexp.max((lg - lw).abs());
                let tgt = ids[bi][ti + 1] as usize;
                e.target = e.target.max(((g[tgt] - lg) - (w[tgt] - lw)).abs());
                if top == 0 {
                    continue;
                }
                let mut order: Vec<usize> = (0..v).collect();
                order.select_nth_unstable_by(top - 1, |&i, &j| w[j].total_cmp(&w[i]));
                for &i in &order[..top] {
                    e.topk = e.topk.max(((g[i] - lg) - (w[i] - lw)).abs());
                }
            }
        }
        Ok(e)
    }
}
