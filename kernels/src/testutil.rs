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
