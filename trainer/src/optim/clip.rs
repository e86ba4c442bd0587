//! Global gradient-norm clipping over the parameters' gradients in a `GradStore`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::Result;

/// `Σ g²` of each of `vars`' gradients (0 where missing), in f64, in `vars` order. On the CPU
/// each gradient is read in place (no squared temporary); elsewhere f32 partial sums per
/// tensor (f64 stays f64) come back in one device-to-host transfer.
pub fn sq_norms(grads: &GradStore, vars: &[Var]) -> Result<Vec<f64>> {
    #[cfg(feature = "cuda")]
    if let Some(sq) = sq_norms_in_one_launch(grads, vars)? {
        return Ok(sq);
    }
    if vars.first().is_some_and(|v| v.device().is_cpu()) {
        return vars
            .iter()
            .map(|v| match grads.get(v.as_tensor()) {
                // A compute copy's gradient (a step of one micro-batch hands it over as the
                // backward made it) widened first: the f32 kernel's bits, as when it was summed
                // in f32.
                Some(g) => Ok(xdistill_kernels::sum_squares(&widened(g)?)?),
                None => Ok(0.0),
            })
            .collect();
    }
    let mut sums = Vec::new();
    let mut present = Vec::with_capacity(vars.len());
    for v in vars {
        let g = grads.get(v.as_tensor());
        present.push(g.is_some());
        if let Some(g) = g {
            let dt = if g.dtype() == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            sums.push(g.to_dtype(dt)?.sqr()?.sum_all()?.to_dtype(DType::F64)?);
        }
    }
    let mut host: std::vec::IntoIter<f64> = if sums.is_empty() {
        Vec::new().into_iter()
    } else {
        Tensor::stack(&sums, 0)?
            .to_device(&candle_core::Device::Cpu)?
            .to_vec1::<f64>()?
            .into_iter()
    };
    Ok(present
        .into_iter()
        .map(|p| if p { host.next().unwrap_or(0.0) } else { 0.0 })
        .collect())
}

/// A gradient in f32 where it is bf16 or f16 (exact): what the optimiser and the norm read.
pub(crate) fn widened(g: &Tensor) -> candle_core::Result<Tensor> {
    match g.dtype() {
        DType::BF16 | DType::F16 => g.to_dtype(DType::F32),
        _ => Ok(g.clone()),
    }
}

/// [`sq_norms`] through the project's CUDA kernel (`kernels/cuda/src/sum_squares.cu`: every
/// gradient in one launch, f64 sums, one copy back) when its kernels are on and every gradient
/// is contiguous f32, bf16 or f16 on a CUDA device; `None` otherwise.
#[cfg(feature = "cuda")]
fn sq_norms_in_one_launch(grads: &GradStore, vars: &[Var]) -> Result<Option<Vec<f64>>> {
    if !xdistill_shared::device::cuda_kernels() {
        return Ok(None);
    }
    let present: Vec<Option<&Tensor>> = vars.iter().map(|v| grads.get(v.as_tensor())).collect();
    let fits = |g: &&Tensor| {
        g.device().is_cuda()
            && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && g.is_contiguous()
    };
    if !present.iter().flatten().all(fits) {
        return Ok(None);
    }
    let tensors: Vec<&Tensor> = present.iter().flatten().copied().collect();
    let mut sums = xdistill_cuda_kernels::sum_squares(&tensors)?.into_iter();
    Ok(Some(
        present
            .iter()
            .map(|g| match g {
                Some(_) => sums.next().unwrap_or(0.0),
                None => 0.0,
            })
            .collect(),
    ))
}

/// The global L2 norm `√(Σ_params Σ g²)` of the gradients of `vars` (missing ones count as 0):
/// [`sq_norms`] added in `vars` order, so a sharded optimiser that gathers its ranks' squares
/// gets the same bits.
pub fn grad_norm(grads: &GradStore, vars: &[Var]) -> Result<f64> {
    Ok(norm_of(&sq_norms(grads, vars)?))
}

/// `√(Σ sq)`, added in order.
pub fn norm_of(sq: &[f64]) -> f64 {
    sq.iter().fold(0.0, |a, b| a + b).sqrt()
}

/// Scales the gradients of `vars` in place so that their global norm is at most `max_norm`
/// (factor `max_norm / (norm + 1e-6)` when above, as PyTorch does) and returns the norm before
/// clipping. A non-finite norm leaves the gradients untouched: the caller should skip the step.
/// `max_norm = 0` only measures.
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> Result<f64> {
    let norm = grad_norm(grads, vars)?;
    clip_to(grads, vars, norm, max_norm)?;
    Ok(norm)
}

/// The scaling of [`clip_grad_norm`] for a norm measured elsewhere (ZeRO-1: over every rank's
/// share).
pub fn clip_to(grads: &mut GradStore, vars: &[Var], norm: f64, max_norm: f64) -> Result<()> {
    let Some(scale) = clip_scale(norm, max_norm) else {
        return Ok(());
    };
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let scaled = widened(g)?.affine(scale, 0.0)?;
            grads.insert(v.as_tensor(), scaled);
        }
    }
    Ok(())
}

/// The factor [`clip_to`] multiplies the gradients by for a global `norm`: `max_norm / (norm +
/// 1e-6)` when the norm is finite and above `max_norm > 0`; `None` (nothing to scale) otherwise.
pub fn clip_scale(norm: f64, max_norm: f64) -> Option<f64> {
    (norm.is_finite() && max_norm > 0.0 && norm > max_norm).then(|| max_norm / (norm + 1e-6))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::{flat, rng, uniform};
    use candle_core::Device;

    fn setup(scale: f64) -> (Vec<Var>, GradStore, Vec<Vec<f64>>) {
        let mut r = rng(51);
        let shapes: [&[usize]; 3] = [&[3, 4], &[7], &[2, 2, 2]];
        let mut vars = vec![];
        let mut g = GradStore::default();
        let mut raw = vec![];
        for s in shapes {
            let n: usize = s.iter().product();
            let v = Var::zeros(s, DType::F32, &Device::Cpu).unwrap();
            let data = uniform(&mut r, n, scale);
            let t = Tensor::from_vec(data.clone(), s, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            g.insert(v.as_tensor(), t);
            vars.push(v);
            // The reference uses the f32-rounded values the store holds.
            raw.push(data.iter().map(|&x| x as f32 as f64).collect());
        }
        (vars, g, raw)
    }

    fn ref_norm(raw: &[Vec<f64>]) -> f64 {
        raw.iter().flatten().map(|x| x * x).sum::<f64>().sqrt()
    }

    #[test]
    fn norm_and_clipping_match_f64() {
        let (vars, mut g, raw) = setup(1.0);
        let want = ref_norm(&raw);
        assert!((grad_norm(&g, &vars).unwrap() - want).abs() < 1e-6 * want);
        let max = want / 3.0;
        let pre = clip_grad_norm(&mut g, &vars, max).unwrap();
        assert!((pre - want).abs() < 1e-6 * want);
        let scale = max / (want + 1e-6);
        for (v, r) in vars.iter().zip(&raw) {
            let got = flat(g.get(v.as_tensor()).unwrap());
            for (a, b) in got.iter().zip(r) {
                assert!((a - b * scale).abs() < 1e-6, "{a} vs {}", b * scale);
            }
        }
        let post = grad_norm(&g, &vars).unwrap();
        assert!((post - max).abs() < 1e-5 * max);
    }

    #[test]
    fn below_the_limit_nothing_changes() {
        let (vars, mut g, raw) = setup(0.01);
        let pre = clip_grad_norm(&mut g, &vars, 10.0).unwrap();
        assert!((pre - ref_norm(&raw)).abs() < 1e-7);
        // max_norm = 0 measures only.
        let pre0 = clip_grad_norm(&mut g, &vars, 0.0).unwrap();
        assert_eq!(pre0, pre);
        for (v, r) in vars.iter().zip(&raw) {
            assert_eq!(&flat(g.get(v.as_tensor()).unwrap()), r);
        }
    }

    #[test]
    fn non_finite_norm_is_reported_not_applied() {
        let (vars, mut g, raw) = setup(1.0);
        let bad =
            Tensor::new(&[f32::INFINITY, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &Device::Cpu).unwrap();
        g.insert(vars[1].as_tensor(), bad);
        let pre = clip_grad_norm(&mut g, &vars, 1.0).unwrap();
        assert!(!pre.is_finite());
        assert_eq!(flat(g.get(vars[0].as_tensor()).unwrap()), raw[0]);
    }
}
