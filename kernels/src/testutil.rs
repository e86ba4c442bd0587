//! Test inputs shared by the ops' tests.

use candle_core::{DType, Device, Tensor};

pub(crate) fn data(n: usize, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..n)
        .map(|i| ((i * 37 % 101) as f64 / 10.0) - 5.0)
        .collect();
    Tensor::from_vec(v, (3, 4, n / 12), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// The largest absolute difference of two tensors of one shape, as f64.
pub(crate) fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// A tensor's values, flattened, as f64.
pub(crate) fn to_f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}
