//! The pieces every architecture is built from: RMSNorm (both weight conventions), linear
//! layers, RoPE application (whole or partial), grouped-query attention with causal and
//! sliding-window masks, and the gated MLP. Each runs in two modes ([`Ops`]).

use super::device_ops;
use super::spec::{Activation, LayerSpec, MoeSpec};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{CpuStorage, DType, Layout, Module, Result, Shape, Tensor, D};
use candle_nn::VarBuilder;
use xdistill_cpu_kernels::{host_ops, matmul};

/// Queries per block of inference attention: bounds the scores held at once to
/// `[B, heads, QUERY_CHUNK, S]` (256 MiB → 32 MiB for 16 heads over 2048 keys).
const QUERY_CHUNK: usize = 256;

/// Which kernels to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ops {
    /// Fused kernels — candle's rms_norm and rope; on f32 host tensors the RMSNorm (summed in
    /// f64), SIMD softmax and `silu · up` of `host_ops` and the blocked linear kernel
    /// ([`matmul::matmul_nt`]): fast, no backward pass.
    Fused,
    /// Ops composed of differentiable primitives, so gradients reach every parameter.
    Differentiable,
}

/// Dtype for reductions: f32, or f64 when computing in f64 (gradient checks).
pub(crate) fn accum_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// RMSNorm over the last dimension. Gemma scales by `1 + weight` (its weights start at zero),
/// the others by `weight`.
#[derive(Clone)]
pub(crate) struct Norm {
    pub weight: Tensor,
    pub eps: f64,
    pub plus_one: bool,
}

impl Norm {
    pub fn load(vb: &VarBuilder, name: &str, dim: usize, eps: f64, plus_one: bool) -> Result<Norm> {
        Ok(Norm {
            weight: vb.get(dim, &format!("{name}.weight"))?,
            eps,
            plus_one,
        })
    }

    pub fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let dt = x.dtype();
        if device_ops::applies(x) && self.weight.dtype() == dt {
            return device_ops::rms_norm(x, &self.weight, self.eps, self.plus_one);
        }
        match (ops, self.plus_one) {
            (Ops::Fused, false) => host_ops::rms_norm(x, &self.weight, self.eps),
            (Ops::Fused, true) => {
                let w = (self.weight.to_dtype(accum_dtype(dt))? + 1.0)?.to_dtype(dt)?;
                host_ops::rms_norm(x, &w, self.eps)
            }
            (Ops::Differentiable, plus_one) => {
                // Normalise in f32 (or f64) as transformers does.
                let acc = accum_dtype(dt);
                let xf = x.to_dtype(acc)?;
                let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
                let normed = xf.broadcast_mul(&(ms + self.eps)?.sqrt()?.recip()?)?;
                if plus_one {
                    // Gemma: (1 + w) applied in f32, then cast.
                    let w = (self.weight.to_dtype(acc)? + 1.0)?;
                    normed.broadcast_mul(&w)?.to_dtype(dt)
                } else {
                    // Llama: cast, then scale in the compute dtype.
                    normed.to_dtype(dt)?.broadcast_mul(&self.weight)
                }
            }
        }
    }
}

/// A linear layer `x · Wᵀ (+ b)` with `W` `[out, in]`, dense or quantized.
///
/// Dense: at inference (fused ops) on the CPU, f32 inputs of at least a panel of rows run
/// [`matmul::matmul_nt`] (W read in place, each row's result independent of the others, each
/// dot product summed in blocks of [`matmul::KB`] for accuracy, at every SIMD level);
/// otherwise candle's matmul, which has a backward pass and a matrix-vector path that a decoding
/// step's few rows want (up to 7× faster there).
///
/// Quantized (a GGUF teacher with `--gguf-weights quantized`, see
/// [`crate::model::Decoder::quantize_linears`]): `W` stays in its block format (Q4_1, Q8_0, …)
/// and candle's quantized kernels compute `x · Wᵀ`, quantizing each row of `x` to the format's
/// dot-product type (Q8_0/Q8_1/Q8_K) as llama.cpp does. Inference only: no backward pass.
pub(crate) struct Linear {
    /// The weight's name (`model.layers.0.self_attn.q_proj.weight`): how
    /// [`crate::model::Decoder::quantize_linears`] finds the quantized matrix that replaces it.
    name: String,
    weight: LinearWeight,
}

/// The weight of a [`Linear`].
enum LinearWeight {
    Dense(candle_nn::Linear),
    Quantized {
        /// `[out, in]` in a block format.
        w: QMatMul,
        /// `[out]`.
        bias: Option<Tensor>,
    },
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear::named(String::new(), weight, bias)
    }

    /// A dense layer whose weight is called `name`.
    pub fn named(name: String, weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear {
            name,
            weight: LinearWeight::Dense(candle_nn::Linear::new(weight, bias)),
        }
    }

    /// The weight's name (empty for layers built from a tensor, e.g. MoE experts).
    /// Whether the weight is kept quantized (candle's quantized kernels multiply).
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, LinearWeight::Quantized { .. })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dense weight `[out, in]` and bias `[out]`; an error for a quantized layer (no
    /// backward pass).
    pub(crate) fn dense(&self) -> Result<(&Tensor, Option<&Tensor>)> {
        match &self.weight {
            LinearWeight::Dense(l) => Ok((l.weight(), l.bias())),
            LinearWeight::Quantized { .. } => candle_core::bail!(
                "{}: a quantized linear layer has no backward pass (training uses dense weights)",
                self.name
            ),
        }
    }

    /// Replaces the dense weight by the quantized `w` (same `[out, in]` shape), keeping the
    /// bias. The shape is checked, so a placeholder weight can never survive silently.
    pub fn quantize(&mut self, w: std::sync::Arc<QTensor>) -> Result<()> {
        let LinearWeight::Dense(dense) = &self.weight else {
            candle_core::bail!("{}: already quantized", self.name);
        };
        if w.shape() != dense.weight().shape() {
            candle_core::bail!(
                "{}: quantized weight {:?}, the layer is {:?}",
                self.name,
                w.shape(),
                dense.weight().shape()
            );
        }
        let bias = dense.bias().cloned();
        self.weight = LinearWeight::Quantized {
            w: QMatMul::from_arc(w)?,
            bias,
        };
        Ok(())
    }

    /// `x`: `[..., in]` → `[..., out]`.
    pub fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let inner = match &self.weight {
            LinearWeight::Dense(inner) => inner,
            LinearWeight::Quantized { w, bias } => {
                if ops == Ops::Differentiable {
                    candle_core::bail!(
                        "{}: a quantized linear layer has no backward pass (training uses dense \
                         weights)",
                        self.name
                    );
                }
                let y = w.forward(&x.contiguous()?)?;
                return match bias {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                };
            }
        };
        let w = inner.weight();
        if ops == Ops::Differentiable {
            // One node in the graph, its backward two matmuls (`autograd::linear`).
            let y = super::autograd::linear(x, w)?;
            return match inner.bias() {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            };
        }
        if let Some(block) = super::gemm_blocks::gemm_rows() {
            return self.forward_blocked(inner, x, ops, block);
        }
        self.forward_dense(inner, x, ops)
    }

    /// [`Linear::forward`] of a dense layer at inference, all rows in one product.
    fn forward_dense(&self, inner: &candle_nn::Linear, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let w = inner.weight();
        if !takes_matmul_nt(x, w, ops)? {
            return inner.forward(x);
        }
        let y = matmul_nt(x, w)?;
        match inner.bias() {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// [`Linear::forward`] inside a packed forward (`gemm_blocks::GemmRows`): `x`'s rows in blocks of
    /// exactly `block` (their count a multiple of it), each block one product of the same shape,
    /// so that a row's kernel never depends on the batch. On CUDA one cuBLAS GEMM per block
    /// into one output; elsewhere the dense path per block `[1, block, in]`, put together.
    fn forward_blocked(
        &self,
        inner: &candle_nn::Linear,
        x: &Tensor,
        ops: Ops,
        block: usize,
    ) -> Result<Tensor> {
        let w = inner.weight();
        let (n, k) = w.dims2()?;
        let rows = x.elem_count() / k.max(1);
        if rows == 0 || !rows.is_multiple_of(block) {
            candle_core::bail!(
                "{}: {rows} rows in matmul blocks of {block} (a packed forward pads its rows)",
                self.name
            );
        }
        let mut out_dims = x.dims().to_vec();
        if let Some(last) = out_dims.last_mut() {
            *last = n;
        }
        let flat = x.reshape((rows, k))?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            let y =
                super::gemm_blocks::gemm_nt_blocks(&flat.contiguous()?, &w.contiguous()?, block)?
                    .reshape(out_dims)?;
            return match inner.bias() {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            };
        }
        let parts = (0..rows / block)
            .map(|b| {
                self.forward_dense(inner, &flat.narrow(0, b * block, block)?.unsqueeze(0)?, ops)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 1)?.reshape(out_dims)
    }
}

/// Whether inference (fused ops) runs linear layers on `device` in `dtype` through
/// [`matmul::matmul_nt`] (for inputs of at least [`matmul::NP`] rows): f32 on the CPU.
pub fn linear_kernel(device: &candle_core::Device, dtype: DType) -> bool {
    device.is_cpu() && dtype == DType::F32
}

/// Whether `x [..., k] · wᵀ` (`w` `[o, k]`) runs [`matmul::matmul_nt`] at inference: fused
/// ops, f32 host tensors and at least [`matmul::NP`] rows (fewer, as a decoding step has, keep
/// candle's matrix-vector path).
pub(crate) fn takes_matmul_nt(x: &Tensor, w: &Tensor, ops: Ops) -> Result<bool> {
    let rows = x.elem_count() / w.dim(1)?.max(1);
    Ok(ops == Ops::Fused
        && linear_kernel(x.device(), x.dtype())
        && w.dtype() == DType::F32
        && rows >= matmul::NP)
}

/// `x [..., k] · wᵀ` (`w` `[o, k]`) → `[..., o]` by [`matmul::matmul_nt`]: f32 host tensors.
pub(crate) fn matmul_nt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &MatmulNt)
}

/// [`matmul::matmul_nt`] as a candle op: `(x [..., k], w [o, k])` → `[..., o]`.
struct MatmulNt;

impl candle_core::CustomOp2 for MatmulNt {
    fn name(&self) -> &'static str {
        "matmul-nt"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (
            host_ops::values(s1, l1, self.name())?,
            host_ops::values(s2, l2, self.name())?,
        );
        let (&k, &[o, wk]) = (l1.dims().last().unwrap_or(&0), l2.dims()) else {
            candle_core::bail!("matmul-nt: the weight is [out, in]");
        };
        if k != wk || k == 0 {
            candle_core::bail!("matmul-nt: input width {k}, weight [{o}, {wk}]");
        }
        let mut dims = l1.dims().to_vec();
        *dims.last_mut().unwrap_or(&mut 0) = o;
        let y = matmul::matmul_nt(x, w, k, o);
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }
}

/// A linear layer `name.weight` `[out, in]` (and `name.bias` `[out]`).
pub(crate) fn linear(
    vb: &VarBuilder,
    name: &str,
    (in_dim, out_dim): (usize, usize),
    bias: bool,
) -> Result<Linear> {
    let w = vb.get((out_dim, in_dim), &format!("{name}.weight"))?;
    let b = if bias {
        Some(vb.get(out_dim, &format!("{name}.bias"))?)
    } else {
        None
    };
    let full = match vb.prefix() {
        p if p.is_empty() => format!("{name}.weight"),
        p => format!("{p}.{name}.weight"),
    };
    Ok(Linear::named(full, w, b))
}

pub(crate) fn activate(x: &Tensor, act: Activation) -> Result<Tensor> {
    match act {
        Activation::Silu => x.silu(),
        Activation::GeluTanh => x.gelu(),
        Activation::GeluErf => x.gelu_erf(),
    }
}

/// RoPE (rotate-half form) on the first `cos.dim(-1) * 2` dims of each head; the rest pass
/// through (partial rotary). `x`: [B, H, T, D]; `cos`, `sin`: [T, R/2] or [B, T, R/2].
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, ops: Ops) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let rot = cos.dim(D::Minus1)? * 2;
    if rot < d {
        let rotated = rope(&x.narrow(D::Minus1, 0, rot)?, cos, sin, ops)?;
        return Tensor::cat(&[&rotated, &x.narrow(D::Minus1, rot, d - rot)?], D::Minus1);
    }
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
            let half = d / 2;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
        }
    }
}

/// The q/k/v projections: three matrices, or Phi-3's one `qkv_proj` ([q; k; v] rows).
pub(crate) enum Qkv {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// Self-attention of one layer.
pub(crate) struct Attention {
    pub qkv: Qkv,
    pub o: Linear,
    /// Qwen3, Gemma 3: RMSNorm over head_dim of q and k, before RoPE.
    pub qk_norm: Option<(Norm, Norm)>,
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Multiplies q·k (`head_dim^-1/2`, Gemma 3: `query_pre_attn_scalar^-1/2`).
    pub scale: f64,
    /// Keys further back than this many positions (counting the query's own) are masked.
    pub window: Option<usize>,
}

/// The attention kernel of inference (fused ops).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnBackend {
    /// Matmuls and a softmax, `QUERY_CHUNK` queries at a time: every device and dtype.
    Eager,
    /// cuDNN's fused attention where it applies (a CUDA build on a CUDA device, bf16 or f16,
    /// cuDNN found at run time, more than one new position, no padding mask); the eager path
    /// elsewhere.
    Cudnn,
}

impl AttnBackend {
    /// `XDISTILL_ATTENTION`: `eager` or `cudnn`, read once per process (every decoder, the
    /// trainer's per-step copies included, asks). Unset: `cudnn` in a CUDA build (checked on an
    /// H200, 2026-11-29: `scripts/gpu-check.sh` steps 1b, 3t and 4; docs/cuda.md), `eager`
    /// otherwise.
    pub fn from_env() -> AttnBackend {
        static CHOSEN: std::sync::OnceLock<AttnBackend> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let value = std::env::var("XDISTILL_ATTENTION").ok();
            AttnBackend::parse(value.as_deref()).unwrap_or_else(|why| {
                tracing::warn!("XDISTILL_ATTENTION: {why}; using eager");
                AttnBackend::Eager
            })
        })
    }

    /// The backend a value of `XDISTILL_ATTENTION` names (unset: cuDNN's in a CUDA build,
    /// eager otherwise).
    pub fn parse(value: Option<&str>) -> std::result::Result<AttnBackend, String> {
        match value {
            None if cfg!(feature = "cuda") => Ok(AttnBackend::Cudnn),
            None | Some("eager") => Ok(AttnBackend::Eager),
            Some("cudnn") => Ok(AttnBackend::Cudnn),
            Some(other) => Err(format!("{other:?} is not eager or cudnn")),
        }
    }
}

/// What one attention call reads besides its weights.
pub(crate) struct AttnInputs<'a> {
    /// RoPE tables for this forward: [T, R/2] or [B, T, R/2].
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    /// Additive bias [B|1, 1, T, S] for this layer's window, or None.
    pub mask: Option<&'a Tensor>,
    /// The mask is the causal one (and the layer's window) of positions `past..past+T` over
    /// every cached key, nothing else (no padding): a fused kernel may build it itself.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub plain: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub backend: AttnBackend,
    pub ops: Ops,
}

/// [B, Hkv, S, D] → [B, Hkv·rep, S, D] (each kv head repeated `rep` times consecutively): the
/// grouped-query heads of every attention path (eager, blockwise, the precision trace).
pub(super) fn repeat_kv(x: &Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, h, rep, s, d))?
        .reshape((b, h * rep, s, d))
}

/// The MLP of a block: dense, or Qwen3-MoE's sparse experts.
pub(crate) enum Ffn {
    Dense(GatedMlp),
    Moe(SparseMoe),
}

impl Ffn {
    pub(super) fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x, ops),
            Ffn::Moe(m) => m.forward(x, ops),
        }
    }
}

/// One decoder layer: `x += post_attn(attn(norm(x)))`, then `x += post_ffn(ffn(ffn_norm(x)))`
/// (the `post_*` norms are Gemma's; the others have none).
pub(crate) struct Block {
    pub input_norm: Norm,
    pub attn: Attention,
    pub post_attn_norm: Option<Norm>,
    pub ffn_norm: Norm,
    pub ffn: Ffn,
    pub post_ffn_norm: Option<Norm>,
}

impl Attention {
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj` under `av` (`…self_attn`) with the spec's biases
    /// (q/k/v, o), then `q_norm`/`k_norm` when it has them (`Some(true)`: Gemma's
    /// `1 + weight`). Head counts, scale and window are the spec's.
    pub fn load(spec: &LayerSpec, av: &VarBuilder) -> Result<Attention> {
        let (h, hq, hkv, d) = (spec.hidden, spec.heads, spec.kv_heads, spec.head_dim);
        let (qkv_bias, o_bias) = spec.biases;
        let q = linear(av, "q_proj", (h, hq * d), qkv_bias)?;
        let k = linear(av, "k_proj", (h, hkv * d), qkv_bias)?;
        let v = linear(av, "v_proj", (h, hkv * d), qkv_bias)?;
        let o = linear(av, "o_proj", (hq * d, h), o_bias)?;
        let qk_norm = match spec.qk_norm {
            Some(plus_one) => Some((
                Norm::load(av, "q_norm", d, spec.eps, plus_one)?,
                Norm::load(av, "k_norm", d, spec.eps, plus_one)?,
            )),
            None => None,
        };
        Ok(Attention {
            qkv: Qkv::Separate { q, k, v },
            o,
            qk_norm,
            n_heads: hq,
            n_kv: hkv,
            head_dim: d,
            scale: spec.attention_scale,
            window: spec.window,
        })
    }

    /// The projections, for [`crate::model::Decoder::quantize_linears`].
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out: Vec<&Linear> = match &self.qkv {
            Qkv::Separate { q, k, v } => vec![q, k, v],
            Qkv::Fused(qkv) => vec![qkv],
        };
        out.push(&self.o);
        out
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out: Vec<&mut Linear> = match &mut self.qkv {
            Qkv::Separate { q, k, v } => vec![q, k, v],
            Qkv::Fused(qkv) => vec![qkv],
        };
        out.push(&mut self.o);
        out
    }

    /// `x`: [B, T, H] → [B, T, H]; `kv` is this layer's cache slot, appended to.
    pub fn forward(
        &self,
        x: &Tensor,
        inp: &AttnInputs<'_>,
        kv: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Result<Tensor> {
        // cuDNN where it applies and takes the shape (else the eager attention below).
        #[cfg(feature = "cuda")]
        let kv = {
            let mut kv = kv;
            if self.cudnn_applies(x, inp)? {
                if let Some(out) = self.forward_cudnn(x, inp, kv.as_deref_mut())? {
                    return Ok(out);
                }
            }
            kv
        };
        let (q, k, v) = self.project(x, inp)?;
        // 3. Append to the cache: [B, Hkv, past+T, D]. The cache holds detached tensors, so a
        // rollout's earlier versions never stay alive through a gradient graph.
        let (k, v) = match kv {
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                *slot = Some((k.detach(), v.detach()));
                (k, v)
            }
            None => (k, v),
        };
        let out = self.core(&q, &k, &v, inp.mask, inp.ops)?;
        self.output(&out, inp.ops)
    }

    /// Steps 4–5 of the attention: `q` [B, Hq, T, D] over `k`, `v` [B, Hkv, S, D] with the
    /// additive `mask`: grouped-query heads repeated to [B, Hq, S, D], then the masked softmax
    /// attention → [B, Hq, T, D]; at inference [`QUERY_CHUNK`] queries at a time, so that at
    /// most [B, Hq, QUERY_CHUNK, S] scores exist at once.
    pub fn core(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        ops: Ops,
    ) -> Result<Tensor> {
        let rep = self.n_heads / self.n_kv;
        let (k, v) = (repeat_kv(k, rep)?, repeat_kv(v, rep)?);
        match ops {
            Ops::Fused => attend_in_chunks(q, &k, &v, mask, self.scale, QUERY_CHUNK),
            Ops::Differentiable => attend(q, &k, &v, mask, self.scale, ops),
        }
    }

    /// Steps 1–2 of the attention: `x` [B, T, H] → q [B, Hq, T, D], k and v [B, Hkv, T, D],
    /// projected, normed (Qwen3, Gemma 3) and rotated.
    pub fn project(&self, x: &Tensor, inp: &AttnInputs<'_>) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v) = self.project_heads(x, inp)?;
        // 2. Heads first: [B, heads, T, D], then RoPE (in one pass where the fused op runs).
        let v = v.transpose(1, 2)?.contiguous()?;
        if device_ops::applies(&q) && inp.cos.dtype() == q.dtype() {
            let q = device_ops::rope(&q, inp.cos, inp.sin, true)?;
            let k = device_ops::rope(&k, inp.cos, inp.sin, true)?;
            return Ok((q, k, v));
        }
        let q = rope(&q.transpose(1, 2)?.contiguous()?, inp.cos, inp.sin, inp.ops)?;
        let k = rope(&k.transpose(1, 2)?.contiguous()?, inp.cos, inp.sin, inp.ops)?;
        Ok((q, k, v))
    }

    /// Step 1 of the attention: `x` [B, T, H] → q [B, T, Hq, D], k and v [B, T, Hkv, D],
    /// projected and normed (Qwen3, Gemma 3), not rotated.
    pub fn project_heads(
        &self,
        x: &Tensor,
        inp: &AttnInputs<'_>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        // 1. Project: [B, T, H] -> [B, T, heads, D]
        let (q, k, v) = match &self.qkv {
            Qkv::Separate { q, k, v } => (
                q.forward(x, inp.ops)?,
                k.forward(x, inp.ops)?,
                v.forward(x, inp.ops)?,
            ),
            Qkv::Fused(qkv) => {
                let all = qkv.forward(x, inp.ops)?;
                let (nq, nkv) = (self.n_heads * d, self.n_kv * d);
                (
                    all.narrow(D::Minus1, 0, nq)?,
                    all.narrow(D::Minus1, nq, nkv)?,
                    all.narrow(D::Minus1, nq + nkv, nkv)?,
                )
            }
        };
        let mut q = q.reshape((b, t, self.n_heads, d))?;
        let mut k = k.reshape((b, t, self.n_kv, d))?;
        let v = v.reshape((b, t, self.n_kv, d))?;
        if let Some((qn, kn)) = &self.qk_norm {
            q = qn.forward(&q, inp.ops)?;
            k = kn.forward(&k, inp.ops)?;
        }
        Ok((q, k, v))
    }

    /// Step 6: merge the heads of the attention's result `out` [B, Hq, T, D] into [B, T, Hq·D]
    /// and apply `o_proj`.
    pub fn output(&self, out: &Tensor, ops: Ops) -> Result<Tensor> {
        let (b, _, t, _) = out.dims4()?;
        let out = out
            .transpose(1, 2)?
            .reshape((b, t, self.n_heads * self.head_dim))?;
        self.o.forward(&out, ops)
    }
}

/// Softmax attention of queries `q` [B, Hq, Tq, D] over keys and values [B, Hq, S, D] with
/// the additive `mask` [B|1, 1, Tq, S]: [B, Hq, Tq, D]. Scores in f32 (f64 for f64 inputs).
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    ops: Ops,
) -> Result<Tensor> {
    let acc = accum_dtype(q.dtype());
    // CUDA's matmul takes only contiguous (or transposed-contiguous) operands, and a decoding
    // step's rotated query [B, Hq, 1, D] can come out strided there (the CPU takes any layout).
    let q = q.contiguous()?;
    let mut att = (q.matmul(&k.t()?)? * scale)?.to_dtype(acc)?;
    if let Some(m) = mask {
        att = att.broadcast_add(&m.to_dtype(acc)?)?;
    }
    let att = match ops {
        Ops::Fused => host_ops::softmax_last_dim(&att)?,
        Ops::Differentiable => candle_nn::ops::softmax(&att, D::Minus1)?,
    }
    .to_dtype(v.dtype())?;
    att.matmul(v)
}

/// [`attend`] with fused ops, `chunk` queries at a time (a query's softmax needs only its own
/// row of scores): at most `[B, Hq, chunk, S]` scores exist at once.
fn attend_in_chunks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    chunk: usize,
) -> Result<Tensor> {
    let t = q.dim(2)?;
    if t <= chunk {
        return attend(q, k, v, mask, scale, Ops::Fused);
    }
    let mut parts = Vec::with_capacity(t.div_ceil(chunk));
    for c0 in (0..t).step_by(chunk) {
        let c = chunk.min(t - c0);
        let mask = mask.map(|m| m.narrow(2, c0, c)).transpose()?;
        let q = q.narrow(2, c0, c)?.contiguous()?;
        parts.push(attend(&q, k, v, mask.as_ref(), scale, Ops::Fused)?);
    }
    Tensor::cat(&parts, 2)
}

/// The gate and up projections: two matrices, or Phi-3's one `gate_up_proj` ([gate; up] rows).
pub(crate) enum GateUp {
    Separate { gate: Linear, up: Linear },
    Fused(Linear),
}

/// The gated MLP `down(act(gate(x)) * up(x))`.
pub(crate) struct GatedMlp {
    pub gate_up: GateUp,
    pub down: Linear,
    pub act: Activation,
}

impl GatedMlp {
    /// Loads `gate_proj`, `up_proj` and `down_proj` under `vb`.
    pub fn load(vb: &VarBuilder, hidden: usize, inter: usize, act: Activation) -> Result<Self> {
        Ok(GatedMlp {
            gate_up: GateUp::Separate {
                gate: linear(vb, "gate_proj", (hidden, inter), false)?,
                up: linear(vb, "up_proj", (hidden, inter), false)?,
            },
            down: linear(vb, "down_proj", (inter, hidden), false)?,
            act,
        })
    }

    /// The projections.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out: Vec<&Linear> = match &self.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up],
            GateUp::Fused(gu) => vec![gu],
        };
        out.push(&self.down);
        out
    }

    /// The projections, for [`crate::model::Decoder::quantize_linears`].
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out: Vec<&mut Linear> = match &mut self.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up],
            GateUp::Fused(gu) => vec![gu],
        };
        out.push(&mut self.down);
        out
    }

    /// `x`: [..., H] → [..., H].
    pub fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(x, ops)?, up.forward(x, ops)?),
            GateUp::Fused(gu) => {
                let both = gu.forward(x, ops)?;
                let i = both.dim(D::Minus1)? / 2;
                (both.narrow(D::Minus1, 0, i)?, both.narrow(D::Minus1, i, i)?)
            }
        };
        let act = match (ops, self.act) {
            _ if device_ops::applies(&gate) => device_ops::gated_act(&gate, &up, self.act)?,
            (Ops::Fused, Activation::Silu) => host_ops::silu_mul(&gate, &up)?,
            _ => (activate(&gate, self.act)? * up)?,
        };
        self.down.forward(&act, ops)
    }
}

/// The sparse mixture-of-experts MLP of one layer (Qwen3-MoE). Experts load from the Hub
/// layout (`mlp.experts.N.{gate,up,down}_proj.weight`) or from transformers 5's fused tensors
/// (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`).
pub(crate) struct SparseMoe {
    /// Router `[E, H]`.
    router: Linear,
    experts: Vec<GatedMlp>,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    /// The router and experts of layer `spec` under `vb` (`…mlp`).
    pub(crate) fn load(spec: &LayerSpec, moe: MoeSpec, vb: &VarBuilder) -> Result<SparseMoe> {
        let (h, e, inter, act) = (spec.hidden, moe.experts, moe.intermediate, spec.activation);
        let router = linear(vb, "gate", (h, e), false)?;
        let ev = vb.pp("experts");
        let experts = if ev.contains_tensor("gate_up_proj") {
            let gate_up = ev.get((e, 2 * inter, h), "gate_up_proj")?;
            let down = ev.get((e, h, inter), "down_proj")?;
            (0..e)
                .map(|i| {
                    Ok(GatedMlp {
                        gate_up: GateUp::Fused(Linear::new(gate_up.get(i)?, None)),
                        down: Linear::new(down.get(i)?, None),
                        act,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..e)
                .map(|i| GatedMlp::load(&ev.pp(i), h, inter, act))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(SparseMoe {
            router,
            experts,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    /// `x`: [B, T, H] → [B, T, H].
    pub fn forward(&self, x: &Tensor, ops: Ops) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let h = *dims.last().unwrap_or(&0);
        let flat = x.reshape(((), h))?; // [N, H]
                                        // 1. Route: softmax over experts in f32, top-k per token (on the host: [N, E] is small).
        let probs = candle_nn::ops::softmax_last_dim(
            &self.router.forward(&flat, ops)?.to_dtype(DType::F32)?,
        )?
        .to_vec2::<f32>()?;
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (tok, row) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let picked = &order[..self.top_k.min(order.len())];
            let sum: f32 = picked.iter().map(|&e| row[e]).sum();
            for &e in picked {
                let w = if self.norm_topk_prob {
                    row[e] / sum
                } else {
                    row[e]
                };
                routed[e].0.push(tok as u32);
                routed[e].1.push(w);
            }
        }
        // 2. Each expert once over its tokens, weighted, added back in expert order.
        let mut out = flat.zeros_like()?;
        for (expert, (tokens, weights)) in self.experts.iter().zip(routed) {
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let idx = Tensor::from_vec(tokens, n, x.device())?;
            let w = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(x.dtype())?;
            let y = expert.forward(&flat.index_select(&idx, 0)?, ops)?; // [n, H]
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        out.reshape(dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::lcg_noise;
    use candle_core::Device;

    /// Inference runs inputs of a panel of rows or more through the kernel: each output is
    /// [`matmul::dot_blocked`] plus the bias, whatever the batch shape;
    /// fewer rows, or the differentiable ops, keep candle's matmul bit for bit (at this input
    /// width candle's gemm sums in blocks, so the two paths' bits differ).
    #[test]
    fn linear_takes_the_kernel_for_a_panel_of_rows_at_inference() {
        let dev = Device::Cpu;
        let (k, o) = (1100usize, 70usize);
        let noise = |seed: u64, n: usize| lcg_noise(seed, n, 1.0);
        let (wv, bv) = (noise(1, o * k), noise(2, o));
        let w = Tensor::from_vec(wv.clone(), (o, k), &dev).unwrap();
        let b = Tensor::from_vec(bv.clone(), o, &dev).unwrap();
        let lin = Linear::new(w.clone(), Some(b.clone()));
        let reference = candle_nn::Linear::new(w, Some(b));
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (batch, t) in [(2usize, 20usize), (1, 5), (1, 32)] {
            let xv = noise(3 + t as u64, batch * t * k);
            let x = Tensor::from_vec(xv.clone(), (batch, t, k), &dev).unwrap();
            let candle = flat(&reference.forward(&x).unwrap());
            let diff = lin.forward(&x, Ops::Differentiable).unwrap();
            assert_eq!(diff.dims(), &[batch, t, o]);
            assert_eq!(flat(&diff), candle, "differentiable ops: candle's matmul");
            let fused = flat(&lin.forward(&x, Ops::Fused).unwrap());
            if batch * t < matmul::NP {
                assert_eq!(fused, candle, "{batch} x {t} rows: candle's matmul");
                continue;
            }
            for r in 0..batch * t {
                for c in 0..o {
                    let (xr, wc) = (&xv[r * k..(r + 1) * k], &wv[c * k..(c + 1) * k]);
                    let fma = xdistill_cpu_kernels::simd::Simd::current()
                        >= xdistill_cpu_kernels::simd::Simd::Avx2;
                    let dot = matmul::dot_blocked(wc, xr, fma);
                    assert_eq!(fused[r * o + c].to_bits(), (dot + bv[c]).to_bits());
                    // Both are f32 sums of k products: within the standard rounding bound.
                    let scale: f32 = wc.iter().zip(xr).map(|(&w, &x)| (w * x).abs()).sum();
                    let bound = 2.0 * k as f32 * f32::EPSILON * scale;
                    assert!((fused[r * o + c] - candle[r * o + c]).abs() <= bound);
                }
            }
        }
    }

    /// Queries in chunks (uneven last one, a causal mask with -inf) give the attention of all
    /// queries at once, to f32 rounding: the matmuls' kernels differ with the number of rows
    /// (a one-row chunk is a matrix-vector product), so the bits may not.
    #[test]
    fn attention_backend_names() {
        let unset = if cfg!(feature = "cuda") {
            AttnBackend::Cudnn
        } else {
            AttnBackend::Eager
        };
        assert_eq!(AttnBackend::parse(None), Ok(unset));
        assert_eq!(AttnBackend::parse(Some("eager")), Ok(AttnBackend::Eager));
        assert_eq!(AttnBackend::parse(Some("cudnn")), Ok(AttnBackend::Cudnn));
        for bad in ["", "CUDNN", "flash"] {
            let err = AttnBackend::parse(Some(bad)).unwrap_err();
            assert!(err.contains("is not eager or cudnn"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn chunked_attention_equals_whole() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2usize, 3usize, 23usize, 8usize);
        let r = |seed: u64| {
            let v = lcg_noise(seed, b * h * t * d, 3.0);
            Tensor::from_vec(v, (b, h, t, d), &dev).unwrap()
        };
        let (q, k, v) = (r(1), r(2), r(3));
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, t, t), &dev).unwrap();
        let flat = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for m in [Some(&mask), None] {
            let whole = flat(&attend(&q, &k, &v, m, 0.35, Ops::Fused).unwrap());
            for chunk in [1, 5, 22, 23, 64] {
                let got = attend_in_chunks(&q, &k, &v, m, 0.35, chunk).unwrap();
                assert_eq!(got.dims(), &[b, h, t, d]);
                let worst = flat(&got)
                    .iter()
                    .zip(&whole)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 2e-6, "chunk {chunk}: {worst}");
                if chunk >= t {
                    assert_eq!(flat(&got), whole, "one chunk is the whole");
                }
            }
        }
        // The mask is applied per chunk: query 0 sees only key 0, so it returns v[.., 0, ..].
        let got = flat(&attend_in_chunks(&q, &k, &v, Some(&mask), 0.35, 5).unwrap());
        let v0 = flat(&v.narrow(2, 0, 1).unwrap().contiguous().unwrap());
        assert_eq!(&got[..d], &v0[..d]);
    }
}
