//! Device addresses of tensors, for the kernels that take tables of them (multi-tensor ops):
//! the address of a tensor's first element, checked to be a contiguous tensor of the expected
//! dtype on a CUDA device.

use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{bail, DType, Result, Storage, Tensor};
use std::sync::Arc;

/// The CUDA device of `t`.
pub fn device_of(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        _ => bail!("the project's CUDA kernels run on CUDA devices only"),
    }
}

/// The device address of `t`'s first element: `t` must be contiguous f32 on a CUDA device. The
/// address stays valid while `t` (or another handle of its storage) lives; work using it must
/// be queued on `stream`, candle's.
pub fn f32_address(t: &Tensor, stream: &Arc<CudaStream>) -> Result<u64> {
    address(t, DType::F32, stream)
}

/// [`f32_address`] for a contiguous tensor of `dtype` (f32, bf16 or f16).
pub fn address(t: &Tensor, dtype: DType, stream: &Arc<CudaStream>) -> Result<u64> {
    if t.dtype() != dtype || !t.is_contiguous() {
        bail!(
            "expected a contiguous {dtype:?} tensor, got {:?} {:?} (contiguous: {})",
            t.dtype(),
            t.dims(),
            t.is_contiguous()
        );
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("the project's CUDA kernels run on CUDA devices only");
    };
    let at = layout.start_offset();
    match dtype {
        DType::F32 => first_address::<f32>(s, at, stream),
        DType::BF16 => first_address::<half::bf16>(s, at, stream),
        DType::F16 => first_address::<half::f16>(s, at, stream),
        other => bail!("no device address for {other:?} tensors"),
    }
}

/// How the multi-tensor kernels' tables name a float dtype (`0` f32, `1` bf16, `2` f16: see
/// `dtype.cuh`'s users), and its width in bytes.
pub fn float_kind(dtype: DType) -> Result<(u64, u64)> {
    Ok(match dtype {
        DType::F32 => (0, 4),
        DType::BF16 => (1, 2),
        DType::F16 => (2, 2),
        other => bail!("the multi-tensor kernels take f32, bf16 or f16 tensors, not {other:?}"),
    })
}

/// The address of element `at` of `s`, a slice of `T`.
fn first_address<T: CudaDType>(
    s: &CudaStorage,
    at: usize,
    stream: &Arc<CudaStream>,
) -> Result<u64> {
    let view = s.as_cuda_slice::<T>()?.slice(at..);
    let (ptr, _sync) = view.device_ptr(stream);
    Ok(ptr)
}
