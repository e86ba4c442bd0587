//! `acc += gᵀ · x` in f32 by one cuBLAS GEMM (`cublasGemmEx`, β = 1): a weight's gradient
//! summed over row chunks straight into its f32 accumulator (the LM head's `[V, H]`, once per
//! chunk of rows). Composed, each chunk wrote a `[V, H]` product in the compute dtype, filled a
//! `[V, H]` zero tensor and added the product to it (candle's backward), widened the sum to f32
//! and added that to the running sum: about 4 GiB of memory traffic per chunk of Qwen3's head,
//! where this GEMM reads its accumulator once and writes it once, and rounds once, in f32.
//! No `.cu` of its own: the kernel is cuBLAS's, on candle's handle and stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// The shape of one accumulation: `acc` `[o, k]` (f32) += `gᵀ` `[o, m]` · `x` `[m, k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmAccArgs {
    /// Rows of `g` and `x`.
    pub m: usize,
    /// Columns of `g` (rows of `acc`).
    pub o: usize,
    /// Columns of `x` and `acc`.
    pub k: usize,
}

/// cuBLAS's name of an operand dtype (f32, bf16 or f16).
pub(crate) fn data_type(dt: DType) -> Result<sys::cudaDataType> {
    Ok(match dt {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        other => bail!("cuBLAS operands here are f32, bf16 or f16, not {other:?}"),
    })
}

/// `acc` (contiguous f32 `[o, k]`, updated in place) `+= gᵀ · x` for contiguous `g` `[m, o]`
/// and `x` `[m, k]` of one dtype (f32, bf16 or f16), products summed in f32.
pub fn gemm_acc_f32(
    acc: &mut CudaStorage,
    la: &Layout,
    (g, lg): (&CudaStorage, &Layout),
    (x, lx): (&CudaStorage, &Layout),
    a: GemmAccArgs,
) -> Result<()> {
    let GemmAccArgs { m, o, k } = a;
    for (what, l, n) in [("acc", la, o * k), ("g", lg, m * o), ("x", lx, m * k)] {
        if !l.is_contiguous() || l.shape().elem_count() != n {
            bail!(
                "gemm_acc: {what} {:?} is not {n} contiguous elements",
                l.shape()
            );
        }
    }
    if acc.dtype() != DType::F32 || g.dtype() != x.dtype() {
        bail!(
            "gemm_acc: an f32 accumulator and operands of one dtype, got {:?}, {:?}, {:?}",
            acc.dtype(),
            g.dtype(),
            x.dtype()
        );
    }
    let fits = |n: usize| i32::try_from(n).is_ok();
    if !(fits(m) && fits(o) && fits(k)) {
        bail!("gemm_acc: {m} × {o} × {k} is out of cuBLAS's range");
    }
    if m == 0 || o == 0 || k == 0 {
        return Ok(());
    }
    let dev = acc.device().clone();
    let stream = dev.cuda_stream();
    let blas = dev.cublas_handle();
    let ty = data_type(g.dtype())?;
    macro_rules! operand {
        ($s:expr, $l:expr) => {
            match $s.dtype() {
                DType::F32 => {
                    $s.as_cuda_slice::<f32>()?
                        .slice($l.start_offset()..)
                        .device_ptr(&stream)
                        .0
                }
                DType::BF16 => {
                    $s.as_cuda_slice::<half::bf16>()?
                        .slice($l.start_offset()..)
                        .device_ptr(&stream)
                        .0
                }
                DType::F16 => {
                    $s.as_cuda_slice::<half::f16>()?
                        .slice($l.start_offset()..)
                        .device_ptr(&stream)
                        .0
                }
                other => bail!("gemm_acc: {other:?} operands"),
            }
        };
    }
    let gp = operand!(g, lg);
    let xp = operand!(x, lx);
    let mut acc_view = acc
        .as_cuda_slice_mut::<f32>()?
        .slice_mut(la.start_offset()..);
    let (ap, _sync) = acc_view.device_ptr_mut(&stream);
    let (alpha, beta) = (1.0f32, 1.0f32);
    // Column-major, cuBLAS's view: acc is [k, o] (ld k), x is [k, m] (ld k), g is [o, m]
    // (ld o); acc = x · gᵀ + acc.
    // SAFETY: the pointers are the live contiguous storages checked above, of the sizes the
    // dimensions and leading dimensions describe; the handle runs on candle's stream, where
    // every other use of these buffers is queued.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_N,
            sys::cublasOperation_t::CUBLAS_OP_T,
            k as i32,
            o as i32,
            m as i32,
            &alpha as *const f32 as *const _,
            xp as *const _,
            ty,
            k as i32,
            gp as *const _,
            ty,
            o as i32,
            &beta as *const f32 as *const _,
            ap as *mut _,
            sys::cudaDataType::CUDA_R_32F,
            k as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| candle_core::Error::Cuda(format!("gemm_acc: {e:?}").into()))?;
    Ok(())
}
