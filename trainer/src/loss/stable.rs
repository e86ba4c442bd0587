//! Numerically stable building blocks with a backward pass: log-softmax, logsumexp, log1mexp,
//! masked means.

use candle_core::{Tensor, D};

use super::Result;

/// Log-probabilities below this are treated as zero probability (keeps `0·(−∞)` out of sums).
pub const LOG_FLOOR: f64 = -1.0e4;

/// Smallest tail mass `1 − Σ_K p` the tail bucket keeps: f32 log-probs sum to 1 only to about
/// 1e-6, so smaller tails are rounding noise (and `log 0` would be −∞).
pub const TAIL_FLOOR: f64 = 1.0e-6;

/// `log_softmax` over the last dim, `[.., V] -> [.., V]`, with a backward pass: the fused
/// one-pass kernel on the CPU (`xdistill_kernels`), composed ops elsewhere.
pub fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    Ok(xdistill_kernels::log_softmax(x)?)
}

/// `softmax` over the last dim with a backward pass, `[.., V] -> [.., V]`.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

/// `log Σ exp` over the last dim, `[.., n] -> [..]`. At least one entry per row must be finite.
pub fn logsumexp_last(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let s = x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok((s + m)?.squeeze(D::Minus1)?)
}

/// Elementwise `log(e^a + e^b)`.
pub fn logaddexp(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let m = a.maximum(b)?.detach();
    let s = (a - &m)?.exp()? + (b - &m)?.exp()?;
    Ok((s?.log()? + m)?)
}

/// Elementwise `log(1 − e^x)` for `x ≤ 0`, stable at both ends, with `1 − e^x` floored at
/// `floor` (where the floor binds, no gradient flows).
///
/// For `x < −ln 2` it is `log(1 − e^x)`; above, `log(−expm1(x))` with
/// `expm1(x) = 2·tanh(x/2) / (1 − tanh(x/2))` (tanh is accurate near 0 and has a backward pass).
/// Each branch gets a clamped input, so the unused branch never produces an infinite gradient.
pub fn log1mexp(x: &Tensor, floor: f64) -> Result<Tensor> {
    let x_max = (-floor).ln_1p();
    let x = x.minimum(x_max)?;
    let split = -std::f64::consts::LN_2;
    let lo = x.minimum(split)?.exp()?.affine(-1.0, 1.0)?.log()?;
    let th = x.maximum(split)?.affine(0.5, 0.0)?.tanh()?;
    let hi = (th.affine(-2.0, 0.0)?.log()? - th.affine(-1.0, 1.0)?.log()?)?;
    Ok(x.lt(split)?.where_cond(&lo, &hi)?)
}

/// `Σ per_unit·mask / N` with `N = normalizer` or else `Σ mask` (0 when nothing is valid).
/// Returns the scalar loss and the local count `Σ mask`. Shapes: `per_unit`, `mask` the same.
pub fn masked_mean(
    per_unit: &Tensor,
    mask: &Tensor,
    normalizer: Option<f64>,
) -> Result<(Tensor, f64)> {
    let count = mask_count(mask)?;
    Ok((masked_mean_known(per_unit, mask, count, normalizer)?, count))
}

/// [`masked_mean`] when the caller knows `count = Σ mask` (built from host data): nothing is
/// read back from the device, so a GPU's queue keeps running.
pub fn masked_mean_known(
    per_unit: &Tensor,
    mask: &Tensor,
    count: f64,
    normalizer: Option<f64>,
) -> Result<Tensor> {
    let n = normalizer.unwrap_or(count);
    let total = (per_unit * mask.to_dtype(per_unit.dtype())?)?.sum_all()?;
    let scale = if n > 0.0 { 1.0 / n } else { 0.0 };
    Ok(total.affine(scale, 0.0)?)
}

/// `Σ mask`, read back to the host.
pub fn mask_count(mask: &Tensor) -> Result<f64> {
    Ok(mask
        .to_dtype(candle_core::DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn ref_log1mexp(x: f64) -> f64 {
        // Reference: the textbook two-branch form with the standard library's expm1 / ln_1p.
        if x < -std::f64::consts::LN_2 {
            (-x.exp()).ln_1p()
        } else {
            (-x.exp_m1()).ln()
        }
    }

    #[test]
    fn log1mexp_matches_reference_in_f32_and_f64() {
        let xs = [-50.0, -5.0, -1.0, -0.7, -0.69, -0.3, -1e-2, -1e-4, -3e-6];
        for dtype in [DType::F32, DType::F64] {
            let t = Tensor::new(&xs[..], &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let got: Vec<f64> = log1mexp(&t, 1e-9)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            // Relative tolerance, plus the absolute rounding of `1 − e^x` near 1 (no log1p in
            // candle: for x = −50 the result rounds to 0 instead of −2e-22).
            let (tol, abs) = if dtype == DType::F32 {
                (1e-5, 1e-7)
            } else {
                (1e-12, 1e-15)
            };
            for (x, g) in xs.iter().zip(&got) {
                let r = ref_log1mexp(*x);
                assert!(
                    (g - r).abs() <= tol * r.abs() + abs,
                    "{dtype:?} x={x} got {g} want {r}"
                );
            }
        }
    }

    #[test]
    fn log1mexp_floor_keeps_zero_finite_with_zero_gradient() {
        let x = candle_core::Var::new(&[0.0f64, -1e-12], &Device::Cpu).unwrap();
        let y = log1mexp(x.as_tensor(), 1e-6).unwrap();
        let v: Vec<f64> = y.to_vec1().unwrap();
        for v in &v {
            assert!((v - 1e-6f64.ln()).abs() < 1e-9, "{v}");
        }
        let g = y.sum_all().unwrap().backward().unwrap();
        let g: Vec<f64> = g.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        assert_eq!(g, vec![0.0, 0.0]);
    }

    #[test]
    fn log1mexp_gradient_matches_closed_form() {
        let xs = [-3.0f64, -0.5, -0.01];
        let x = candle_core::Var::new(&xs[..], &Device::Cpu).unwrap();
        let g = log1mexp(x.as_tensor(), 1e-9)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g: Vec<f64> = g.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        for (x, g) in xs.iter().zip(g) {
            // d/dx log(1 − e^x) = −e^x / (1 − e^x)
            let want = -x.exp() / (1.0 - x.exp());
            assert!((g - want).abs() < 1e-10 * want.abs(), "x={x} {g} {want}");
        }
    }

    #[test]
    fn masked_mean_uses_count_or_normalizer() {
        let d = Device::Cpu;
        let v = Tensor::new(&[[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]], &d).unwrap();
        let m = Tensor::new(&[[1.0f32, 0.0, 1.0], [0.0, 0.0, 1.0]], &d).unwrap();
        let (l, c) = masked_mean(&v, &m, None).unwrap();
        assert_eq!(c, 3.0);
        assert!((l.to_scalar::<f32>().unwrap() - 10.0 / 3.0).abs() < 1e-6);
        let (l, _) = masked_mean(&v, &m, Some(5.0)).unwrap();
        assert!((l.to_scalar::<f32>().unwrap() - 2.0).abs() < 1e-6);
        let z = m.zeros_like().unwrap();
        let (l, c) = masked_mean(&v, &z, None).unwrap();
        assert_eq!((l.to_scalar::<f32>().unwrap(), c), (0.0, 0.0));
    }
}
