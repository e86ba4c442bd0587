//! The training pass of a decoder: a forward that returns the final hidden states *detached*,
//! and a backward that takes their gradient and returns every parameter's.
//!
//! Splitting the pass at the hidden states lets the caller run the LM head and its loss in
//! position chunks (each chunk's `[n, V]` logits live only through its own backward) and lets
//! the decoder choose how it keeps activations:
//! - [`Activations::Keep`]: candle's autograd over the whole forward (every intermediate lives
//!   until the backward; attention keeps `[B, H, T, T]` scores). The reference.
//! - [`Activations::Selective`]: every layer's graph except the attention core's (Megatron's
//!   selective recomputation): the projections, norms, MLP and their intermediates are kept; the
//!   attention core ([`super::train_attention`]: cuDNN's fused kernel, or blockwise) keeps no
//!   probabilities and its backward recomputes them. No GEMM is recomputed and no `[B, H, T, T]`
//!   tensor exists: memory is linear in the sequence, about a sixth of [`Activations::Keep`]'s
//!   per token for Qwen3-0.6B at 1k positions (estimated, [`ActivationBytes`]).
//! - [`Activations::Checkpoint`]: the forward keeps each layer's input only; the backward
//!   recomputes one layer at a time and pulls the gradient through it, its attention core as
//!   above. The least memory, about one extra forward of compute.
//!
//! Selective and Checkpoint run the same ops in the same order, so their hidden states and
//! gradients are the same bits; Keep's equal them within rounding. Where the fused layer ops
//! run ([`Decoder::trains_by_hand`]: on CUDA with the project's kernels), both run each layer by
//! hand ([`super::train_layer`]): a forward that records a tape, a backward that writes each
//! gradient once, no autograd graph; the embedding's gradient by one matmul and one gather
//! ([`super::embed_grad`]), the final norm's through autograd. Where the fused attention
//! runs, Keep runs as Selective: the fused kernel keeps only its softmax statistics, so keeping
//! everything else is what "keep" can mean there (as PyTorch eager with SDPA).
//!
//! Training batches are right-padded (the causal mask keeps real tokens from seeing later pads),
//! so the pass takes ids only.

use super::decoder::Decoder;
use super::embed_grad::embedding_grad;
use super::layers::Block;
use super::layers::{AttnBackend, AttnInputs, Ops};
use super::spec::LayerKind;
use super::train_attention::{self, Core, Saved as CoreSaved};
use super::train_layer::{self, Tape};
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

/// How a training forward keeps what its backward needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// Every intermediate, through candle's autograd (memory grows with T²).
    Keep,
    /// Every intermediate except the attention core's, recomputed block by block in the
    /// backward (memory linear in T, no GEMM recomputed).
    Selective,
    /// Each layer's input only; layers recomputed in the backward (memory linear in T, about
    /// one extra forward of compute).
    Checkpoint,
}

/// Up to this many positions per sequence, [`Activations::auto`] keeps everything (where it
/// fits): the plain pass is the fastest there. Beyond, selective is faster as well as smaller
/// (on the CPU, a 4-layer Qwen3-shaped student: 0.22 vs 0.25 s at 128 positions, 0.61 vs 0.35 s
/// at 256, 3.4 vs 1.6 s at 1024; bench/README.md).
pub const KEEP_MAX_POSITIONS: usize = 128;

impl Activations {
    /// The fastest way whose activations fit `budget` bytes for `b` rows of `t` tokens
    /// ([`ActivationBytes`]): keep everything for short sequences
    /// ([`KEEP_MAX_POSITIONS`]), else selective, else checkpoint.
    pub fn auto(model: &Decoder, b: usize, t: usize, budget: f64) -> Activations {
        let need = ActivationBytes::of(model, b, t);
        if t <= KEEP_MAX_POSITIONS && need.keep <= budget {
            Activations::Keep
        } else if need.selective <= budget {
            Activations::Selective
        } else {
            Activations::Checkpoint
        }
    }

    /// `keep`, `selective` or `checkpoint`: how logs and benchmarks name it.
    pub fn name(self) -> &'static str {
        match self {
            Activations::Keep => "keep",
            Activations::Selective => "selective",
            Activations::Checkpoint => "checkpoint",
        }
    }
}

/// Estimated bytes each way of keeping activations holds for one micro-batch, from the model's
/// shape: per layer and token, a layer's graph of about 14 hidden-sized, 8 attention-sized (q,
/// k and v with their norms and rotations) and 5 intermediate-sized tensors in the compute
/// dtype, plus with [`Activations::Keep`] the attention's scores, probabilities, their casts and
/// the mask's broadcast (40 bytes per head, query and key). [`Activations::Checkpoint`] keeps
/// one hidden-sized tensor per layer and token, and one layer's graph while it recomputes.
/// Fitted to the peak memory of the CPU's f32 passes at 1k to 4k positions (bench/README.md):
/// selective's 180 MiB per 1k positions against 175–180 measured; keep's slope 11–35 % above
/// the measured one (an overestimate only makes auto choose the smaller way).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationBytes {
    pub keep: f64,
    pub selective: f64,
    pub checkpoint: f64,
}

impl ActivationBytes {
    pub fn of(model: &Decoder, b: usize, t: usize) -> ActivationBytes {
        let cfg = model.config();
        let el = model.dtype().size_in_bytes() as f64;
        let tokens = (b * t) as f64;
        let layers = cfg.num_hidden_layers as f64;
        let head_dim = cfg.head_dim() as f64;
        let attn_width = (cfg.num_attention_heads + 2 * cfg.kv_heads()) as f64 * head_dim;
        let layer_graph = 14.0 * cfg.hidden_size as f64 * el
            + 8.0 * attn_width * el
            + 5.0 * cfg.intermediate_size as f64 * el;
        let scores = cfg.num_attention_heads as f64 * t as f64 * 40.0;
        ActivationBytes {
            keep: layers * tokens * (layer_graph + scores),
            selective: layers * tokens * layer_graph,
            checkpoint: tokens * (layers * cfg.hidden_size as f64 * el + layer_graph),
        }
    }
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
    Selective(Kept),
    /// Selective with the layers by hand ([`super::train_layer`]).
    Taped(Taped),
    Checkpointed(Saved),
}

/// What a selective forward keeps of one layer: its input and the attention core's output as
/// leaves, and the graphs between them: `q`, `k`, `v` `[B, H, T, D]` from the input (through
/// the norm and projections), and the layer's output from both leaves; and what the core's
/// backward needs.
struct KeptLayer {
    input: Var,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    core: Var,
    saved: CoreSaved,
    output: Tensor,
}

/// What a selective forward keeps: the ids, every layer's graphs, and the final norm's.
struct Kept {
    ids: Tensor,
    layers: Vec<KeptLayer>,
    last: Var,
    normed: Tensor,
}

/// What a selective forward by hand keeps: the ids, every layer's tape, and the final norm's
/// own small graph from a leaf at the last layer's output.
struct Taped {
    ids: Tensor,
    tapes: Vec<Tape>,
    last: Var,
    normed: Tensor,
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
    /// Whether the layers run by hand ([`super::train_layer`]).
    by_hand: bool,
}

impl Decoder {
    /// The training forward of `ids` `[B, T]` (right-padded): hidden states after the final
    /// norm, `[B, T, H]`, detached, with what [`TrainPass::backward`] needs. Needs a decoder
    /// built with [`Ops::Differentiable`].
    pub fn train_forward(&self, ids: &Tensor, act: Activations) -> Result<TrainPass<'_>> {
        if self.ops != Ops::Differentiable {
            candle_core::bail!("a training pass needs a decoder built with differentiable ops");
        }
        let (act, by_hand) = self.train_plan(act);
        let state = match act {
            Activations::Keep => State::Graph(self.forward_hidden(ids, None, None, None)?),
            Activations::Selective if by_hand => State::Taped(self.taped_forward(ids)?),
            Activations::Selective => State::Selective(self.selective_forward(ids)?),
            Activations::Checkpoint => {
                State::Checkpointed(self.checkpointed_forward(ids, by_hand)?)
            }
        };
        let hidden = match &state {
            State::Graph(h) => h.detach(),
            State::Selective(k) => k.normed.detach(),
            State::Taped(k) => k.normed.detach(),
            State::Checkpointed(s) => s.normed.detach(),
        };
        Ok(TrainPass {
            model: self,
            hidden,
            state,
        })
    }

    /// How a training pass asked for `act` runs: the way it keeps activations (keep runs as
    /// selective where the fused attention runs, see the module) and whether its layers run by
    /// hand ([`Decoder::trains_by_hand`]; the whole graph of keep never does).
    pub fn train_plan(&self, act: Activations) -> (Activations, bool) {
        let fused =
            train_attention::fused(self.attn, self.device(), self.dtype(), self.cfg.head_dim());
        let act = match act {
            Activations::Keep if fused => Activations::Selective,
            act => act,
        };
        (act, act != Activations::Keep && self.trains_by_hand())
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

    /// RoPE cos/sin `[T, R/2]` for the full and (when any) sliding layers of `ids` `[B, T]`.
    fn train_rope(&self, ids: &Tensor) -> Result<[(Tensor, Tensor); 2]> {
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
        Ok([full, sliding])
    }

    fn selective_forward(&self, ids: &Tensor) -> Result<Kept> {
        let rope = self.train_rope(ids)?;
        let mut x = self.embed(ids)?.detach();
        let mut layers = Vec::with_capacity(self.w.layers.len());
        for (l, block) in self.w.layers.iter().enumerate() {
            let input = Var::from_tensor(&x)?;
            let (q, k, v) = self.project(l, block, input.as_tensor(), &rope)?;
            let (core, saved) = self.core_forward(block, &q, &k, &v)?;
            let output = self.after_attention(block, input.as_tensor(), core.as_tensor())?;
            x = output.detach();
            layers.push(KeptLayer {
                input,
                q,
                k,
                v,
                core,
                saved,
                output,
            });
        }
        let last = Var::from_tensor(&x)?;
        let normed = self.w.norm.forward(last.as_tensor(), self.ops)?;
        Ok(Kept {
            ids: ids.clone(),
            layers,
            last,
            normed,
        })
    }

    fn taped_forward(&self, ids: &Tensor) -> Result<Taped> {
        let rope = self.train_rope(ids)?;
        let mut x = self.embed(ids)?.detach();
        let mut tapes = Vec::with_capacity(self.w.layers.len());
        for (l, block) in self.w.layers.iter().enumerate() {
            let (y, tape) = self.tape_forward(l, block, &x, &rope)?;
            tapes.push(tape);
            x = y;
        }
        let last = Var::from_tensor(&x)?;
        let normed = self.w.norm.forward(last.as_tensor(), self.ops)?;
        Ok(Taped {
            ids: ids.clone(),
            tapes,
            last,
            normed,
        })
    }

    fn checkpointed_forward(&self, ids: &Tensor, by_hand: bool) -> Result<Saved> {
        let rope = self.train_rope(ids)?;
        let mut x = self.embed(ids)?.detach();
        let mut inputs = Vec::with_capacity(self.w.layers.len());
        for (l, block) in self.w.layers.iter().enumerate() {
            inputs.push(x.clone());
            x = if by_hand {
                self.tape_forward(l, block, &x, &rope)?.0
            } else {
                let (q, k, v) = self.project(l, block, &x, &rope)?;
                let (o, _) = train_attention::forward(&q, &k, &v, self.core(block))?;
                self.after_attention(block, &x, &o)?.detach()
            };
        }
        let last = Var::from_tensor(&x)?;
        let normed = self.w.norm.forward(last.as_tensor(), self.ops)?;
        Ok(Saved {
            ids: ids.clone(),
            inputs,
            last,
            normed,
            rope,
            by_hand,
        })
    }

    /// Layer `l`'s input norm and q/k/v (projected, normed, rotated).
    pub(super) fn project(
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

    /// The attention core of `block` as this decoder runs it.
    fn core(&self, block: &Block) -> Core {
        Core {
            backend: self.attn,
            scale: block.attn.scale,
            window: block.attn.window,
        }
    }

    /// The layer's attention core over `q` `[B, Hq, T, D]`, `k`, `v` `[B, Hkv, T, D]`: its
    /// output as a leaf (where the gradient of the rest of the block arrives) and what its
    /// backward needs.
    fn core_forward(
        &self,
        block: &Block,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Var, CoreSaved)> {
        let (out, saved) = train_attention::forward(q, k, v, self.core(block))?;
        Ok((Var::from_tensor(&out)?, saved))
    }

    /// The rest of a block after the attention core: `o_proj`, Gemma's post-attention norm, the
    /// residual, then the feed-forward half. `x` is the block's input, `o` `[B, Hq, T, D]`.
    pub(super) fn after_attention(&self, block: &Block, x: &Tensor, o: &Tensor) -> Result<Tensor> {
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
        self.backward_with(grad, &mut |_| Ok(()))
    }

    /// [`TrainPass::backward`], calling `after_layer` with the gradients gathered so far after
    /// each decoder layer's backward (the final norm's and the layers' from the last down): it
    /// may take entries out (a caller summing each layer's gradients into its own buffers as
    /// they come, so that a layer's are freed before the next layer's exist). The embedding's
    /// gradient comes after the last call. A pass through one autograd graph (everything kept)
    /// gathers every gradient at once and never calls it.
    pub fn backward_with(self, grad: &Tensor, after_layer: AfterLayer<'_>) -> Result<GradStore> {
        match self.state {
            State::Graph(h) => pull(&h, grad),
            State::Selective(kept) => self.model.selective_backward(kept, grad, after_layer),
            State::Taped(taped) => self.model.taped_backward(taped, grad, after_layer),
            State::Checkpointed(saved) => {
                self.model.checkpointed_backward(saved, grad, after_layer)
            }
        }
    }
}

/// What [`TrainPass::backward_with`] calls after each layer: the gradients gathered so far.
pub type AfterLayer<'a> = &'a mut dyn FnMut(&mut GradStore) -> Result<()>;

/// What `out`'s graph receives when `grad` is the gradient arriving at `out`
/// ([`super::autograd::seed`]).
fn pull(out: &Tensor, grad: &Tensor) -> Result<GradStore> {
    super::autograd::seed(&[(out, grad)])
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
    fn selective_backward(
        &self,
        kept: Kept,
        grad: &Tensor,
        after_layer: AfterLayer<'_>,
    ) -> Result<GradStore> {
        // 1. Final norm: its weight's gradient, and the gradient at the last layer's output.
        let mut total = pull(&kept.normed, grad)?;
        let mut g = take(&mut total, &kept.last)?;
        drop(kept.normed);
        // 2. Layers in reverse from their kept graphs, each dropped once its gradient is out.
        let blocks = self.w.layers.iter().rev();
        for (block, layer) in blocks.zip(kept.layers.into_iter().rev()) {
            g = layer_backward(block, &layer, &g, &mut total)?;
            after_layer(&mut total)?;
        }
        // 3. The embedding (for tied heads the caller adds the head's own gradient).
        let embedded = self.embed(&kept.ids)?;
        total.extend(pull(&embedded, &g)?)?;
        Ok(total)
    }

    fn taped_backward(
        &self,
        kept: Taped,
        grad: &Tensor,
        after_layer: AfterLayer<'_>,
    ) -> Result<GradStore> {
        let ids = host_ids(&kept.ids)?;
        // 1. Final norm: its weight's gradient, and the gradient at the last layer's output.
        let mut total = pull(&kept.normed, grad)?;
        let mut g = take(&mut total, &kept.last)?;
        drop(kept.normed);
        // 2. Layers in reverse by hand, each tape dropped once read.
        let blocks = self.w.layers.iter().rev();
        for (block, tape) in blocks.zip(kept.tapes.into_iter().rev()) {
            g = train_layer::backward(block, tape, &g, &mut total)?;
            after_layer(&mut total)?;
        }
        // 3. The embedding (for tied heads the caller adds the head's own gradient).
        self.embed_backward(&ids, &g, &mut total)?;
        Ok(total)
    }

    /// The embedding's gradient by hand ([`embedding_grad`]) from `g` `[B, T, H]` at its
    /// output, added to `total`.
    fn embed_backward(&self, ids: &[u32], g: &Tensor, total: &mut GradStore) -> Result<()> {
        let g = match self.embed_scale {
            Some(s) => (g * s)?,
            None => g.clone(),
        };
        let h = self.cfg.hidden_size;
        let d = embedding_grad(ids, &g.reshape(((), h))?, self.w.embed.dim(0)?)?;
        train_layer::add_grad(total, &self.w.embed, d)
    }

    fn checkpointed_backward(
        &self,
        s: Saved,
        grad: &Tensor,
        after_layer: AfterLayer<'_>,
    ) -> Result<GradStore> {
        let ids = if s.by_hand {
            Some(host_ids(&s.ids)?)
        } else {
            None
        };
        // 1. Final norm: its weight's gradient, and the gradient at the last layer's output.
        let mut total = pull(&s.normed, grad)?;
        let mut g = take(&mut total, &s.last)?;
        drop(s.normed);
        // 2. Layers in reverse, each recomputed from its input.
        for (l, block) in self.w.layers.iter().enumerate().rev() {
            if s.by_hand {
                let (_, tape) = self.tape_forward(l, block, &s.inputs[l], &s.rope)?;
                g = train_layer::backward(block, tape, &g, &mut total)?;
                after_layer(&mut total)?;
                continue;
            }
            let input = Var::from_tensor(&s.inputs[l])?;
            let (q, k, v) = self.project(l, block, input.as_tensor(), &s.rope)?;
            let (core, saved) = self.core_forward(block, &q, &k, &v)?;
            let output = self.after_attention(block, input.as_tensor(), core.as_tensor())?;
            let layer = KeptLayer {
                input,
                q,
                k,
                v,
                core,
                saved,
                output,
            };
            g = layer_backward(block, &layer, &g, &mut total)?;
            after_layer(&mut total)?;
        }
        // 3. The embedding (for tied heads the caller adds the head's own gradient).
        match ids {
            Some(ids) => self.embed_backward(&ids, &g, &mut total)?,
            None => total.extend(pull(&self.embed(&s.ids)?, &g)?)?,
        }
        Ok(total)
    }
}

/// `ids` `[B, T]` on the host, flattened. Read where a backward starts: the step has just
/// waited for its loss figures there, so the copy waits for nothing more.
fn host_ids(ids: &Tensor) -> Result<Vec<u32>> {
    ids.flatten_all()?.to_vec1::<u32>()
}

/// One layer's backward from its graphs, given the gradient `g` at its output: the
/// parameters' gradients go into `total`; returns the gradient at the layer's input.
fn layer_backward(
    block: &Block,
    layer: &KeptLayer,
    g: &Tensor,
    total: &mut GradStore,
) -> Result<Tensor> {
    // 1. The block after the attention core, from the core's output as a leaf.
    let mut after = pull(&layer.output, g)?;
    let dout = take(&mut after, &layer.core)?;
    let gx_residual = take(&mut after, &layer.input)?;
    // 2. The attention core by hand (its probabilities recomputed), then the norm and
    //    projections through autograd.
    let (q, k, v) = (&layer.q, &layer.k, &layer.v);
    let core = layer.core.as_tensor();
    let (dq, dk, dv) =
        train_attention::backward(&layer.saved, (q, k, v), core, &dout, block.attn.scale)?;
    let mut before = super::autograd::seed(&[(q, &dq), (k, &dk), (v, &dv)])?;
    let gx = (gx_residual + take(&mut before, &layer.input)?)?;
    total.extend(params_only(after))?;
    total.extend(params_only(before))?;
    Ok(gx)
}
