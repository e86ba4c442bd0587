//! Random model parameters, reproducible from a seed: what `trainer init-model` writes and what
//! tests build tiny models from.

use crate::hf::ModelConfig;
use crate::model::{param_specs, Init};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Random parameters for `cfg` on the CPU (f32), reproducible from `seed`: one ChaCha8 stream
/// over the parameters in `param_specs` order, normals by Box–Muller (one draw pair per value).
pub fn random_params(
    cfg: &ModelConfig,
    init_std: f64,
    seed: u64,
) -> candle_core::Result<HashMap<String, Tensor>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = HashMap::new();
    for spec in param_specs(cfg, init_std) {
        let n: usize = spec.shape.iter().product();
        let data: Vec<f32> = match spec.init {
            Init::Ones => vec![1.0; n],
            Init::Zeros => vec![0.0; n],
            Init::Normal(std) => (0..n)
                .map(|_| {
                    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                    let u2: f64 = rng.random::<f64>();
                    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * std) as f32
                })
                .collect(),
        };
        out.insert(spec.name, Tensor::from_vec(data, spec.shape, &Device::Cpu)?);
    }
    Ok(out)
}
