//! Every parameter of a decoder with its Hugging Face name, shape and initialisation.
//!
//! The list is read off the loader itself: the architecture files are run against a builder
//! that records each name and shape it is asked for (and allocates nothing), so the names
//! `init-model` writes, the checks compare with safetensors headers, and the decoder reads can
//! never disagree.

use super::config::{stored_name, ModelConfig};
use super::decoder::{Decoder, Weights};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::sync::{Arc, Mutex};

/// How `init-model` fills a parameter (transformers' `_init_weights` for these models).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Normal(0, std).
    Normal(f64),
    Ones,
    Zeros,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// Names and shapes, in the order they were asked for.
type Seen = Arc<Mutex<Vec<(String, Vec<usize>)>>>;

/// Records the parameters asked for; answers with zero-stride views of one scalar.
struct Recorder(Seen);

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if let Ok(mut seen) = self.0.lock() {
            seen.push((name.to_string(), s.dims().to_vec()));
        }
        Tensor::zeros((), dtype, dev)?.broadcast_as(s)
    }
    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("parameter {name:?} needs its shape")
    }
    fn contains_tensor(&self, _: &str) -> bool {
        // Optional layouts (fused experts) read as absent: the Hub layout is listed.
        false
    }
}

impl Decoder {
    /// Names of all parameters this decoder reads (for checks that every one gets a gradient).
    pub fn param_names(&self) -> Vec<String> {
        param_specs(self.config(), 0.0)
            .into_iter()
            .map(|p| p.name)
            .collect()
    }
}

/// All parameters of `cfg`, in the order the decoder reads them, named as they are stored.
pub fn param_specs(cfg: &ModelConfig, init_std: f64) -> Vec<ParamSpec> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let vb = VarBuilder::from_backend(Box::new(Recorder(seen.clone())), DType::F32, Device::Cpu);
    // A config `validate` refuses lists what could be read before the refusal.
    let _ = Weights::load(cfg, &vb);
    let plus_one = cfg.facts().is_ok_and(|f| f.norm_plus_one);
    let list = seen.lock().map(|s| s.clone()).unwrap_or_default();
    list.into_iter()
        .map(|(name, shape)| {
            let init = if name.ends_with(".bias") {
                Init::Zeros
            } else if name.ends_with("norm.weight") {
                // Gemma scales by 1 + weight: zero is the identity.
                if plus_one {
                    Init::Zeros
                } else {
                    Init::Ones
                }
            } else {
                Init::Normal(init_std)
            };
            let name = match &cfg.weight_prefix {
                Some(p) => stored_name(p, &name),
                None => name,
            };
            ParamSpec { name, shape, init }
        })
        .collect()
}
