//! One dense decoder layer of a training pass by hand: a forward that records what its backward
//! reads (a [`Tape`]), and that backward, op by op, with no autograd graph.
//!
//! Why: candle's `backward` gives every node of a graph its gradient as `zeros + contribution`
//! (a fill and an add per operand, at activation size for most of a layer's nodes), so on a GPU
//! those adds, not the matmuls, led the profile of a training step even after
//! [`super::autograd`]'s ops shrank the graph (an H200, 2026-11-29: `badd_bf16` 193 launches,
//! 9.3 of 32.6 ms). Here every gradient is written once by the op that produces it: matmuls for
//! the linear layers, the fused backward kernels of [`super::device_ops`] for the norms, RoPE
//! and the gated activation, the attention core's own backward, and one add where two branches
//! meet (the residuals, q/k/v's input).
//!
//! It runs where the fused ops run ([`Decoder::trains_by_hand`]: a CUDA device with the
//! project's kernels, or a test that forces them on the CPU) and every block has a dense MLP;
//! the forward calls the same kernels in the same order as the autograd pass
//! ([`Decoder::project`] and [`Decoder::after_attention`]), so its hidden states are the same
//! bits and its gradients equal that pass's within the rounding of the adds' order.

use super::autograd::{linear as matmul_nt, linear_backward};
use super::decoder::Decoder;
use super::device_ops;
use super::layers::{Block, Ffn, GateUp, Linear, Norm, Qkv};
use super::train_attention::{self, Core, Saved as CoreSaved};
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, D};

/// What one layer's backward reads, recorded by [`Decoder::tape_forward`]. `[B, T, H]` hidden,
/// `[B, T, I]` intermediate; q `[B, Hq, T, D]`, k and v `[B, Hkv, T, D]`.
pub(super) struct Tape {
    /// The layer's input.
    x: Tensor,
    /// The input norm's output (the q/k/v projections' input).
    h1: Tensor,
    /// q `[B, T, Hq, D]` and k `[B, T, Hkv, D]` before their norms (Qwen3, Gemma 3).
    qk_pre: Option<(Tensor, Tensor)>,
    /// Projected, normed and rotated, heads first: the attention core's inputs.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The core's output `[B, Hq, T, D]` and what its backward needs.
    o: Tensor,
    saved: CoreSaved,
    /// `o_proj`'s output, where Gemma's post-attention norm follows.
    attn_out: Option<Tensor>,
    /// `x` plus the attention branch: the feed-forward half's input.
    mid: Tensor,
    /// The feed-forward norm's output (gate and up's input).
    h2: Tensor,
    gate: Tensor,
    up: Tensor,
    /// `act(gate) · up` (down's input).
    act: Tensor,
    /// `down_proj`'s output, where Gemma's post-feed-forward norm follows.
    ffn_out: Option<Tensor>,
    /// The layer's RoPE cos/sin `[T, R/2]`.
    rope: (Tensor, Tensor),
}

/// `x · Wᵀ (+ b)` with the layer's weights read untracked: the autograd pass's kernel.
fn linear(l: &Linear, x: &Tensor) -> Result<Tensor> {
    let (w, b) = l.dense()?;
    let y = matmul_nt(x, &w.detach())?;
    match b {
        Some(b) => y.broadcast_add(&b.detach()),
        None => Ok(y),
    }
}

/// The fused RMSNorm with the weight read untracked.
fn norm(n: &Norm, x: &Tensor) -> Result<Tensor> {
    device_ops::rms_norm(x, &n.weight.detach(), n.eps, n.plus_one)
}

/// Adds `g` to `param`'s entry of `grads` (inserts it where there is none).
pub(super) fn add_grad(grads: &mut GradStore, param: &Tensor, g: Tensor) -> Result<()> {
    let g = match grads.remove(param) {
        Some(prev) => (prev + g)?,
        None => g,
    };
    grads.insert(param, g);
    Ok(())
}

/// The backward of [`linear`] `y = x · Wᵀ (+ b)` given `g` at `y`: `dW` (and `db`) into
/// `grads`; returns `dx`.
fn linear_back(l: &Linear, x: &Tensor, g: &Tensor, grads: &mut GradStore) -> Result<Tensor> {
    let (w, b) = l.dense()?;
    let g = g.contiguous()?;
    let (dx, dw) = linear_backward(x, &w.detach(), &g)?;
    add_grad(grads, w, dw)?;
    if let Some(b) = b {
        let rows = g.reshape(((), b.elem_count()))?;
        add_grad(grads, b, rows.sum(0)?)?;
    }
    Ok(dx)
}

/// The backward of [`norm`] given `g` at its output: the weight's gradient into `grads`;
/// returns the input's.
fn norm_back(n: &Norm, x: &Tensor, g: &Tensor, grads: &mut GradStore) -> Result<Tensor> {
    let (dx, dw) = device_ops::rms_norm_backward(g, x, &n.weight.detach(), n.eps, n.plus_one)?;
    add_grad(grads, &n.weight, dw)?;
    Ok(dx)
}

/// `t` `[B, T, heads, D]` (any layout) as `[B, T, heads·D]`, contiguous.
fn merge_heads(t: &Tensor) -> Result<Tensor> {
    let (b, s, h, d) = t.dims4()?;
    t.contiguous()?.reshape((b, s, h * d))
}

impl Decoder {
    /// Whether this decoder's training pass runs its layers (and its embedding's gradient) by
    /// hand (`train_layer`): the fused ops run for its weights (a CUDA device
    /// with the project's kernels on, or a test forcing them), every block's MLP is dense, the
    /// norms and RoPE tables are in the compute dtype, and the embedding and every layer weight
    /// are leaves (a `Var`, or a constant): gradients by hand go to the tensors the decoder
    /// holds, so a weight read through a tracked cast (whose gradient belongs to the master
    /// behind it) keeps the autograd pass.
    pub fn trains_by_hand(&self) -> bool {
        let dt = self.dtype;
        let leaf = |t: &Tensor| t.is_variable() || !t.track_op();
        let block_fits = |b: &Block| {
            let Ffn::Dense(mlp) = &b.ffn else {
                return false;
            };
            let mut norms = vec![&b.input_norm, &b.ffn_norm];
            norms.extend(&b.post_attn_norm);
            norms.extend(&b.post_ffn_norm);
            if let Some((q, k)) = &b.attn.qk_norm {
                norms.extend([q, k]);
            }
            let linears_fit = b.attn.linears().into_iter().chain(mlp.linears()).all(|l| {
                l.dense()
                    .is_ok_and(|(w, bias)| leaf(w) && bias.is_none_or(leaf))
            });
            linears_fit
                && norms
                    .iter()
                    .all(|n| n.weight.dtype() == dt && leaf(&n.weight))
        };
        let tables_fit = std::iter::once(&self.rope_full)
            .chain(&self.rope_sliding)
            .all(|r| r.tables(0).0.dtype() == dt);
        device_ops::applies(&self.w.embed)
            && leaf(&self.w.embed)
            && tables_fit
            && self.w.layers.iter().all(block_fits)
    }

    /// The cos/sin tables of layer `l` out of a pass's `[full, sliding]`.
    fn layer_rope<'r>(&self, l: usize, rope: &'r [(Tensor, Tensor); 2]) -> &'r (Tensor, Tensor) {
        match self.kinds[l] {
            super::spec::LayerKind::Sliding => &rope[1],
            super::spec::LayerKind::Full => &rope[0],
        }
    }

    /// Layer `l`'s forward on `x` `[B, T, H]` untracked, with what its backward needs: the
    /// output `[B, T, H]` (the bits of [`Decoder::project`], the core and
    /// [`Decoder::after_attention`] with the fused ops) and the tape.
    pub(super) fn tape_forward(
        &self,
        l: usize,
        block: &Block,
        x: &Tensor,
        rope: &[(Tensor, Tensor); 2],
    ) -> Result<(Tensor, Tape)> {
        let (cos, sin) = self.layer_rope(l, rope);
        let attn = &block.attn;
        let (b, t, _) = x.dims3()?;
        let (d, hq, hkv) = (attn.head_dim, attn.n_heads, attn.n_kv);
        // 1. Norm, projections, q/k norms, RoPE (written heads first).
        let h1 = norm(&block.input_norm, x)?;
        let (q, k, v) = match &attn.qkv {
            Qkv::Separate { q, k, v } => (linear(q, &h1)?, linear(k, &h1)?, linear(v, &h1)?),
            Qkv::Fused(qkv) => {
                let all = linear(qkv, &h1)?;
                (
                    all.narrow(D::Minus1, 0, hq * d)?,
                    all.narrow(D::Minus1, hq * d, hkv * d)?,
                    all.narrow(D::Minus1, (hq + hkv) * d, hkv * d)?,
                )
            }
        };
        let q = q.reshape((b, t, hq, d))?;
        let k = k.reshape((b, t, hkv, d))?;
        let v = v.reshape((b, t, hkv, d))?.transpose(1, 2)?.contiguous()?;
        let (q, k, qk_pre) = match &attn.qk_norm {
            Some((qn, kn)) => {
                let (qp, kp) = (q.contiguous()?, k.contiguous()?);
                (norm(qn, &qp)?, norm(kn, &kp)?, Some((qp, kp)))
            }
            None => (q, k, None),
        };
        let q = device_ops::rope(&q, cos, sin, true)?;
        let k = device_ops::rope(&k, cos, sin, true)?;
        // 2. The attention core.
        let core = Core {
            backend: self.attn,
            scale: attn.scale,
            window: attn.window,
        };
        let (o, saved) = train_attention::forward(&q, &k, &v, core)?;
        // 3. o_proj, Gemma's post-attention norm, the residual.
        let o_flat = o.transpose(1, 2)?.reshape((b, t, hq * d))?;
        let out = linear(&attn.o, &o_flat)?;
        let (h, attn_out) = match &block.post_attn_norm {
            Some(n) => (norm(n, &out)?, Some(out)),
            None => (out, None),
        };
        let mid = (x + h)?;
        // 4. The feed-forward half.
        let Ffn::Dense(mlp) = &block.ffn else {
            candle_core::bail!("a layer by hand needs a dense MLP");
        };
        let h2 = norm(&block.ffn_norm, &mid)?;
        let (gate, up) = match &mlp.gate_up {
            GateUp::Separate { gate, up } => (linear(gate, &h2)?, linear(up, &h2)?),
            GateUp::Fused(gu) => {
                let both = linear(gu, &h2)?;
                let i = both.dim(D::Minus1)? / 2;
                (both.narrow(D::Minus1, 0, i)?, both.narrow(D::Minus1, i, i)?)
            }
        };
        let act = device_ops::gated_act(&gate, &up, mlp.act)?;
        let out = linear(&mlp.down, &act)?;
        let (h, ffn_out) = match &block.post_ffn_norm {
            Some(n) => (norm(n, &out)?, Some(out)),
            None => (out, None),
        };
        let y = (&mid + h)?;
        let tape = Tape {
            x: x.clone(),
            h1,
            qk_pre,
            q,
            k,
            v,
            o,
            saved,
            attn_out,
            mid,
            h2,
            gate,
            up,
            act,
            ffn_out,
            rope: (cos.clone(), sin.clone()),
        };
        Ok((y, tape))
    }
}

/// A layer's backward from its tape, given `gy` at its output: the parameters' gradients
/// into `grads`; returns the gradient at the layer's input. Each tensor of the tape is
/// dropped once read.
pub(super) fn backward(
    block: &Block,
    tape: Tape,
    gy: &Tensor,
    grads: &mut GradStore,
) -> Result<Tensor> {
    let Tape {
        x,
        h1,
        qk_pre,
        q,
        k,
        v,
        o,
        saved,
        attn_out,
        mid,
        h2,
        gate,
        up,
        act,
        ffn_out,
        rope: (cos, sin),
    } = tape;
    let Ffn::Dense(mlp) = &block.ffn else {
        candle_core::bail!("a layer by hand needs a dense MLP");
    };
    let attn = &block.attn;
    // 1. The feed-forward half: y = mid + post_ffn(down(act(gate, up)(ffn_norm(mid)))).
    let d_out = match (&block.post_ffn_norm, ffn_out) {
        (Some(n), Some(f)) => norm_back(n, &f, gy, grads)?,
        _ => gy.clone(),
    };
    let d_act = linear_back(&mlp.down, &act, &d_out, grads)?;
    drop((act, d_out));
    let (d_gate, d_up) = device_ops::gated_act_backward(&d_act, &gate, &up, mlp.act)?;
    drop((gate, up, d_act));
    let d_h2 = match &mlp.gate_up {
        GateUp::Separate { gate, up } => {
            let a = linear_back(gate, &h2, &d_gate, grads)?;
            (a + linear_back(up, &h2, &d_up, grads)?)?
        }
        GateUp::Fused(gu) => {
            let both = Tensor::cat(&[&d_gate, &d_up], D::Minus1)?;
            linear_back(gu, &h2, &both, grads)?
        }
    };
    drop((h2, d_gate, d_up));
    let d_mid = (gy + norm_back(&block.ffn_norm, &mid, &d_h2, grads)?)?;
    drop((mid, d_h2));
    // 2. The attention half: mid = x + post_attn(o_proj(core(q, k, v))).
    let d_out = match (&block.post_attn_norm, attn_out) {
        (Some(n), Some(a)) => norm_back(n, &a, &d_mid, grads)?,
        _ => d_mid.clone(),
    };
    let (b, t, hq, d) = o.dims4().map(|(b, h, t, d)| (b, t, h, d))?;
    let o_flat = o.transpose(1, 2)?.reshape((b, t, hq * d))?;
    let d_o = linear_back(&attn.o, &o_flat, &d_out, grads)?;
    drop((o_flat, d_out));
    let d_o = d_o.reshape((b, t, hq, d))?.transpose(1, 2)?;
    let (dq, dk, dv) = train_attention::backward(&saved, (&q, &k, &v), &o, &d_o, attn.scale)?;
    drop((q, k, v, o, saved, d_o));
    // 3. RoPE back to [B, T, heads, D], the q/k norms, the projections.
    let dq = device_ops::rope_backward(&dq, &cos, &sin)?;
    let dk = device_ops::rope_backward(&dk, &cos, &sin)?;
    let (dq, dk) = match (&attn.qk_norm, qk_pre) {
        (Some((qn, kn)), Some((qp, kp))) => (
            norm_back(qn, &qp, &dq, grads)?,
            norm_back(kn, &kp, &dk, grads)?,
        ),
        _ => (dq, dk),
    };
    let (dq, dk, dv) = (
        merge_heads(&dq)?,
        merge_heads(&dk)?,
        merge_heads(&dv.transpose(1, 2)?)?,
    );
    let d_h1 = match &attn.qkv {
        Qkv::Separate { q, k, v } => {
            let a = linear_back(q, &h1, &dq, grads)?;
            let a = (a + linear_back(k, &h1, &dk, grads)?)?;
            (a + linear_back(v, &h1, &dv, grads)?)?
        }
        Qkv::Fused(qkv) => {
            let all = Tensor::cat(&[&dq, &dk, &dv], D::Minus1)?;
            linear_back(qkv, &h1, &all, grads)?
        }
    };
    drop((h1, dq, dk, dv));
    // 4. The input norm and the residual.
    d_mid + norm_back(&block.input_norm, &x, &d_h1, grads)?
}
