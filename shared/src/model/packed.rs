//! Several sequences in one forward, each row computed as the sequence alone would compute it:
//! the teacher's batch-invariant mode without one forward per sequence (issue 46 item 2).
//!
//! The sequences' positions are concatenated into rows `[P, H]`, each sequence's first row on a
//! multiple of the attention's bucket ([`super::attn_rows`]: cuDNN then reads whole buckets, one
//! graph per bucket; the gap rows after a sequence are computed like any row and dropped).
//! Everything but attention is row-wise (embedding, norms, RoPE with each row's own position and
//! table, projections, MLP, residuals), so it runs over the rows of all sequences at once;
//! attention runs per sequence over its own rows (causal, its window), exactly as the
//! sequence's own forward. What could
//! make a row depend on its neighbours is a matmul whose kernel is chosen by the number of rows
//! (split-K, tile shapes: cuBLAS picks by M). So every matmul here multiplies blocks of exactly
//! `rows_per_gemm` rows (the last block padded): the same shapes, the same
//! kernels, whatever the batch — invariant by construction, not by luck. On the CPU the linear
//! kernel is row-independent anyway ([`xdistill_cpu_kernels::matmul`]), so a packed row equals the row of the
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

use super::attn_rows::{attention_bucket, bucketed};
use super::decoder::{attention_bias, Decoder};
use super::gemm_blocks::GemmRows;
use super::layers::{Ffn, Ops};
use super::spec::LayerKind;
use candle_core::{Result, Tensor};
/// Rows per matmul of a packed forward by default: large enough for efficient GEMMs on a GPU,
/// small enough that a short batch wastes little on padding.
pub const PACKED_ROWS: usize = 1024;

/// Where a packed forward's sequences lie among its rows.
struct Layout<'a> {
    seqs: &'a [PackedSeq<'a>],
    /// Each sequence's first row (a multiple of `bucket`).
    starts: &'a [usize],
    bucket: usize,
    /// All rows, the padding of the last matmul block included.
    padded: usize,
}

impl Layout<'_> {
    /// The rows the sequences take, their gap rows included.
    fn used(&self) -> usize {
        self.seqs
            .iter()
            .map(|s| bucketed(s.ids.len(), self.bucket))
            .sum()
    }
}

/// Appends `rows` zero rows `[1, rows, Hq, D]` (of `like`'s dtype and device) to `outs`.
fn push_zeros(
    outs: &mut Vec<Tensor>,
    rows: usize,
    (hq, d): (usize, usize),
    like: &Tensor,
) -> Result<()> {
    if rows > 0 {
        outs.push(Tensor::zeros(
            (1, rows, hq, d),
            like.dtype(),
            like.device(),
        )?);
    }
    Ok(())
}

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
    ///
    /// Each sequence's rows start on a bucket boundary ([`attention_bucket`]): a sequence of
    /// `n` rows takes `bucketed(n)`, the rows after its own (gap rows: token 0 with zero RoPE
    /// tables) computed like any row and dropped at the end. So the fused attention reads each
    /// sequence as whole buckets (one graph per bucket, not per length; `attn_rows.rs`) from
    /// its own rows only, and a sequence's bytes still depend on nothing but itself.
    pub fn forward_packed(&self, seqs: &[PackedSeq<'_>], rows_per_gemm: usize) -> Result<Tensor> {
        if !self.packs() {
            candle_core::bail!("this model does not pack (sparse MoE, quantized or training ops)");
        }
        let m0 = rows_per_gemm.max(1);
        let bucket = attention_bucket();
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
            p += bucketed(n, bucket);
        }
        let padded = p.div_ceil(m0) * m0;
        let dev = &self.device;
        // Each row's cos/sin from its own sequence's table: [1, P', R/2] (gap and padding
        // rows zero).
        let tables = |rope| -> Result<(Tensor, Tensor)> {
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            let zeros = |rows: usize, like: &Tensor| -> Result<Option<Tensor>> {
                match rows {
                    0 => Ok(None),
                    _ => Ok(Some(Tensor::zeros(
                        (rows, like.dim(1)?),
                        like.dtype(),
                        dev,
                    )?)),
                }
            };
            let mut last = None;
            for s in seqs {
                let n = s.ids.len();
                let (c, si) = self.rope_slice(rope, s.total, 0, n, None)?;
                let gap = zeros(bucketed(n, bucket) - n, &c)?;
                cos.push(c.clone());
                sin.push(si);
                cos.extend(gap.clone());
                sin.extend(gap);
                last = Some(c);
            }
            if let Some(tail) = last.map(|c| zeros(padded - p, &c)).transpose()?.flatten() {
                cos.push(tail.clone());
                sin.push(tail);
            }
            Ok((
                Tensor::cat(&cos, 0)?.unsqueeze(0)?,
                Tensor::cat(&sin, 0)?.unsqueeze(0)?,
            ))
        };
        let full = tables(&self.rope_full)?;
        let sliding = match &self.rope_sliding {
            Some(r) => tables(r)?,
            None => full.clone(),
        };
        // The rows' tokens: each sequence's, then token 0 in its gap rows and the padding.
        let mut ids = vec![0u32; padded];
        let mut real = Vec::with_capacity(seqs.iter().map(|s| s.ids.len()).sum());
        for (s, &at) in seqs.iter().zip(&starts) {
            ids[at..at + s.ids.len()].copy_from_slice(s.ids);
            real.extend((at..at + s.ids.len()).map(|r| r as u32));
        }
        let mut x = self
            .w
            .embed
            .index_select(&Tensor::from_vec(ids, padded, dev)?, 0)?; // [P', H]
        if let Some(s) = self.embed_scale {
            x = (x * s)?;
        }
        // Every linear layer below multiplies blocks of exactly `m0` rows; everything else
        // runs once over all rows (row-wise ops: one launch each, whatever the block count).
        let _blocks = GemmRows::set(m0);
        let mut x = x.unsqueeze(0)?; // [1, P', H]
        let layout = Layout {
            seqs,
            starts: &starts,
            bucket,
            padded,
        };
        for (l, layer) in self.w.layers.iter().enumerate() {
            let rope = match self.kinds[l] {
                LayerKind::Sliding => &sliding,
                LayerKind::Full => &full,
            };
            // [1, Hq, P', D] (a view of the rows' layout: o_proj reads it with no copy).
            let o = match self.packed_attention_cudnn(l, &x, rope, &layout)? {
                Some(o) => o,
                None => self.packed_attention(l, &x, rope, &layout)?,
            };
            // o_proj, residual, MLP.
            x = self.after_attention(layer, &x, &o)?;
        }
        let x = self.w.norm.forward(&x.squeeze(0)?, self.ops)?;
        let n = real.len();
        x.index_select(&Tensor::from_vec(real, n, dev)?, 0)
    }

    /// Layer `l`'s attention over the packed rows `x` `[1, P', H]`, each sequence over its own
    /// rows (q, k, v heads first): `[1, Hq, P', D]`, gap and padding rows zero.
    fn packed_attention(
        &self,
        l: usize,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        layout: &Layout<'_>,
    ) -> Result<Tensor> {
        // Norm, q/k/v (q/k norms, RoPE): [1, H, P', D] each.
        let (q, k, v) = self.project(l, &self.w.layers[l], x, &[rope.clone(), rope.clone()])?;
        let (_, hq, _, d) = q.dims4()?;
        let mut outs = Vec::with_capacity(2 * layout.seqs.len() + 1);
        for (s, &at) in layout.seqs.iter().zip(layout.starts) {
            let n = s.ids.len();
            let (qs, ks, vs) = (
                q.narrow(2, at, n)?,
                k.narrow(2, at, n)?,
                v.narrow(2, at, n)?,
            );
            outs.push(self.packed_core(l, &qs, &ks, &vs)?.transpose(1, 2)?); // [1, n, Hq, D]
            push_zeros(&mut outs, bucketed(n, layout.bucket) - n, (hq, d), &q)?;
        }
        push_zeros(&mut outs, layout.padded - layout.used(), (hq, d), &q)?;
        Tensor::cat(&outs, 1)?.transpose(1, 2)
    }

    /// [`Decoder::packed_attention`] through cuDNN where it applies (`None` elsewhere): q, k and
    /// v in the rows' own layout `[1, P', H, D]`, each sequence's whole buckets read in place
    /// through strides that depend on nothing but its bucket (the shim's graph key: one graph
    /// per bucket whatever the batch); a shape cuDNN refuses runs [`Decoder::packed_core`].
    #[cfg(feature = "cuda")]
    fn packed_attention_cudnn(
        &self,
        l: usize,
        x: &Tensor,
        (cos, sin): &(Tensor, Tensor),
        layout: &Layout<'_>,
    ) -> Result<Option<Tensor>> {
        use super::layers::{AttnBackend, AttnInputs};
        let block = &self.w.layers[l];
        let attn = &block.attn;
        if self.attn != AttnBackend::Cudnn
            || !attn.head_dim.is_multiple_of(8)
            || attn.head_dim > 256
            || cos.dim(candle_core::D::Minus1)? * 2 != attn.head_dim
            || !super::attn_cudnn::cudnn_ready(x.device(), x.dtype())
        {
            return Ok(None);
        }
        let inp = AttnInputs {
            cos,
            sin,
            mask: None,
            plain: true,
            backend: AttnBackend::Cudnn,
            ops: self.ops,
        };
        let h = block.input_norm.forward(x, self.ops)?;
        let (q, k, v) = attn.project_rotated(&h, &inp)?; // [1, P', H, D]
        let (_, _, hq, d) = q.dims4()?;
        let params = xdistill_cudnn::Params {
            scale: attn.scale as f32,
            causal: xdistill_cudnn::Causal::TopLeft,
            window: attn.window,
        };
        let mut outs = Vec::with_capacity(2 * layout.seqs.len() + 1);
        for (s, &at) in layout.seqs.iter().zip(layout.starts) {
            let (n, nb) = (s.ids.len(), bucketed(s.ids.len(), layout.bucket));
            let rows = |t: &Tensor, len: usize| t.narrow(1, at, len)?.transpose(1, 2);
            match super::attn_cudnn::sdpa_or_eager(
                &rows(&q, nb)?,
                &rows(&k, nb)?,
                &rows(&v, nb)?,
                params,
            )? {
                Some(out) => outs.push(out), // [1, nb, Hq, D]: the gap rows' too
                None => {
                    let (qs, ks, vs) = (
                        rows(&q, n)?.contiguous()?,
                        rows(&k, n)?.contiguous()?,
                        rows(&v, n)?.contiguous()?,
                    );
                    outs.push(self.packed_core(l, &qs, &ks, &vs)?.transpose(1, 2)?);
                    push_zeros(&mut outs, nb - n, (hq, d), &q)?;
                }
            }
        }
        push_zeros(&mut outs, layout.padded - layout.used(), (hq, d), &q)?;
        Ok(Some(Tensor::cat(&outs, 1)?.transpose(1, 2)?))
    }

    #[cfg(not(feature = "cuda"))]
    fn packed_attention_cudnn(
        &self,
        _: usize,
        _: &Tensor,
        _: &(Tensor, Tensor),
        _: &Layout<'_>,
    ) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// Layer `l`'s eager attention over one sequence's `q` [1, Hq, n, D], `k`, `v` [1, Hkv,
    /// n, D] (causal, the layer's window, as the sequence's own forward) → [1, Hq, n, D].
    fn packed_core(&self, l: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let attn = &self.w.layers[l].attn;
        let n = q.dim(2)?;
        let mask = attention_bias(1, n, 0, None, attn.window, &self.device)?;
        attn.core(q, k, v, mask.as_ref(), self.ops)
    }
}
