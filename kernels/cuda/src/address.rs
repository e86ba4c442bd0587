//! Device addresses of tensors, for the kernels that take tables of them (multi-tensor ops):
//! the address of a tensor's first element, checked to be a contiguous tensor of the expected
//! dtype on a CUDA device.

use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
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
    if t.dtype() != DType::F32 || !t.is_contiguous() {
        bail!(
            "expected a contiguous f32 tensor, got {:?} {:?} (contiguous: {})",
            t.dtype(),
            t.dims(),
            t.is_contiguous()
        );
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("the project's CUDA kernels run on CUDA devices only");
    };
    let slice = s.as_cuda_slice::<f32>()?.slice(layout.start_offset()..);
    let (ptr, _sync) = slice.device_ptr(stream);
    Ok(ptr)
}
