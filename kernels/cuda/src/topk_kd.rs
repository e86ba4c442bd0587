//! The launches of `topk_kd.cu`: each row's top-k distillation divergence (with the teacher's
//! and student's masses on K and the row's logsumexp, and optionally the next-token
//! cross-entropy beside it) and its backward, the `[rows, V]` gradient of the logits, written
//! into a buffer of its own or over the logits, for `xdistill_kernels::topk_kd`.

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaView, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

/// The most teacher entries per row the backward stages before its pass over the row
/// (`STAGED_K` in topk_kd.cu): the largest k whose gradient may be written over the logits.
pub const TOPK_KD_STAGED_K: usize = 4096;

/// The loss of each row (`div`, `tail` as in topk_kd.cu).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopkKdArgs {
    pub rows: usize,
    /// Logits per row.
    pub vocab: usize,
    /// Teacher entries per row.
    pub k: usize,
    /// 0 forward KL, 1 reverse KL, 2 JSD(beta), 3 total variation.
    pub div: i32,
    /// 0 renormalize, 1 bucket, 2 ignore.
    pub tail: i32,
    pub beta: f32,
    pub inv_tau: f32,
    pub tail_floor: f32,
}

/// A tensor operand of the kernels: its storage and layout.
pub type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// The teacher's side of each row: ids `[rows, k]` u32 (distinct per row, below V), log-probs
/// `[rows, k]` f32, and, for the cross-entropy beside the divergence, each row's next token
/// `[rows]` u32 (below V).
#[derive(Clone, Copy)]
pub struct TopkKdTargets<'a> {
    pub ids: Operand<'a>,
    pub lts: Operand<'a>,
    pub ce: Option<Operand<'a>>,
}

/// The gradient the backward starts from: `g` `[rows, stride]` f32, the divergence's at column
/// 0 and the cross-entropy's at column `ce_col` (read only with the cross-entropy).
#[derive(Clone, Copy)]
pub struct TopkKdGrad<'a> {
    pub g: Operand<'a>,
    pub stride: usize,
    pub ce_col: usize,
}

impl TopkKdTargets<'_> {
    /// The ids and teacher log-probs from their first element.
    fn views(&self) -> Result<(CudaView<'_, u32>, CudaView<'_, f32>)> {
        let (ids, lts) = (self.ids, self.lts);
        Ok((
            ids.0.as_cuda_slice::<u32>()?.slice(ids.1.start_offset()..),
            lts.0.as_cuda_slice::<f32>()?.slice(lts.1.start_offset()..),
        ))
    }
}

impl TopkKdArgs {
    /// Columns of the forward's output: 4, or 6 with the cross-entropy.
    pub fn cols(ce: bool) -> usize {
        if ce {
            6
        } else {
            4
        }
    }

    /// The checked sizes, with the logits and the teacher's side dense as the kernels read them.
    fn inputs(&self, z: &Layout, t: &TopkKdTargets<'_>) -> Result<(u32, u32, u32)> {
        if self.rows > u32::MAX as usize || self.vocab > u32::MAX as usize || self.k == 0 {
            bail!("topk_kd: {self:?} is out of range");
        }
        dense(z, self.rows * self.vocab, "logits")?;
        dense(t.ids.1, self.rows * self.k, "ids")?;
        dense(t.lts.1, self.rows * self.k, "teacher log-probs")?;
        if let Some(ce) = t.ce {
            dense(ce.1, self.rows, "cross-entropy targets")?;
        }
        Ok((self.rows as u32, self.vocab as u32, self.k as u32))
    }

    /// The kernels' last arguments: the divergence, the tail, β, 1/τ and the tail's floor.
    fn push_loss<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.div)
            .arg(&self.tail)
            .arg(&self.beta)
            .arg(&self.inv_tau)
            .arg(&self.tail_floor);
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.rows.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

fn dense(l: &Layout, n: usize, what: &str) -> Result<()> {
    if !l.is_contiguous() || l.shape().elem_count() != n {
        bail!(
            "topk_kd: {what} {:?} is not {n} contiguous values",
            l.shape()
        );
    }
    Ok(())
}

/// `[rows, 4]` f32: each row's divergence, teacher mass on K, student mass on K, logsumexp of
/// `z/τ`; with the cross-entropy `[rows, 6]`: then also `lse₁ − z_y` and `lse₁` (at τ = 1).
/// `z` `[rows, V]` (f32, bf16, f16).
pub fn topk_kd_fwd(z: Operand<'_>, t: TopkKdTargets<'_>, a: TopkKdArgs) -> Result<CudaStorage> {
    let (rows, v, k) = a.inputs(z.1, &t)?;
    let cols = TopkKdArgs::cols(t.ce.is_some());
    let dev = z.0.device().clone();
    // SAFETY: the kernel writes every column of every row.
    let mut out = unsafe { dev.alloc::<f32>((cols * a.rows).max(1))? };
    let (iv, lv) = t.views()?;
    let stream = dev.cuda_stream();
    let ce = ce_address(t.ce, &stream)?;
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            if a.rows > 0 {
                let zv = z.0.as_cuda_slice::<$t>()?.slice(z.1.start_offset()..);
                let func = ptx::function(&dev, &ptx::TOPK_KD, concat!("topk_kd_fwd_", $sfx))?;
                let mut b = stream.launch_builder(&func);
                b.arg(&zv).arg(&iv).arg(&lv).arg(&ce).arg(&mut out);
                b.arg(&rows).arg(&v).arg(&k);
                a.push_loss(&mut b);
                // SAFETY: the kernel's signature; `rows` rows of `V` logits, `k` entries and
                // (where `ce` is not null) one target each.
                unsafe { b.launch(a.config()) }.w()?;
            }
        }};
    }
    crate::typed!(z.0.dtype(), "topk_kd", run);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The device address of the cross-entropy's targets, or 0 (the kernels' null: none). Work
/// using it is queued on `stream`, candle's, while the targets live.
fn ce_address(
    ce: Option<Operand<'_>>,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<u64> {
    let Some((s, l)) = ce else {
        return Ok(0);
    };
    let view = s.as_cuda_slice::<u32>()?.slice(l.start_offset()..);
    let (ptr, _sync) = view.device_ptr(stream);
    Ok(ptr)
}

/// The checked backward operands: the forward's output `res` and the gradient `g`.
fn grad_inputs(
    a: &TopkKdArgs,
    t: &TopkKdTargets<'_>,
    res: &Layout,
    g: &TopkKdGrad<'_>,
) -> Result<(u32, u32)> {
    let cols = TopkKdArgs::cols(t.ce.is_some());
    dense(res, a.rows * cols, "forward output")?;
    dense(g.g.1, a.rows * g.stride, "gradient")?;
    if g.stride == 0 || (t.ce.is_some() && g.ce_col >= g.stride) {
        bail!(
            "topk_kd: a gradient of {} columns, the cross-entropy's at {}",
            g.stride,
            g.ce_col
        );
    }
    Ok((g.stride as u32, g.ce_col as u32))
}

/// The backward of [`topk_kd_fwd`]: the logits' gradient `[rows, V]` (their dtype) from the
/// forward's output `res` and the gradient `g` of each row's divergence (and cross-entropy).
pub fn topk_kd_bwd(
    z: Operand<'_>,
    t: TopkKdTargets<'_>,
    res: Operand<'_>,
    g: TopkKdGrad<'_>,
    a: TopkKdArgs,
) -> Result<CudaStorage> {
    let n = a.rows * a.vocab;
    let dev = z.0.device().clone();
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            // SAFETY: the kernel writes every column of every row.
            let mut dz = unsafe { dev.alloc::<$t>(n.max(1))? };
            let to = dz.device_ptr_mut(&dev.cuda_stream()).0;
            bwd(z, z.0.as_cuda_slice::<$t>()?, t, res, g, a, to, $sfx)?;
            CudaStorage::wrap_cuda_slice(dz, dev.clone())
        }};
    }
    Ok(crate::typed!(z.0.dtype(), "topk_kd", run))
}

/// [`topk_kd_bwd`] with the gradient written over the logits `z` (k at most
/// [`TOPK_KD_STAGED_K`]): no second `[rows, V]` buffer.
pub fn topk_kd_bwd_in_place(
    z: &mut CudaStorage,
    zl: &Layout,
    t: TopkKdTargets<'_>,
    res: Operand<'_>,
    g: TopkKdGrad<'_>,
    a: TopkKdArgs,
) -> Result<()> {
    if a.k > TOPK_KD_STAGED_K {
        bail!(
            "topk_kd: k = {} is above the {TOPK_KD_STAGED_K} a gradient written over the logits takes",
            a.k
        );
    }
    let stream = z.device().cuda_stream();
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            let at = zl.start_offset();
            let to = z
                .as_cuda_slice_mut::<$t>()?
                .slice_mut(at..)
                .device_ptr_mut(&stream)
                .0;
            bwd((&*z, zl), z.as_cuda_slice::<$t>()?, t, res, g, a, to, $sfx)?;
        }};
    }
    crate::typed!(z.dtype(), "topk_kd", run);
    Ok(())
}

/// Launches `topk_kd_bwd_{sfx}` reading the logits `zs` (`z`'s slice) and writing the
/// gradient at device address `to` (`[rows, V]`, which may be the logits themselves).
#[allow(clippy::too_many_arguments)]
fn bwd<T: candle_core::cuda_backend::CudaDType>(
    z: Operand<'_>,
    zs: &candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    t: TopkKdTargets<'_>,
    res: Operand<'_>,
    g: TopkKdGrad<'_>,
    a: TopkKdArgs,
    to: u64,
    sfx: &str,
) -> Result<()> {
    let (rows, v, k) = a.inputs(z.1, &t)?;
    let (g_stride, g_ce) = grad_inputs(&a, &t, res.1, &g)?;
    if a.rows * a.vocab == 0 {
        return Ok(());
    }
    let dev = z.0.device().clone();
    let stream = dev.cuda_stream();
    let zv = zs.slice(z.1.start_offset()..);
    let (iv, lv) = t.views()?;
    let rv = res.0.as_cuda_slice::<f32>()?.slice(res.1.start_offset()..);
    let gv = g.g.0.as_cuda_slice::<f32>()?.slice(g.g.1.start_offset()..);
    let ce = ce_address(t.ce, &stream)?;
    let name = format!("topk_kd_bwd_{sfx}");
    let func = ptx::function(&dev, &ptx::TOPK_KD, &name)?;
    let mut b = stream.launch_builder(&func);
    b.arg(&zv).arg(&iv).arg(&lv).arg(&ce).arg(&rv).arg(&gv);
    b.arg(&g_stride).arg(&g_ce).arg(&to);
    b.arg(&rows).arg(&v).arg(&k);
    a.push_loss(&mut b);
    // SAFETY: the kernel's signature; `rows × V` logits in, `rows × V` gradients out at `to`
    // (the logits themselves only with k ≤ STAGED_K, which the kernel stages first).
    unsafe { b.launch(a.config()) }.w()?;
    Ok(())
}
