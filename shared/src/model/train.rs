//! The training pass of a decoder: a forward that returns the final hidden states *detached*,
//! and a backward that takes their gradient and returns every parameter's.
//!
//! Splitting the pass at the hidden states lets the caller run the LM head and its loss in
//! position chunks (each chunk's `[n, V]` logits live only through its own backward) and lets
//! the decoder choose how it keeps activations:
//! - [`Activations::Keep`]: candle's autograd over the whole forward (every intermediate lives
//!   until the backward; attention keeps `[B, H, T, T]` scores). The reference.
//! - [`Activations::Checkpoint`]: the forward keeps each layer's input only; the backward
//!   recomputes one layer at a time and pulls the gradient through it. Attention runs in query
//!   blocks ([`super::flash`]) in both directions, so no `[B, H, T, T]` tensor exists and the
//!   step's memory grows linearly with the sequence.
//!
//! Training batches are right-padded (the causal mask keeps real tokens from seeing later pads),
//! so the pass takes ids only.

use super::decoder::Decoder;
use super::flash::{self, Causal};
use super::layers::Block;
use super::layers::{AttnBackend, AttnInputs, Ops};
use super::spec::LayerKind;
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

/// How a training forward keeps what its backward needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// Every intermediate, through candle's autograd (memory grows with T²).
    Keep,
    /// Each layer's input only; layers recomputed in the backward (memory linear in T, about
    /// one extra forward of compute).
    Checkpoint,
}

/// Above this many bytes of kept activations, [`Activations::auto`] checkpoints.
const AUTO_CHECKPOINT_BYTES: f64 = (1u64 << 30) as f64;

impl Activations {
    /// Checkpoint when keeping everything would hold more than 1 GiB for `b` rows of `t`
    /// tokens (see [`kept_activation_bytes`]); tiny models on short sequences keep everything
    /// (no recompute, bit-identical to earlier releases).
    pub fn auto(model: &Decoder, b: usize, t: usize) -> Activations {
        if kept_activation_bytes(model, b, t) > AUTO_CHECKPOINT_BYTES {
            Activations::Checkpoint
        } else {
            Activations::Keep
        }
    }
}

/// An estimate of the activations plain autograd keeps for `b × t` tokens: per layer and token
/// about 12 hidden-sized and 4 intermediate-sized tensors in the compute dtype (norms in f32
/// count double), plus the attention's scores, probabilities and their casts
/// (`heads × t × (2·4 + 2·dtype)` bytes per query).
pub fn kept_activation_bytes(model: &Decoder, b: usize, t: usize) -> f64 {
    let cfg = model.config();
    let el = model.dtype().size_in_bytes() as f64;
    let tokens = (b * t) as f64;
    let per_token = 12.0 * cfg.hidden_size as f64 * el
        + 4.0 * cfg.intermediate_size as f64 * el
        + cfg.num_attention_heads as f64 * t as f64 * (8.0 + 2.0 * el);
    cfg.num_hidden_layers as f64 * tokens * per_token
}

/// A forward whose backward is still to run. [`TrainPass::hidden`] is detached: compute the
/// loss from it (in chunks if you like), then call [`TrainPass::backward`] with its gradient.
pub struct TrainPass<'a> {
    model: &'a Decoder,
    hidden: Tensor,
    state: State,
}

enum State {
    /// The hidden states with their whole graph.
    Graph(Tensor),
    Checkpointed(Saved),
}

/// What a checkpointed forward keeps: the ids, each layer's input, and the final norm's own
/// small graph from a leaf at the last layer's output.
struct Saved {
    ids: Tensor,
    inputs: Vec<Tensor>,
    last: Var,
    normed: Tensor,
    /// RoPE cos/sin for full and (when any) sliding layers: [T, R/2].
    rope: [(Tensor, Tensor); 2],
}

impl Decoder {
    /// The training forward of `ids` `[B, T]` (right-padded): hidden states after the final
    /// norm, `[B, T, H]`, detached, with what [`TrainPass::backward`] needs. Needs a decoder
    /// built with [`Ops::Differentiable`].
    pub fn train_forward(&self, ids: &Tensor, act: Activations) -> Result<TrainPass<'_>> {
        if self.ops != Ops::Differentiable {
            candle_core::bail!("a training pass needs a decoder built with differentiable ops");
        }
        let state = match act {
            Activations::Keep => State::Graph(self.forward_hidden(ids, None, None, None)?),
            Activations::Checkpoint => State::Checkpointed(self.checkpointed_forward(ids)?),
        };
        let hidden = match &state {
            State::Graph(h) => h.detach(),
            State::Checkpointed(s) => s.normed.detach(),
        };
        Ok(TrainPass {
            model: self,
            hidden,
            state,
        })
    }

    /// The embedding of `ids` `[B, T]`: `[B, T, H]` (Gemma scaled by √H).
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let x = self
            .w
            .embed
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.hidden_size))?;
        match self.embed_scale {
            Some(s) => x * s,
            None => Ok(x),
        }
    }

    fn checkpointed_forward(&self, ids: &Tensor) -> Result<Saved> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {t} positions exceeds max_position_embeddings {}",
                self.cfg.max_position_embeddings
            );
        }
        let full = self.rope_slice(&self.rope_full, t, 0, t, None)?;
        let sliding = match &self.rope_sliding {
            Some(r) => self.rope_slice(r, t, 0, t, None)?,
            None => full.clone(),
        };
        let rope = [full, sliding];
        let mut x = self.embed(ids)?.detach();
        let mut inputs = Vec::with_capacity(self.w.layers.len());
        for (l, block) in self.w.layers.iter().enumerate() {
            inputs.push(x.clone());
            let (q, k, v) = self.project(l, block, &x, &rope)?;
            let c = self.causal(block, &q)?;
            let o = flash::forward(&q, &k, &v, block.attn.scale, c)?;
            x = self.after_attention(block, &x, &o)?.detach();
        }
        let last = Var::from_tensor(&x)?;
        let normed = self.w.norm.forward(last.as_tensor(), self.ops)?;
        Ok(Saved {
            ids: ids.clone(),
            inputs,
            last,
            normed,
            rope,
        })
    }

    /// Layer `l`'s input norm and q/k/v (projected, normed, rotated).
    fn project(
        &self,
        l: usize,
        block: &Block,
        x: &Tensor,
        rope: &[(Tensor, Tensor); 2],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (cos, sin) = match self.kinds[l] {
            LayerKind::Sliding => (&rope[1].0, &rope[1].1),
            LayerKind::Full => (&rope[0].0, &rope[0].1),
        };
        let inp = AttnInputs {
            cos,
            sin,
            mask: None,
            plain: false,
            backend: AttnBackend::Eager,
            ops: self.ops,
        };
        let h = block.input_norm.forward(x, self.ops)?;
        block.attn.project(&h, &inp)
    }

    /// The attention blocks for this layer's window and the shape of `q` `[B, Hq, T, D]`.
    fn causal(&self, block: &Block, q: &Tensor) -> Result<Causal> {
        let (b, h, t, _) = q.dims4()?;
        Ok(Causal::for_shape(b, h, t, block.attn.window))
    }

    /// The rest of a block after the attention core: `o_proj`, Gemma's post-attention norm, the
    /// residual, then the feed-forward half. `x` is the block's input, `o` `[B, Hq, T, D]`.
    fn after_attention(&self, block: &Block, x: &Tensor, o: &Tensor) -> Result<Tensor> {
        let mut h = block.attn.output(o, self.ops)?;
        if let Some(n) = &block.post_attn_norm {
            h = n.forward(&h, self.ops)?;
        }
        let x = (x + h)?;
        let mut h = block.ffn_norm.forward(&x, self.ops)?;
        h = block.ffn.forward(&h, self.ops)?;
        if let Some(n) = &block.post_ffn_norm {
            h = n.forward(&h, self.ops)?;
        }
        x + h
    }
}

impl TrainPass<'_> {
    /// The hidden states after the final norm, `[B, T, H]`, detached.
    pub fn hidden(&self) -> &Tensor {
        &self.hidden
    }

    /// The gradients of every parameter reached from the hidden states, given their gradient
    /// `grad` `[B, T, H]` (the loss's). Keyed as `Tensor::backward`'s are (by the master
    /// `Var`s when the decoder reads them through a cast).
    pub fn backward(self, grad: &Tensor) -> Result<GradStore> {
        match self.state {
            State::Graph(h) => pull(&h, grad),
            State::Checkpointed(saved) => self.model.checkpointed_backward(saved, grad),
        }
    }
}

/// The gradients of `Σ out ∘ grad` (detached `grad`): what `out`'s graph receives when `grad` is
/// the gradient arriving at `out`.
fn pull(out: &Tensor, grad: &Tensor) -> Result<GradStore> {
    let grad = grad.detach().to_dtype(out.dtype())?;
    (out * grad)?.sum_all()?.backward()
}

/// The parameters' entries of `g`: vectors and matrices. candle's `backward` also returns
/// gradients for constant operands (RoPE tables broadcast to `[1, 1, T, D]`), each under its own
/// key; summed over the layers they would grow with the sequence for nothing.
fn params_only(g: GradStore) -> GradStore {
    let mut out = GradStore::default();
    let ids: Vec<_> = g.get_ids().copied().collect();
    for id in ids {
        if let Some(t) = g.get_id(id).filter(|t| t.rank() <= 2) {
            out.insert_id(id, t.clone());
        }
    }
    out
}

/// Removes and returns the gradient of leaf `v` from `g` (zeros if nothing reached it).
fn take(g: &mut GradStore, v: &Var) -> Result<Tensor> {
    match g.remove(v.as_tensor()) {
        Some(t) => Ok(t),
        None => v.as_tensor().zeros_like(),
    }
}

impl Decoder {
    fn checkpointed_backward(&self, s: Saved, grad: &Tensor) -> Result<GradStore> {
        // 1. Final norm: its weight's gradient, and the gradient at the last layer's output.
        let mut total = pull(&s.normed, grad)?;
        let mut g = take(&mut total, &s.last)?;
        drop(s.normed);
        // 2. Layers in reverse, each recomputed from its input.
        for (l, block) in self.w.layers.iter().enumerate().rev() {
            let x = Var::from_tensor(&s.inputs[l])?;
            let (q, k, v) = self.project(l, block, x.as_tensor(), &s.rope)?;
            let c = self.causal(block, &q)?;
            // 2a. The block after the attention core, from the core's output as a leaf.
            let o = Var::from_tensor(&flash::forward(&q, &k, &v, block.attn.scale, c)?)?;
            let mut after = pull(
                &self.after_attention(block, x.as_tensor(), o.as_tensor())?,
                &g,
            )?;
            let (dout, gx_residual) = (take(&mut after, &o)?, take(&mut after, &x)?);
            // 2b. The attention core by hand, then the projections through autograd.
            let (dq, dk, dv) = flash::backward(&q, &k, &v, &dout, block.attn.scale, c)?;
            let surrogate = ((&q * dq)?.sum_all()? + (&k * dk)?.sum_all()?)?;
            let mut before = (surrogate + (&v * dv)?.sum_all()?)?.backward()?;
            g = (gx_residual + take(&mut before, &x)?)?;
            total.extend(params_only(after))?;
            total.extend(params_only(before))?;
        }
        // 3. The embedding (for tied heads the caller adds the head's own gradient).
        let embedded = self.embed(&s.ids)?;
        total.extend(pull(&embedded, &g)?)?;
        Ok(total)
    }
}
