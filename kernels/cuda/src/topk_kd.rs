//! The launches of `topk_kd.cu`: each row's top-k distillation divergence over its logits
//! (with the teacher's and student's masses on K and the row's logsumexp) and its backward, the
//! `[rows, V]` gradient of the logits, for `xdistill_kernels::topk_kd`.

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, Layout, Result};

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

impl TopkKdArgs {
    fn checked(&self) -> Result<(u32, u32, u32)> {
        if self.rows > u32::MAX as usize || self.vocab > u32::MAX as usize || self.k == 0 {
            bail!("topk_kd: {self:?} is out of range");
        }
        Ok((self.rows as u32, self.vocab as u32, self.k as u32))
    }

    /// The checked sizes, and the logits, ids and teacher log-probs dense as the kernels read
    /// them.
    fn inputs(&self, z: &Layout, ids: &Layout, lts: &Layout) -> Result<(u32, u32, u32)> {
        let sizes = self.checked()?;
        dense(z, self.rows * self.vocab, "logits")?;
        dense(ids, self.rows * self.k, "ids")?;
        dense(lts, self.rows * self.k, "teacher log-probs")?;
        Ok(sizes)
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

/// `[rows, 4]` f32: each row's divergence, teacher mass on K, student mass on K, logsumexp.
/// `z` `[rows, V]` (f32, bf16, f16), `ids` `[rows, k]` u32 (distinct per row, below V),
/// `lts` `[rows, k]` f32 teacher log-probs.
pub fn topk_kd_fwd(
    z: (&CudaStorage, &Layout),
    ids: (&CudaStorage, &Layout),
    lts: (&CudaStorage, &Layout),
    a: TopkKdArgs,
) -> Result<CudaStorage> {
    let (rows, v, k) = a.inputs(z.1, ids.1, lts.1)?;
    let dev = z.0.device().clone();
    // SAFETY: the kernel writes the four values of every row.
    let mut out = unsafe { dev.alloc::<f32>((4 * a.rows).max(1))? };
    let iv = ids.0.as_cuda_slice::<u32>()?.slice(ids.1.start_offset()..);
    let lv = lts.0.as_cuda_slice::<f32>()?.slice(lts.1.start_offset()..);
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            if a.rows > 0 {
                let zv = z.0.as_cuda_slice::<$t>()?.slice(z.1.start_offset()..);
                let func = ptx::function(&dev, &ptx::TOPK_KD, concat!("topk_kd_fwd_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&func);
                b.arg(&zv)
                    .arg(&iv)
                    .arg(&lv)
                    .arg(&mut out)
                    .arg(&rows)
                    .arg(&v)
                    .arg(&k);
                b.arg(&a.div)
                    .arg(&a.tail)
                    .arg(&a.beta)
                    .arg(&a.inv_tau)
                    .arg(&a.tail_floor);
                // SAFETY: the kernel's signature; `rows` rows of `V` logits and `k` entries.
                unsafe { b.launch(a.config()) }.w()?;
            }
        }};
    }
    crate::typed!(z.0.dtype(), "topk_kd", run);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The backward of [`topk_kd_fwd`]: the logits' gradient `[rows, V]` (their dtype) from the
/// forward's output `res` `[rows, 4]` and the gradient of each row's divergence, `g` (the first
/// column of a contiguous `[rows, 4]` gradient).
pub fn topk_kd_bwd(
    z: (&CudaStorage, &Layout),
    ids: (&CudaStorage, &Layout),
    lts: (&CudaStorage, &Layout),
    res: (&CudaStorage, &Layout),
    g: (&CudaStorage, &Layout),
    a: TopkKdArgs,
) -> Result<CudaStorage> {
    let (rows, v, k) = a.inputs(z.1, ids.1, lts.1)?;
    dense(res.1, a.rows * 4, "forward output")?;
    dense(g.1, a.rows * 4, "gradient")?;
    let dev = z.0.device().clone();
    let n = a.rows * a.vocab;
    let iv = ids.0.as_cuda_slice::<u32>()?.slice(ids.1.start_offset()..);
    let lv = lts.0.as_cuda_slice::<f32>()?.slice(lts.1.start_offset()..);
    let rv = res.0.as_cuda_slice::<f32>()?.slice(res.1.start_offset()..);
    let gv = g.0.as_cuda_slice::<f32>()?.slice(g.1.start_offset()..);
    let g_stride = 4u32;
    macro_rules! run {
        ($t:ty, $sfx:literal) => {{
            // SAFETY: the kernel writes every column of every row.
            let mut dz = unsafe { dev.alloc::<$t>(n.max(1))? };
            if n > 0 {
                let zv = z.0.as_cuda_slice::<$t>()?.slice(z.1.start_offset()..);
                let func = ptx::function(&dev, &ptx::TOPK_KD, concat!("topk_kd_bwd_", $sfx))?;
                let stream = dev.cuda_stream();
                let mut b = stream.launch_builder(&func);
                b.arg(&zv)
                    .arg(&iv)
                    .arg(&lv)
                    .arg(&rv)
                    .arg(&gv)
                    .arg(&g_stride)
                    .arg(&mut dz);
                b.arg(&rows).arg(&v).arg(&k);
                b.arg(&a.div)
                    .arg(&a.tail)
                    .arg(&a.beta)
                    .arg(&a.inv_tau)
                    .arg(&a.tail_floor);
                // SAFETY: the kernel's signature; `rows × V` logits in and out.
                unsafe { b.launch(a.config()) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(dz, dev.clone())
        }};
    }
    Ok(crate::typed!(z.0.dtype(), "topk_kd", run))
}
