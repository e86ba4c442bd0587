//! Test helpers: seeded random inputs and f64 reference math written as plain loops (no candle).

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use super::{Normalizer, Temperature};

/// A test's temperature `v` (a valid one: the tests of bad values call [`Temperature::new`]).
pub fn temperature(v: f64) -> Temperature {
    Temperature::new(v).expect("a test temperature is finite and > 0")
}

/// A test's normalizer `n` (a valid one: the tests of bad values call [`Normalizer::new`]).
pub fn normalizer(n: f64) -> Normalizer {
    Normalizer::new(n).expect("a test normalizer is finite and > 0")
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in `[-scale, scale]`.
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

pub fn log_softmax(z: &[f64]) -> Vec<f64> {
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = z.iter().map(|x| (x - m).exp()).sum();
    z.iter().map(|x| x - m - s.ln()).collect()
}

/// Indices of the `k` largest values, descending.
pub fn topk(v: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap());
    idx.truncate(k);
    idx
}

/// A tensor of `dtype` from f64 data.
pub fn tensor(data: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(data.to_vec(), shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A trainable f64 variable.
pub fn var(data: &[f64], shape: &[usize]) -> Var {
    Var::from_tensor(&tensor(data, shape, DType::F64)).unwrap()
}

pub fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

pub use xdistill_testkit::reference::f64s as flat;

/// Central finite differences of `f` at `x`.
pub fn numeric_grad(x: &[f64], h: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = x[i];
            x[i] = x0 + h;
            let up = f(&x);
            x[i] = x0 - h;
            let down = f(&x);
            x[i] = x0;
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Asserts `|a − b| ≤ tol·max(1, |b|)` elementwise.
pub fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * y.abs().max(1.0),
            "{what}[{i}]: got {x}, want {y} (tol {tol})"
        );
    }
}
