//! Rotary position embeddings: the settings of one layer type ([`RopeParams`], checked here),
//! inverse frequencies for every scaling type transformers implements (`default`, `linear`,
//! `dynamic`, `llama3`, `yarn`, `longrope`), computed as `transformers.modeling_rope_utils`
//! computes them (in f64 here), and the cos/sin tables.

use super::error::{invalid, ModelConfigError};
use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

/// RoPE settings of one layer type, as transformers standardises them: the base, the scaling
/// type and every parameter a type reads (absent ones take transformers' defaults).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RopeParams {
    /// `default`, `linear`, `dynamic`, `llama3`, `yarn` or `longrope` (`su` is longrope's
    /// old name).
    #[serde(alias = "type", default = "default_rope_type")]
    pub rope_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_fast: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta_slow: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale_all_dim: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub short_factor: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_factor: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
}

fn default_rope_type() -> String {
    "default".into()
}

impl RopeParams {
    /// `su` is what early Phi-3 configs call `longrope`.
    pub fn kind(&self) -> &str {
        match self.rope_type.as_str() {
            "su" => "longrope",
            other => other,
        }
    }

    /// Checks an implemented type with the parameters it needs, for `rot` rotated dimensions
    /// of each `head_dim`-wide head.
    pub(super) fn validate(
        &self,
        rot: usize,
        head_dim: usize,
    ) -> std::result::Result<(), ModelConfigError> {
        let theta = self.rope_theta.unwrap_or(0.0);
        if !(theta.is_finite() && theta > 0.0) {
            return invalid(format!("rope_theta must be > 0, got {theta}"));
        }
        let partial = self.partial_rotary_factor.unwrap_or(1.0);
        if !(partial > 0.0 && partial <= 1.0) || rot == 0 || !rot.is_multiple_of(2) {
            return invalid(format!(
                "partial_rotary_factor {partial} gives {rot} rotated dimensions of head_dim \
                 {head_dim}: it must be in (0, 1] and give an even number"
            ));
        }
        let need = |name: &str,
                    v: Option<f64>,
                    ok: fn(f64) -> bool|
         -> std::result::Result<(), ModelConfigError> {
            match v {
                Some(x) if ok(x) => Ok(()),
                other => invalid(format!(
                    "rope scaling {:?} needs a valid {name}, got {other:?}",
                    self.rope_type
                )),
            }
        };
        match self.kind() {
            "default" => {}
            "linear" | "dynamic" => need("factor", self.factor, |f| f > 0.0)?,
            "llama3" => {
                need("factor", self.factor, |f| f > 0.0)?;
                need("low_freq_factor", self.low_freq_factor, |f| f > 0.0)?;
                need("high_freq_factor", self.high_freq_factor, |f| f > 0.0)?;
                if self.high_freq_factor <= self.low_freq_factor {
                    return invalid("rope scaling llama3 needs low_freq_factor < high_freq_factor");
                }
            }
            "yarn" => {
                need("factor", self.factor, |f| f >= 1.0)?;
            }
            "longrope" => {
                for (name, f) in [
                    ("short_factor", &self.short_factor),
                    ("long_factor", &self.long_factor),
                ] {
                    match f {
                        Some(v) if v.len() == rot / 2 && v.iter().all(|x| *x > 0.0) => {}
                        other => {
                            return invalid(format!(
                                "rope scaling longrope needs {name} of {} positive numbers, got \
                                 {:?} entries",
                                rot / 2,
                                other.as_ref().map(Vec::len)
                            ))
                        }
                    }
                }
            }
            other => {
                return invalid(format!(
                    "rope scaling type {other:?} (rope_scaling / rope_parameters.rope_type) is \
                     not implemented: default, linear, dynamic, llama3, yarn and longrope are"
                ))
            }
        }
        if self.original_max_position_embeddings == Some(0) {
            return invalid("original_max_position_embeddings must be > 0");
        }
        Ok(())
    }
}

/// Inverse frequencies `[rot/2]` and the attention factor that scales cos and sin.
///
/// `long` picks LongRoPE's long factors (sequences longer than
/// `original_max_position_embeddings`); other types ignore it. `dynamic` is plain RoPE for every
/// length up to `max_position_embeddings`, the only lengths served.
pub fn inv_freqs(p: &RopeParams, rot_dim: usize, max_pos: usize, long: bool) -> (Vec<f64>, f64) {
    let base = p.rope_theta.unwrap_or(10_000.0);
    let dim = rot_dim as f64;
    // base^(2i/dim), i = 0..dim/2
    let pos_freqs: Vec<f64> = (0..rot_dim / 2)
        .map(|i| base.powf(2.0 * i as f64 / dim))
        .collect();
    let plain: Vec<f64> = pos_freqs.iter().map(|f| 1.0 / f).collect();
    let factor = p.factor.unwrap_or(1.0);
    let orig = p.original_max_position_embeddings.unwrap_or(max_pos) as f64;
    match p.kind() {
        "linear" => (plain.iter().map(|f| f / factor).collect(), 1.0),
        "llama3" => (llama3(p, plain), 1.0),
        "yarn" => yarn(p, &pos_freqs, dim, base, orig),
        "longrope" => {
            let ext = if long {
                &p.long_factor
            } else {
                &p.short_factor
            };
            let ext = ext.as_deref().unwrap_or(&[]);
            let inv = pos_freqs
                .iter()
                .zip(ext)
                .map(|(f, e)| 1.0 / (e * f))
                .collect();
            let factor = p.factor.unwrap_or(max_pos as f64 / orig);
            let attention = p.attention_factor.unwrap_or(if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / orig.ln()).sqrt()
            });
            (inv, attention)
        }
        // "default", and "dynamic" below max_position_embeddings.
        _ => (plain, 1.0),
    }
}

/// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
fn llama3(p: &RopeParams, mut inv: Vec<f64>) -> Vec<f64> {
    let factor = p.factor.unwrap_or(1.0);
    let (low, high) = (
        p.low_freq_factor.unwrap_or(1.0),
        p.high_freq_factor.unwrap_or(4.0),
    );
    let old = p.original_max_position_embeddings.unwrap_or(8192) as f64;
    let (low_wl, high_wl) = (old / low, old / high);
    for f in inv.iter_mut() {
        let wl = 2.0 * std::f64::consts::PI / *f;
        if wl > low_wl {
            *f /= factor;
        } else if wl >= high_wl {
            let smooth = (old / wl - low) / (high - low);
            *f = (1.0 - smooth) * *f / factor + smooth * *f;
        }
    }
    inv
}

/// YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between the
/// correction dimensions, and `0.1 ln(factor) + 1` attention scaling.
fn yarn(p: &RopeParams, pos_freqs: &[f64], dim: f64, base: f64, orig: f64) -> (Vec<f64>, f64) {
    let factor = p.factor.unwrap_or(1.0);
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention = p
        .attention_factor
        .unwrap_or_else(|| match (p.mscale, p.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                mscale(factor, m) / mscale(factor, all)
            }
            _ => mscale(factor, 1.0),
        });
    let beta_fast = p.beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0);
    let beta_slow = p.beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0);
    let correction_dim = |rotations: f64| {
        dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if p.truncate.unwrap_or(true) {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001; // as transformers: no division by zero
    }
    let inv = pos_freqs
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            let (inter, extra) = (1.0 / (factor * f), 1.0 / f);
            inter * (1.0 - extrapolation) + extra * extrapolation
        })
        .collect();
    (inv, attention)
}

/// cos/sin tables `[max_pos, rot/2]` of one layer type; LongRoPE keeps a second pair for long
/// sequences.
#[derive(Clone)]
pub struct Rope {
    short: (Tensor, Tensor),
    /// LongRoPE: the tables for sequences longer than the given length.
    long: Option<(usize, (Tensor, Tensor))>,
    /// Rotated dimensions of each head (the rest pass through unrotated).
    pub rotary_dim: usize,
}

impl Rope {
    /// The tables of `p` over `rot` dimensions of each head, for positions `0..max_pos`
    /// (the config resolves all three: [`super::config::ModelConfig::rope`]).
    pub fn new(
        p: &RopeParams,
        rot: usize,
        max_pos: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Rope> {
        let max_pos = max_pos.max(1);
        let table = |long: bool| -> Result<(Tensor, Tensor)> {
            let (inv, attention) = inv_freqs(p, rot, max_pos, long);
            let n = inv.len();
            let mut cos = Vec::with_capacity(max_pos * n);
            let mut sin = Vec::with_capacity(max_pos * n);
            for pos in 0..max_pos {
                for f in &inv {
                    let a = pos as f64 * f;
                    cos.push((a.cos() * attention) as f32);
                    sin.push((a.sin() * attention) as f32);
                }
            }
            Ok((
                Tensor::from_vec(cos, (max_pos, n), dev)?.to_dtype(dtype)?,
                Tensor::from_vec(sin, (max_pos, n), dev)?.to_dtype(dtype)?,
            ))
        };
        let long = match (p.kind(), p.original_max_position_embeddings) {
            ("longrope", Some(orig)) if orig < max_pos => Some((orig, table(true)?)),
            _ => None,
        };
        Ok(Rope {
            short: table(false)?,
            long,
            rotary_dim: rot,
        })
    }

    /// The tables for a sequence of `total` positions (LongRoPE switches on its length, as
    /// transformers does for one sequence).
    pub fn tables(&self, total: usize) -> (&Tensor, &Tensor) {
        match &self.long {
            Some((orig, (c, s))) if total > *orig => (c, s),
            _ => (&self.short.0, &self.short.1),
        }
    }
}
