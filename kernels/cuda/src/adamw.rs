//! The launch of `adamw.cu`: one AdamW step over every parameter in one kernel, in place, with
//! the CPU kernel's arithmetic (`xdistill_kernels::adamw_update_in_place`: the same bits).

use crate::address::{address, device_of, f32_address, float_kind};
use crate::ptx;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

/// Elements per chunk of the table (a block's share); a length takes 24 bits of the table.
const CHUNK: usize = 1 << 16;
const _: () = assert!(CHUNK < 1 << 24);

/// One parameter of a multi-tensor step: contiguous tensors of one shape on one CUDA device, f32
/// but for the gradient; `param`, `m` and `v` are updated in place (they must not share storage
/// with anything read during the step).
pub struct AdamWTensor<'a> {
    pub param: &'a Tensor,
    /// f32, or bf16 or f16 (a compute copy's gradient, widened exactly in the kernel).
    pub grad: &'a Tensor,
    pub m: &'a Tensor,
    pub v: &'a Tensor,
    /// 0 for parameters that do not decay.
    pub weight_decay: f64,
    /// The parameter's compute copy (bf16 or f16, contiguous, the same shape, its own storage),
    /// written with the updated weight rounded to nearest even, as `to_dtype` would make it:
    /// the forward reads it in place, with no cast and no rebuild after the step.
    pub copy: Option<&'a Tensor>,
}

/// The step's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// 1-based step number (bias correction).
    pub step: u64,
    /// Gradients are first multiplied by this (global-norm clipping), when given.
    pub grad_scale: Option<f64>,
}

/// `m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²; p ← p·(1 − lr·wd) − lr·m̂/(√v̂ + ε)` for every
/// tensor of `tensors`, in one launch; the compute copies given are written from the new `p`
/// (all of one dtype). Gradients may differ in dtype from one tensor to the next.
pub fn adamw_f32(tensors: &[AdamWTensor<'_>], h: AdamWHyper) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    let dev = device_of(first.param)?;
    let stream = dev.cuda_stream();
    let copy_dtype = tensors.iter().find_map(|t| t.copy.map(Tensor::dtype));
    let copy_kind: i32 = match copy_dtype {
        None => 0,
        Some(DType::BF16) => 1,
        Some(DType::F16) => 2,
        Some(other) => bail!("AdamW: compute copies are bf16 or f16, not {other:?}"),
    };
    let mut table: Vec<u64> = Vec::new();
    for t in tensors {
        let dims = t.param.dims();
        if t.grad.dims() != dims || t.m.dims() != dims || t.v.dims() != dims {
            bail!(
                "AdamW: parameter {dims:?}, gradient {:?}, moments {:?} and {:?} differ",
                t.grad.dims(),
                t.m.dims(),
                t.v.dims()
            );
        }
        let [p, m, v] = [t.param, t.m, t.v].map(|x| f32_address(x, &stream));
        let (p, m, v) = (p?, m?, v?);
        let (grad_kind, grad_width) = float_kind(t.grad.dtype())?;
        let g = address(t.grad, t.grad.dtype(), &stream)?;
        let copy = match (t.copy, copy_dtype) {
            (Some(c), Some(dtype)) => {
                if c.dims() != dims {
                    bail!(
                        "AdamW: parameter {dims:?}, compute copy {:?} differ",
                        c.dims()
                    );
                }
                address(c, dtype, &stream)?
            }
            _ => 0,
        };
        let decay = ((1.0 - h.lr * t.weight_decay) as f32).to_bits() as u64;
        let n = t.param.elem_count();
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start) as u64;
            let at = 4 * start as u64;
            let copy = if copy == 0 {
                0
            } else {
                copy + 2 * start as u64
            };
            let g = g + grad_width * start as u64;
            let word = len | (grad_kind << 24) | (decay << 32);
            table.extend([p + at, g, m + at, v + at, copy, word]);
        }
    }
    let n_chunks = (table.len() / 6) as u32;
    if n_chunks == 0 {
        return Ok(());
    }
    let t = h.step.max(1) as i32;
    let (bc1, bc2) = (1.0 - h.beta1.powi(t), 1.0 - h.beta2.powi(t));
    let (beta1, beta2) = (h.beta1 as f32, h.beta2 as f32);
    let args = [
        h.lr as f32,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        (1.0 / bc1) as f32,
        (1.0 / bc2) as f32,
        h.eps as f32,
    ];
    let clip = h.grad_scale.is_some() as i32;
    let scale = h.grad_scale.unwrap_or(1.0) as f32;
    let table = dev.clone_htod(&table)?;
    let func = ptx::function(&dev, &ptx::ADAMW, "adamw_f32")?;
    let cfg = LaunchConfig {
        grid_dim: (n_chunks.min(1 << 16), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&table).arg(&n_chunks);
    for a in &args {
        b.arg(a);
    }
    b.arg(&clip).arg(&scale).arg(&copy_kind);
    // SAFETY: the arguments are the kernel's signature; every address in the table points into
    // a live contiguous tensor (f32, or the copies' dtype) of at least the chunk's length,
    // queued on candle's stream.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
