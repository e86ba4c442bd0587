//! Small helpers for the model's unit tests: fixed noise, a tensor's values, their largest
//! relative difference.

use candle_core::{Device, Tensor};

/// `shape` filled with the crate's LCG noise in [-scale/2, scale/2), f64 on the CPU.
pub(crate) fn data(seed: u64, shape: &[usize], scale: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = crate::init::lcg_noise(seed, n, 1.0)
        .into_iter()
        .map(|x| x as f64 * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

pub(crate) use xdistill_testkit::reference::f64s as values;

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
