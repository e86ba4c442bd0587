//! Gradient accumulation in place: a micro-batch's gradients (f32, bf16 or f16) widened into, or
//! added to, their f32 sums. On CUDA with the project's kernels every parameter takes one launch
//! (`kernels/cuda/src/grad_accumulate.cu`) instead of a cast and an add each (about 620 launches
//! and allocations a step for Qwen3's 310 tensors); on the CPU one pass per tensor. Each element
//! is the bits of candle's `sum + g.to_dtype(f32)` (or of the cast alone): widening is exact and
//! the add is one f32 add.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Tensor};
use rayon::prelude::*;

/// One gradient and its f32 sum, both contiguous with as many elements, on one device; `dst` is
/// written in place and must not share storage with any `src`.
pub struct GradSum<'a> {
    /// The gradient: f32, bf16 or f16.
    pub src: &'a Tensor,
    /// The f32 sum.
    pub dst: &'a Tensor,
    /// `dst ← dst + src` when true, `dst ← src` (widened) otherwise.
    pub add: bool,
}

/// Whether [`grad_accumulate`] runs on `device`: the CPU, or CUDA with the project's kernels on
/// (`xdistill_shared::device::cuda_kernels`).
pub fn applies(device: &Device) -> bool {
    match device {
        Device::Cpu => true,
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => xdistill_shared::device::cuda_kernels(),
        _ => false,
    }
}

/// Every entry's `dst ← src` or `dst ← dst + src` (f32), in place: one launch for all on CUDA.
pub fn grad_accumulate(entries: &[GradSum<'_>]) -> Result<()> {
    let Some(first) = entries.first() else {
        return Ok(());
    };
    for e in entries {
        if e.dst.dtype() != DType::F32 || !e.dst.is_contiguous() || !e.src.is_contiguous() {
            bail!(
                "gradient accumulation: a contiguous gradient into a contiguous f32 sum, got {:?} {:?} into {:?} {:?}",
                e.src.dtype(),
                e.src.dims(),
                e.dst.dtype(),
                e.dst.dims()
            );
        }
        if e.src.elem_count() != e.dst.elem_count() {
            bail!(
                "gradient accumulation: gradient {:?} into a sum {:?}",
                e.src.dims(),
                e.dst.dims()
            );
        }
    }
    if !applies(first.dst.device()) {
        bail!(
            "gradient accumulation in place runs on the CPU and, with the project's kernels, on CUDA"
        );
    }
    #[cfg(feature = "cuda")]
    if first.dst.device().is_cuda() {
        let entries: Vec<_> = entries
            .iter()
            .map(|e| xdistill_cuda_kernels::GradSum {
                src: e.src,
                dst: e.dst,
                add: e.add,
            })
            .collect();
        return xdistill_cuda_kernels::grad_accumulate_f32(&entries);
    }
    for e in entries {
        e.dst.inplace_op2(e.src, &AccumulateInto { add: e.add })?;
    }
    Ok(())
}

/// The CPU pass of one entry.
struct AccumulateInto {
    add: bool,
}

fn into<T: Copy + Send + Sync>(
    dst: &mut [f32],
    src: &[T],
    add: bool,
    widen: impl Fn(T) -> f32 + Sync,
) {
    dst.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(d, s)| {
            if add {
                d.iter_mut().zip(s).for_each(|(d, &s)| *d += widen(s));
            } else {
                d.iter_mut().zip(s).for_each(|(d, &s)| *d = widen(s));
            }
        });
}

impl candle_core::InplaceOp2 for AccumulateInto {
    fn name(&self) -> &'static str {
        "xdistill-grad-accumulate"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dl: &Layout,
        src: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let (Some((d0, d1)), Some((s0, s1))) = (dl.contiguous_offsets(), sl.contiguous_offsets())
        else {
            bail!("gradient accumulation needs contiguous tensors");
        };
        let CpuStorage::F32(d) = dst else {
            bail!("gradient accumulation sums in f32");
        };
        let d = &mut d[d0..d1];
        match src {
            CpuStorage::F32(s) => into(d, &s[s0..s1], self.add, |x| x),
            CpuStorage::BF16(s) => into(d, &s[s0..s1], self.add, half::bf16::to_f32),
            CpuStorage::F16(s) => into(d, &s[s0..s1], self.add, half::f16::to_f32),
            other => bail!(
                "gradient accumulation takes f32, bf16 or f16 gradients, not {:?}",
                other.dtype()
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against candle's cast and add, bit for bit: each source dtype, both modes, sums that are
    /// views at an offset of one buffer.
    #[test]
    fn equals_candles_cast_and_add() {
        let dev = Device::Cpu;
        let n = 40_000; // over a chunk of the parallel pass
        let base: Vec<f32> = (0..2 * n)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 977) as f32 * 3.1e-4 - 0.15)
            .collect();
        let g = Tensor::from_vec(g, n, &dev).unwrap();
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let src = g.to_dtype(dt).unwrap();
            for add in [false, true] {
                let flat = Tensor::from_vec(base.clone(), 2 * n, &dev).unwrap();
                let dst = flat.narrow(0, 7, n).unwrap();
                let before = dst.copy().unwrap();
                grad_accumulate(&[GradSum {
                    src: &src,
                    dst: &dst,
                    add,
                }])
                .unwrap();
                let widened = src.to_dtype(DType::F32).unwrap();
                let want = if add {
                    (before + widened).unwrap()
                } else {
                    widened
                };
                let (got, want) = (
                    dst.to_vec1::<f32>().unwrap(),
                    want.to_vec1::<f32>().unwrap(),
                );
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dt:?} add={add}"
                );
                // Outside the view, the buffer is untouched.
                let all = flat.to_vec1::<f32>().unwrap();
                assert_eq!(all[..7], base[..7]);
                assert_eq!(all[7 + n..], base[7 + n..]);
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_sum() {
        let dev = Device::Cpu;
        let f64_sum = Tensor::zeros(4, DType::F64, &dev).unwrap();
        let g = Tensor::zeros(4, DType::F32, &dev).unwrap();
        let short = Tensor::zeros(3, DType::F32, &dev).unwrap();
        let e = |src, dst| {
            grad_accumulate(&[GradSum {
                src,
                dst,
                add: true,
            }])
        };
        assert!(e(&g, &f64_sum).is_err());
        assert!(e(&g, &short).is_err());
        let strided = Tensor::zeros((2, 2), DType::F32, &dev)
            .unwrap()
            .t()
            .unwrap();
        assert!(e(&g.reshape((2, 2)).unwrap(), &strided).is_err());
    }
}
