//! Several sequences in one forward, each row computed as the sequence alone would compute it:
//! the teacher's batch-invariant mode without one forward per sequence (issue 46 item 2).
//!
//! The sequences' positions are concatenated into rows `[P, H]`. Everything but attention is
//! row-wise (embedding, norms, RoPE with each row's own position and table, projections, MLP,
//! residuals), so it runs over the rows of all sequences at once; attention runs per sequence
//! over its own rows (causal, its window), exactly as the sequence's own forward. What could
//! make a row depend on its neighbours is a matmul whose kernel is chosen by the number of rows
//! (split-K, tile shapes: cuBLAS picks by M). So every matmul here multiplies blocks of exactly
//! `rows_per_gemm` rows (the last block padded with zero rows): the same shapes, the same
//! kernels, whatever the batch — invariant by construction, not by luck. On the CPU the linear
//! kernel is row-independent anyway ([`crate::matmul`]), so a packed row equals the row of the
//! sequence's own forward bit for bit (tested).
//!
//! The layers run their own code over all rows at once ([`Decoder::project`],
//! [`Decoder::after_attention`]: each norm, RoPE, activation and residual one launch for the
//! batch); only the linear layers see the blocks, through a scope of this thread
//! ([`super::gemm_blocks`]):
//! on CUDA one cuBLAS GEMM per block into one output (`xdistill_cuda_kernels::gemm_nt_blocks`),
//! elsewhere the layer's own matmul per block. Until 2026-11-30 the whole layer ran block by
//! block, about 100 launches a layer at 4 blocks (the packed forward took 1.8× the padded
//! one's time on an H200 for the same rows: host-bound).
//!
//! Not packed: sparse MoE layers (each token's experts see a varying number of rows) and
//! quantized weights (candle's quantized kernels pick by rows on a GPU): [`Decoder::packs`].

use super::decoder::{attention_bias, Decoder};
use super::gemm_blocks::GemmRows;
use super::layers::{Ffn, Ops};
use super::spec::LayerKind;
use candle_core::{Result, Tensor};
/// Rows per matmul of a packed forward by default: large enough for efficient GEMMs on a GPU,
/// small enough that a short batch wastes little on padding.
pub const PACKED_ROWS: usize = 1024;

/// One sequence of a packed forward.
#[derive(Debug, Clone, Copy)]
pub struct PackedSeq<'a> {
    /// The positions to run (from position 0).
    pub ids: &'a [u32],
    /// The sequence's whole length (length-dependent RoPE, e.g. LongRoPE, chooses by it), at
    /// least `ids.len()`.
    pub total: usize,
}

impl Decoder {
    /// Whether [`Decoder::forward_packed`] can run this model: serving ops, dense MLPs and
    /// dense weights.
    pub fn packs(&self) -> bool {
        self.ops == Ops::Fused
            && self.w.layers.iter().all(|b| match &b.ffn {
                Ffn::Dense(mlp) => {
                    b.attn.linears().iter().all(|l| !l.is_quantized())
                        && mlp.linears().iter().all(|l| !l.is_quantized())
                }
                Ffn::Moe(_) => false,
            })
    }

    /// Hidden states after the final norm of `seqs`, their rows concatenated: `[Σ len, H]`,
    /// each sequence's rows what [`Decoder::forward_hidden`] gives it alone (on the CPU, the
    /// same bits). Every matmul takes blocks of `rows_per_gemm` rows.
    pub fn forward_packed(&self, seqs: &[PackedSeq<'_>], rows_per_gemm: usize) -> Result<Tensor> {
        if !self.packs() {
            candle_core::bail!("this model does not pack (sparse MoE, quantized or training ops)");
        }
        let m0 = rows_per_gemm.max(1);
        let mut starts = Vec::with_capacity(seqs.len());
        let mut p = 0;
        for s in seqs {
            let n = s.ids.len();
            if n == 0 || s.total < n || s.total > self.cfg.max_position_embeddings {
                candle_core::bail!(
                    "packed sequence of {n} positions of {} (max_position_embeddings {})",
                    s.total,
                    self.cfg.max_position_embeddings
                );
            }
            starts.push(p);
            p += n;
        }
        let padded = p.div_ceil(m0) * m0;
        let dev = &self.device;
        let h = self.cfg.hidden_size;
        // Each row's cos/sin from its own sequence's table: [1, P', R/2] (padding rows zero).
        let tables = |rope| -> Result<(Tensor, Tensor)> {
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for s in seqs {
                let (c, si) = self.rope_slice(rope, s.total, 0, s.ids.len(), None)?;
                cos.push(c);
                sin.push(si);
            }
            let pad = |parts: &mut Vec<Tensor>| -> Result<Tensor> {
                if padded > p {
                    let half = parts[0].dim(1)?;
                    parts.push(Tensor::zeros((padded - p, half), parts[0].dtype(), dev)?);
                }
                Tensor::cat(parts, 0)?.unsqueeze(0)
            };
            Ok((pad(&mut cos)?, pad(&mut sin)?))
        };
        let full = tables(&self.rope_full)?;
        let sliding = match &self.rope_sliding {
            Some(r) => tables(r)?,
            None => full.clone(),
        };
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.ids.iter().copied()).collect();
        let mut x = self
            .w
            .embed
            .index_select(&Tensor::from_vec(ids, p, dev)?, 0)?; // [P, H]
        if let Some(s) = self.embed_scale {
            x = (x * s)?;
        }
        if padded > p {
            x = Tensor::cat(&[&x, &Tensor::zeros((padded - p, h), x.dtype(), dev)?], 0)?;
        }
        // Every linear layer below multiplies blocks of exactly `m0` rows; everything else
        // runs once over all rows (row-wise ops: one launch each, whatever the block count).
        let _blocks = GemmRows::set(m0);
        let mut x = x.unsqueeze(0)?; // [1, P', H]
        for (l, layer) in self.w.layers.iter().enumerate() {
            let rope = match self.kinds[l] {
                LayerKind::Sliding => &sliding,
                LayerKind::Full => &full,
            };
            // 1. Norm, q/k/v (q/k norms, RoPE): [1, H, P', D] each.
            let (q, k, v) = self.project(l, layer, &x, &[rope.clone(), rope.clone()])?;
            // 2. Attention per sequence, over its own rows, put together as [1, P', Hq, D].
            let mut outs = Vec::with_capacity(seqs.len() + 1);
            for (s, &at) in seqs.iter().zip(&starts) {
                let n = s.ids.len();
                let (qs, ks, vs) = (
                    q.narrow(2, at, n)?,
                    k.narrow(2, at, n)?,
                    v.narrow(2, at, n)?,
                );
                outs.push(self.packed_core(l, &qs, &ks, &vs)?.transpose(1, 2)?);
            }
            if padded > p {
                let (_, hq, _, d) = q.dims4()?;
                outs.push(Tensor::zeros((1, padded - p, hq, d), q.dtype(), dev)?);
            }
            // [1, Hq, P', D] as a view of the rows' layout: o_proj reads it with no copy.
            let o = Tensor::cat(&outs, 1)?.transpose(1, 2)?;
            // 3. o_proj, residual, MLP.
            x = self.after_attention(layer, &x, &o)?;
        }
        self.w
            .norm
            .forward(&x.squeeze(0)?, self.ops)?
            .narrow(0, 0, p)
    }

    /// Layer `l`'s attention core over one sequence's `q` [1, Hq, n, D], `k`, `v` [1, Hkv, n, D]
    /// (causal, the layer's window) → [1, Hq, n, D]: cuDNN's fused kernel where the sequence's
    /// own forward would take it, else the eager attention with the same mask.
    fn packed_core(&self, l: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let attn = &self.w.layers[l].attn;
        let n = q.dim(2)?;
        #[cfg(feature = "cuda")]
        if self.attn == super::layers::AttnBackend::Cudnn
            && n > 1
            && attn.head_dim.is_multiple_of(8)
            && attn.head_dim <= 256
            && super::attn_cudnn::cudnn_ready(q.device(), q.dtype())
        {
            let params = xdistill_cudnn::Params {
                scale: attn.scale as f32,
                causal: xdistill_cudnn::Causal::TopLeft,
                window: attn.window,
            };
            if let Some(out) = super::attn_cudnn::sdpa_or_eager(q, k, v, params)? {
                return out.transpose(1, 2); // [1, Hq, n, D]
            }
        }
        let mask = attention_bias(1, n, 0, None, attn.window, &self.device)?;
        attn.core(q, k, v, mask.as_ref(), self.ops)
    }
}
