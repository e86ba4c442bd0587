//! Small helpers for the model's unit tests: fixed noise, a tensor's values, their largest
//! relative difference.

use candle_core::{DType, Device, Tensor};

/// `shape` filled with the crate's LCG noise in [-scale/2, scale/2), f64 on the CPU.
pub(crate) fn data(seed: u64, shape: &[usize], scale: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = crate::init::lcg_noise(seed, n, 1.0)
        .into_iter()
        .map(|x| x as f64 * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `t`'s values as f64, in the order of its logical shape.
pub(crate) fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The largest difference relative to the largest |reference| (`a` and `b` of one shape).
pub(crate) fn worst(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (values(a), values(b));
    let scale = b.iter().fold(1e-300f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
