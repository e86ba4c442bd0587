//! Global gradient-norm clipping over the parameters' gradients in a `GradStore`.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::Result;

/// The global L2 norm `√(Σ_params Σ g²)` of the gradients of `vars` (missing ones count as 0),
/// accumulated in f64. On the CPU each gradient is read in place (no squared temporary).
pub fn grad_norm(grads: &GradStore, vars: &[Var]) -> Result<f64> {
    if vars.first().is_some_and(|v| v.device().is_cpu()) {
        let mut total = 0.0;
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                total += xdistill_kernels::sum_squares(g)?;
            }
        }
        return Ok(total.sqrt());
    }
    let mut sums = Vec::new();
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            // f32 partial sums per tensor (f64 stays f64), added on the host in f64: one
            // device-to-host transfer in all.
            let dt = if g.dtype() == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            sums.push(g.to_dtype(dt)?.sqr()?.sum_all()?.to_dtype(DType::F64)?);
        }
    }
    if sums.is_empty() {
        return Ok(0.0);
    }
    let total: Vec<f64> = Tensor::stack(&sums, 0)?
        .to_device(&candle_core::Device::Cpu)?
        .to_vec1()?;
    Ok(total.iter().sum::<f64>().sqrt())
}

/// Scales the gradients of `vars` in place so that their global norm is at most `max_norm`
/// (factor `max_norm / (norm + 1e-6)` when above, as PyTorch does) and returns the norm before
/// clipping. A non-finite norm leaves the gradients untouched: the caller should skip the step.
/// `max_norm = 0` only measures.
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f64) -> Result<f64> {
    let norm = grad_norm(grads, vars)?;
    if !norm.is_finite() || max_norm <= 0.0 || norm <= max_norm {
        return Ok(norm);
    }
    let scale = max_norm / (norm + 1e-6);
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let scaled = g.affine(scale, 0.0)?;
            grads.insert(v.as_tensor(), scaled);
        }
    }
    Ok(norm)
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
