//! The launch of `topk_rows.cu`: per row of logits `[N, V]` on a CUDA device, the top k (ids and
//! log-probs or scaled logits), the target's log-prob, the logsumexp and optionally the target's
//! rank, in one kernel (one block per row) and with nothing copied to the host.

use crate::ptx;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaStorage, DType, Result, Storage, Tensor};

/// The largest k the kernel sorts in shared memory (`MAX_K` in topk_rows.cu).
pub const MAX_K: usize = 4096;

/// What to compute for each row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopkArgs {
    /// Entries per row (0: only the statistics).
    pub k: usize,
    /// Real tokens: the first `valid` columns (the rest is LM-head padding).
    pub valid: usize,
    /// Logits are divided by it (> 0).
    pub temperature: f32,
    /// Values as log-probs (`z − lse`); otherwise the scaled logits `z`.
    pub logprobs: bool,
    /// Also each target's rank `#{v < valid : z_v ≥ z_target}`.
    pub ranks: bool,
}

/// The kernel's results for `N` rows, on the device.
pub struct RowScores {
    /// `[N, k]` u32, by descending value, ties by ascending id.
    pub ids: Tensor,
    /// `[N, k]` f32.
    pub values: Tensor,
    /// `[N]` f32.
    pub target_logprobs: Tensor,
    /// `[N]` f32: logsumexp of `logits / temperature` over the valid columns.
    pub logsumexp: Tensor,
    /// `[N]` u32, when asked for.
    pub target_ranks: Option<Tensor>,
}

/// Scores `logits` `[N, V]` (f32, bf16 or f16, rows contiguous) against `targets` `[N]` (u32,
/// each below `valid`). Requires `k ≤ valid ≤ V`, `k ≤` [`MAX_K`], `temperature > 0`.
pub fn topk_rows(logits: &Tensor, targets: &Tensor, a: TopkArgs) -> Result<RowScores> {
    let (n, v) = logits.dims2()?;
    if a.k > a.valid || a.valid > v || a.valid == 0 || a.k > MAX_K {
        bail!(
            "topk_rows: need k ({}) <= valid ({}) <= V ({v}), valid > 0 and k <= {MAX_K}",
            a.k,
            a.valid
        );
    }
    if !(a.temperature > 0.0 && a.temperature.is_finite()) {
        bail!("topk_rows: temperature {} is not positive", a.temperature);
    }
    if targets.dims() != [n] {
        bail!("topk_rows: targets {:?} for {n} rows", targets.dims());
    }
    let logits = if logits.stride()[1] == 1 {
        logits.clone()
    } else {
        logits.contiguous()?
    };
    let targets = targets.to_dtype(DType::U32)?.contiguous()?;
    // At temperature 1 the kernels that skip the division (z = x, the same value).
    let unit = a.temperature == 1.0;
    let function = match (logits.dtype(), unit) {
        (DType::F32, false) => "topk_rows_f32",
        (DType::BF16, false) => "topk_rows_bf16",
        (DType::F16, false) => "topk_rows_f16",
        (DType::F32, true) => "topk_rows_f32_t1",
        (DType::BF16, true) => "topk_rows_bf16_t1",
        (DType::F16, true) => "topk_rows_f16_t1",
        (dt, _) => bail!("topk_rows takes f32, bf16 or f16 logits, not {dt:?}"),
    };
    let (ls, ll) = logits.storage_and_layout();
    let (ts, tl) = targets.storage_and_layout();
    let (Storage::Cuda(ls), Storage::Cuda(ts)) = (&*ls, &*ts) else {
        bail!("topk_rows runs on CUDA devices only");
    };
    let dev = ls.device().clone();
    let row_stride = ll.stride()[0] as i64;
    let (n32, valid32, k32) = (n as u32, a.valid as u32, a.k as u32);
    let (logprobs, ranks) = (a.logprobs as i32, a.ranks as i32);
    // SAFETY: the kernel writes every element of each output (ranks only when asked for; a
    // one-element buffer stands in otherwise and is dropped).
    let mut ids = unsafe { dev.alloc::<u32>((n * a.k).max(1))? };
    let mut vals = unsafe { dev.alloc::<f32>((n * a.k).max(1))? };
    let mut target_lp = unsafe { dev.alloc::<f32>(n.max(1))? };
    let mut lse = unsafe { dev.alloc::<f32>(n.max(1))? };
    let mut rank = unsafe { dev.alloc::<u32>(if a.ranks { n.max(1) } else { 1 })? };
    if n > 0 {
        let func = ptx::function(&dev, &ptx::TOPK_ROWS, function)?;
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (n32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        macro_rules! launch_on {
            ($t:ty) => {{
                let x = ls.as_cuda_slice::<$t>()?.slice(ll.start_offset()..);
                let tg = ts.as_cuda_slice::<u32>()?.slice(tl.start_offset()..);
                b.arg(&x)
                    .arg(&row_stride)
                    .arg(&tg)
                    .arg(&n32)
                    .arg(&valid32)
                    .arg(&k32)
                    .arg(&a.temperature)
                    .arg(&logprobs)
                    .arg(&ranks)
                    .arg(&mut ids)
                    .arg(&mut vals)
                    .arg(&mut target_lp)
                    .arg(&mut lse)
                    .arg(&mut rank);
                // SAFETY: the argument list is the kernel's signature; every buffer has the
                // size the kernel indexes (rows `[0, n)`, `k` per row), on candle's stream.
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        match logits.dtype() {
            DType::F32 => launch_on!(f32),
            DType::BF16 => launch_on!(half::bf16),
            _ => launch_on!(half::f16),
        }
    }
    let wrap = |s: CudaStorage, shape: &[usize]| -> Result<Tensor> {
        let t = Tensor::from_storage(
            Storage::Cuda(s),
            shape.iter().product::<usize>().max(1),
            BackpropOp::none(),
            false,
        );
        t.narrow(0, 0, shape.iter().product())?.reshape(shape)
    };
    Ok(RowScores {
        ids: wrap(CudaStorage::wrap_cuda_slice(ids, dev.clone()), &[n, a.k])?,
        values: wrap(CudaStorage::wrap_cuda_slice(vals, dev.clone()), &[n, a.k])?,
        target_logprobs: wrap(CudaStorage::wrap_cuda_slice(target_lp, dev.clone()), &[n])?,
        logsumexp: wrap(CudaStorage::wrap_cuda_slice(lse, dev.clone()), &[n])?,
        target_ranks: if a.ranks {
            Some(wrap(CudaStorage::wrap_cuda_slice(rank, dev.clone()), &[n])?)
        } else {
            None
        },
    })
}
