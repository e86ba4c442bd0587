//! `y = x · wᵀ` in blocks of a fixed number of rows, one cuBLAS GEMM per block, every block
//! writing its rows of one output: the packed teacher forward's linear layers
//! (`shared/src/model/packed.rs`). Each block is the same `[block, k] · [k, n]` product, so cuBLAS
//! runs the same kernel for a row whatever else the batch holds (batch-invariant by
//! construction), and the blocks need no copy to be put together (composed, a matmul per block
//! and a copy of each into the concatenation). No `.cu` of its own: the kernel is cuBLAS's, on
//! candle's handle and stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// The shape of one product: `y` `[rows, n]` = `x` `[rows, k]` · `wᵀ` (`w` `[n, k]`), in blocks of
/// `block` rows (`rows` a multiple of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmBlocksArgs {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    pub block: usize,
}

/// `x · wᵀ` for contiguous `x` `[rows, k]` and `w` `[n, k]` of one dtype (f32, bf16 or f16;
/// products summed in f32, as candle's matmul), one GEMM per block of rows: `[rows, n]` in the
/// inputs' dtype.
pub fn gemm_nt_blocks(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    a: GemmBlocksArgs,
) -> Result<CudaStorage> {
    let GemmBlocksArgs { rows, k, n, block } = a;
    for (what, l, count) in [("x", lx, rows * k), ("w", lw, n * k)] {
        if !l.is_contiguous() || l.shape().elem_count() != count {
            bail!(
                "gemm_nt_blocks: {what} {:?} is not {count} contiguous elements",
                l.shape()
            );
        }
    }
    if x.dtype() != w.dtype() {
        bail!("gemm_nt_blocks: x is {:?}, w {:?}", x.dtype(), w.dtype());
    }
    if block == 0 || !rows.is_multiple_of(block) {
        bail!("gemm_nt_blocks: {rows} rows in blocks of {block}");
    }
    let fits = |v: usize| i32::try_from(v).is_ok();
    if !(fits(block) && fits(k) && fits(n)) {
        bail!("gemm_nt_blocks: {block} × {k} × {n} is out of cuBLAS's range");
    }
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let ty = crate::gemm_acc::data_type(x.dtype())?;
    macro_rules! run {
        ($t:ty) => {{
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let ws = w.as_cuda_slice::<$t>()?.slice(lw.start_offset()..);
            // SAFETY: the GEMMs below write every element (`rows × n`).
            let mut y = unsafe { dev.alloc::<$t>((rows * n).max(1))? };
            if rows > 0 && n > 0 {
                let (xp, _sx) = xs.device_ptr(&stream);
                let (wp, _sw) = ws.device_ptr(&stream);
                let (yp, _sy) = y.device_ptr_mut(&stream);
                let (alpha, beta) = (1.0f32, 0.0f32);
                let size = std::mem::size_of::<$t>() as u64;
                for b in 0..rows / block {
                    let xb = xp + (b * block * k) as u64 * size;
                    let yb = yp + (b * block * n) as u64 * size;
                    // Column-major, cuBLAS's view: y_b is [n, block] (ld n), w is [k, n] (ld k,
                    // transposed: [n, k]), x_b is [k, block] (ld k); y_b = wᵀ-view · x_b.
                    // SAFETY: the pointers are the live contiguous storages checked above (and
                    // the output just allocated), of the sizes the dimensions and leading
                    // dimensions describe; the handle runs on candle's stream, where every
                    // other use of these buffers is queued.
                    unsafe {
                        result::gemm_ex(
                            *blas.handle(),
                            sys::cublasOperation_t::CUBLAS_OP_T,
                            sys::cublasOperation_t::CUBLAS_OP_N,
                            n as i32,
                            block as i32,
                            k as i32,
                            &alpha as *const f32 as *const _,
                            wp as *const _,
                            ty,
                            k as i32,
                            xb as *const _,
                            ty,
                            k as i32,
                            &beta as *const f32 as *const _,
                            yb as *mut _,
                            ty,
                            n as i32,
                            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                    .map_err(|e| {
                        candle_core::Error::Cuda(format!("gemm_nt_blocks: {e:?}").into())
                    })?;
                }
            }
            CudaStorage::wrap_cuda_slice(y, dev.clone())
        }};
    }
    Ok(match x.dtype() {
        DType::F32 => run!(f32),
        DType::BF16 => run!(half::bf16),
        DType::F16 => run!(half::f16),
        other => bail!("gemm_nt_blocks takes f32, bf16 or f16, not {other:?}"),
    })
}
