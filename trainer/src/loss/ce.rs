//! The student's next-token cross-entropy and how it combines with the distillation term.

use candle_core::{DType, Tensor};

use super::stable::{mask_count, masked_mean_known};
use super::{compute_dtype, CeConfig, LossConfig, LossError, Normalizer, Result};

/// Mean next-token cross-entropy `−log softmax(z_t)[y_t]` over valid positions (temperature 1).
///
/// * `logits`: `[B, T, V]`, row `t` predicts token `t + 1`.
/// * `targets`: `[B, T]` u32, the token `t + 1` (every entry `< V`, masked ones included: use 0).
/// * `mask`: `[B, T]`, 1 = valid.
/// * `normalizer`: global valid-token count for gradient accumulation (else the local count).
///
/// Returns the scalar loss and the local valid count.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    mask: &Tensor,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, f64)> {
    let count = mask_count(mask)?;
    let loss = cross_entropy_known(logits, targets, mask, count, normalizer)?;
    Ok((loss, count))
}

/// [`cross_entropy`] when the caller knows the mask's count `Σ mask` (it built the mask on the
/// host): nothing is read back from the device.
pub fn cross_entropy_known(
    logits: &Tensor,
    targets: &Tensor,
    mask: &Tensor,
    count: f64,
    normalizer: Option<Normalizer>,
) -> Result<Tensor> {
    let (b, t, _v) = logits.dims3()?;
    if targets.dims() != [b, t] || mask.dims() != [b, t] {
        return Err(LossError::input(
            "targets",
            format!(
                "targets {:?} / mask {:?} must be [B, T] = [{b}, {t}]",
                targets.dims(),
                mask.dims()
            ),
        ));
    }
    if targets.dtype() != DType::U32 {
        return Err(LossError::input("targets", "must be u32"));
    }
    let normalizer = normalizer.map(Normalizer::get);
    if xdistill_kernels::TopkKd::runs_on(logits) {
        return fused_cross_entropy(logits, targets, mask, count, normalizer);
    }
    let dt = compute_dtype(logits);
    let z = logits.to_dtype(dt)?;
    // −log p(y) = logsumexp(z) − z[y]; [B, T] (fused on the CPU: no [B, T, V] temporaries).
    let nll = xdistill_kernels::gather_log_softmax(&z, &targets.contiguous()?.unsqueeze(2)?)?
        .squeeze(2)?
        .neg()?;
    masked_mean_known(&nll, &mask.to_dtype(dt)?, count, normalizer)
}

/// [`cross_entropy`] as the fused per-row loss's k = 1 case ([`xdistill_kernels::topk_kd()`]:
/// the target with teacher log-prob 0, forward KL, no tail): one read of the logits each way,
/// in their own dtype. What runs on CUDA with the project's kernels on; on the CPU its f64
/// reference (tested against the composed loss).
pub(crate) fn fused_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    mask: &Tensor,
    count: f64,
    normalizer: Option<f64>,
) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let n = b * t;
    let zero = Tensor::zeros((n, 1), compute_dtype(logits), logits.device())?;
    let out = xdistill_kernels::topk_kd(
        &logits.reshape((n, v))?,
        &targets.reshape((n, 1))?,
        &zero,
        xdistill_kernels::TopkKd::cross_entropy(),
    )?;
    let nll = out.narrow(1, 0, 1)?.reshape((b, t))?;
    masked_mean_known(&nll, &mask.to_dtype(nll.dtype())?, count, normalizer)
}

/// The total loss and the factor the distillation term was multiplied by.
#[derive(Debug, Clone)]
pub struct Combined {
    /// Scalar tensor to call `backward` on.
    pub total: Tensor,
    /// Effective multiplier of KD: `kd_weight`, times `|CE|/|KD|` under dynamic scaling.
    pub kd_scale: f64,
}

/// Combines the distillation loss `kd` and the cross-entropy `ce` (scalars) as `config.ce` says:
/// `none`: `kd_weight·KD`; `weight`: `kd_weight·KD + w·CE`; `dynamic` (NeMo):
/// `kd_weight·sg(|CE|/|KD|)·KD + CE`. The dynamic factor is computed from this call's values
/// (per micro-batch under gradient accumulation).
pub fn combine(kd: &Tensor, ce: Option<&Tensor>, config: &LossConfig) -> Result<Combined> {
    let need_ce =
        || ce.ok_or_else(|| LossError::input("ce", "the config's `ce` term needs the CE loss"));
    let w = config.kd_weight;
    let (total, kd_scale) = match config.ce {
        CeConfig::None {} => (kd.affine(w, 0.0)?, w),
        CeConfig::Weight { weight } => {
            let ce = need_ce()?;
            ((kd.affine(w, 0.0)? + ce.affine(weight, 0.0)?)?, w)
        }
        CeConfig::Dynamic {} => {
            let ce = need_ce()?;
            let kd_v = kd.to_dtype(DType::F64)?.to_scalar::<f64>()?.abs();
            let ce_v = ce.to_dtype(DType::F64)?.to_scalar::<f64>()?.abs();
            let s = if kd_v > 1e-12 { ce_v / kd_v } else { 1.0 };
            ((kd.affine(w * s, 0.0)? + ce)?, w * s)
        }
    };
    Ok(Combined { total, kd_scale })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::*;
    use crate::loss::KdConfig;
    use candle_core::Device;

    fn reference(z: &[f64], y: &[u32], mask: &[f64], v: usize) -> f64 {
        let mut s = 0.0;
        for (p, (&y, &m)) in y.iter().zip(mask).enumerate() {
            if m == 1.0 {
                s -= log_softmax(&z[p * v..(p + 1) * v])[y as usize];
            }
        }
        s / mask.iter().sum::<f64>()
    }

    #[test]
    fn cross_entropy_matches_reference_and_gradient() {
        let (b, t, v) = (2, 3, 7);
        let mut r = rng(21);
        let z = uniform(&mut r, b * t * v, 4.0);
        let y: Vec<u32> = (0..b * t).map(|i| (i * 5 % v) as u32).collect();
        let mask = vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
        let yt = Tensor::from_vec(y.clone(), (b, t), &Device::Cpu).unwrap();
        let mt = tensor(&mask, &[b, t], DType::F32);
        let want = reference(&z, &y, &mask, v);
        let (l32, n) = cross_entropy(&tensor(&z, &[b, t, v], DType::F32), &yt, &mt, None).unwrap();
        assert_eq!(n, 5.0);
        assert!((scalar(&l32) - want).abs() < 1e-5 * want);
        let x = var(&z, &[b, t, v]);
        let (l, _) = cross_entropy(x.as_tensor(), &yt, &mt, None).unwrap();
        assert!((scalar(&l) - want).abs() < 1e-12);
        let g = flat(l.backward().unwrap().get(x.as_tensor()).unwrap());
        let fd = numeric_grad(&z, 1e-5, |z| reference(z, &y, &mask, v));
        assert_close(&g, &fd, 1e-8, "ce grad");
        let (lh, _) = cross_entropy(x.as_tensor(), &yt, &mt, Some(normalizer(10.0))).unwrap();
        assert!((scalar(&lh) - want * 5.0 / 10.0).abs() < 1e-12);
    }

    /// The fused form (the per-row loss's k = 1 case; its f64 CPU reference here) against the
    /// f64 loop and central differences, in f64 and f32, with and without a normalizer.
    #[test]
    fn fused_cross_entropy_matches_reference_and_gradient() {
        let (b, t, v) = (2, 3, 7);
        let mut r = rng(22);
        let z = uniform(&mut r, b * t * v, 4.0);
        let y: Vec<u32> = (0..b * t).map(|i| (i * 3 % v) as u32).collect();
        let mask = vec![1.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let yt = Tensor::from_vec(y.clone(), (b, t), &Device::Cpu).unwrap();
        let mt = tensor(&mask, &[b, t], DType::F32);
        let want = reference(&z, &y, &mask, v);
        let x = var(&z, &[b, t, v]);
        let l = fused_cross_entropy(x.as_tensor(), &yt, &mt, 5.0, None).unwrap();
        assert!((scalar(&l) - want).abs() < 1e-12);
        let g = flat(l.backward().unwrap().get(x.as_tensor()).unwrap());
        let fd = numeric_grad(&z, 1e-5, |z| reference(z, &y, &mask, v));
        assert_close(&g, &fd, 1e-8, "fused ce grad");
        let x32 = tensor(&z, &[b, t, v], DType::F32);
        let l32 = fused_cross_entropy(&x32, &yt, &mt, 5.0, Some(10.0)).unwrap();
        assert!((scalar(&l32) - want * 5.0 / 10.0).abs() < 1e-5 * want);
    }

    fn cfg(ce: CeConfig, kd_weight: f64) -> LossConfig {
        LossConfig {
            kd: KdConfig::ForwardKl {},
            tail: None,
            temperature: Temperature::ONE,
            kd_weight,
            ce,
        }
    }

    #[test]
    fn combine_weight_and_dynamic_scaling() {
        let kd = var(&[0.5], &[]);
        let ce = var(&[2.0], &[]);
        let c = combine(
            kd.as_tensor(),
            Some(ce.as_tensor()),
            &cfg(CeConfig::Weight { weight: 0.1 }, 2.0),
        )
        .unwrap();
        assert!((scalar(&c.total) - (2.0 * 0.5 + 0.1 * 2.0)).abs() < 1e-12);

        // Dynamic: value = |CE|/|KD|·KD + CE = 2·CE; d/dKD = |CE|/|KD| = 4 (stop-gradient on the
        // factor), d/dCE = 1.
        let c = combine(
            kd.as_tensor(),
            Some(ce.as_tensor()),
            &cfg(CeConfig::Dynamic {}, 1.0),
        )
        .unwrap();
        assert!((scalar(&c.total) - 4.0).abs() < 1e-12);
        assert_eq!(c.kd_scale, 4.0);
        let g = c.total.backward().unwrap();
        assert_eq!(scalar(g.get(kd.as_tensor()).unwrap()), 4.0);
        assert_eq!(scalar(g.get(ce.as_tensor()).unwrap()), 1.0);

        let c = combine(kd.as_tensor(), None, &cfg(CeConfig::None {}, 0.5)).unwrap();
        assert_eq!(scalar(&c.total), 0.25);
        assert!(combine(kd.as_tensor(), None, &cfg(CeConfig::Dynamic {}, 1.0)).is_err());
    }
}
