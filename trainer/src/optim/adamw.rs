//! AdamW (decoupled weight decay, bias-corrected moments) with f32 master weights.
//!
//! candle's own AdamW keeps its moments in the parameter dtype, which loses updates for bf16
//! parameters. Here every parameter has f32 moments and an f32 master copy (the variable itself
//! when it is already f32); after each step the master is cast back into the variable.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use super::{OptimError, Result};

fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.999
}
fn d_eps() -> f64 {
    1e-8
}
fn d_wd() -> f64 {
    0.01
}
fn d_lr() -> f64 {
    1e-4
}

/// AdamW hyper-parameters (TOML `[optim]`; the learning rate is the schedule's peak).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    #[serde(default = "d_wd")]
    pub weight_decay: f64,
    /// Also decay 1-D parameters (norm weights, biases); by default only matrices decay.
    #[serde(default)]
    pub decay_1d: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: d_lr(),
            beta1: d_beta1(),
            beta2: d_beta2(),
            eps: d_eps(),
            weight_decay: d_wd(),
            decay_1d: false,
        }
    }
}

impl AdamWConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |field, message: String| Err(OptimError::Config { field, message });
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", format!("must be >= 0, got {}", self.lr));
        }
        for (f, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(f, format!("must be in [0, 1), got {b}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", format!("must be > 0, got {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(
                "weight_decay",
                format!("must be >= 0, got {}", self.weight_decay),
            );
        }
        Ok(())
    }
}

struct Param {
    name: String,
    var: Var,
    /// f32 (or f64) master copy when the variable has a narrower dtype.
    master: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

impl Param {
    fn weights(&self) -> Result<Tensor> {
        Ok(match &self.master {
            Some(m) => m.clone(),
            None => self.var.as_detached_tensor(),
        })
    }
}

/// Everything needed to resume the optimiser exactly: the update count and, per parameter
/// `name`, the tensors `name.exp_avg`, `name.exp_avg_sq` and (narrow parameters only)
/// `name.master`.
#[derive(Debug, Clone)]
pub struct OptimizerState {
    pub step: u64,
    pub tensors: HashMap<String, Tensor>,
}

/// AdamW over named variables.
pub struct AdamW {
    params: Vec<Param>,
    config: AdamWConfig,
    step: u64,
}

impl AdamW {
    /// An optimiser over `vars` (name, variable); non-float variables are ignored.
    pub fn with_names(vars: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        let mut params = Vec::new();
        for (name, var) in vars {
            let dtype = var.dtype();
            if !dtype.is_float() {
                continue;
            }
            let master_dtype = if dtype == DType::F64 {
                DType::F64
            } else {
                DType::F32
            };
            let master = if dtype == master_dtype {
                None
            } else {
                Some(var.as_detached_tensor().to_dtype(master_dtype)?)
            };
            let m = Tensor::zeros(var.shape(), master_dtype, var.device())?;
            let v = m.zeros_like()?;
            let decay = config.decay_1d || var.rank() >= 2;
            params.push(Param {
                name,
                var,
                master,
                m,
                v,
                decay,
            });
        }
        Ok(Self {
            params,
            config,
            step: 0,
        })
    }

    /// An optimiser over every variable of `varmap`, named as in the map (sorted by name).
    pub fn from_varmap(varmap: &VarMap, config: AdamWConfig) -> Result<Self> {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| OptimError::State("the VarMap lock is poisoned".into()))?;
        let mut vars: Vec<(String, Var)> =
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        drop(data);
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Self::with_names(vars, config)
    }

    /// The learning rate of the next [`AdamW::step`].
    pub fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    /// Sets the learning rate (call with the schedule's value before each step).
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// Number of updates taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The variables being optimised, in order.
    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    /// One AdamW update from `grads` (variables without a gradient are left unchanged):
    /// `w ← w·(1 − lr·wd) − lr·m̂/(√v̂ + ε)`, `m̂ = m/(1 − β1^t)`, `v̂ = v/(1 − β2^t)`.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.multi_tensor_applies(grads) {
            self.step += 1;
            return self.step_multi_tensor(grads, None, &HashMap::new());
        }
        self.step += 1;
        let c = &self.config;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for p in self.params.iter_mut() {
            let Some(g) = grads.get(p.var.as_tensor()) else {
                continue;
            };
            let g = g.detach().to_dtype(p.m.dtype())?;
            // Fast path (CPU, f32 weights without a master copy): the fused in-place kernels do
            // the same update in three passes with no temporaries.
            if p.master.is_none() {
                let h = xdistill_kernels::AdamWStep {
                    lr: c.lr,
                    beta1: c.beta1,
                    beta2: c.beta2,
                    eps: c.eps,
                    weight_decay: if p.decay { c.weight_decay } else { 0.0 },
                    step: self.step,
                };
                if xdistill_kernels::adamw_update_in_place(p.var.as_tensor(), &g, &p.m, &p.v, h)? {
                    continue;
                }
            }
            // 1. Moments.
            let m = (p.m.affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            let v = (p.v.affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            // 2. Bias-corrected direction.
            let denom = v.affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, c.eps)?;
            let dir = m.affine(1.0 / bc1, 0.0)?.div(&denom)?;
            // 3. Decoupled decay, then the step.
            let mut w = p.weights()?;
            if p.decay && c.weight_decay > 0.0 {
                w = w.affine(1.0 - c.lr * c.weight_decay, 0.0)?;
            }
            let w = (w - dir.affine(c.lr, 0.0)?)?;
            match &mut p.master {
                Some(master) => {
                    p.var.set(&w.to_dtype(p.var.dtype())?)?;
                    *master = w;
                }
                None => p.var.set(&w)?,
            }
            p.m = m;
            p.v = v;
        }
        Ok(())
    }

    /// [`AdamW::step`] after multiplying every gradient by `clip` when given (the global-norm
    /// clipping factor, [`super::clip_scale`]): in place in `grads` as [`super::clip_to`]
    /// does, or, on CUDA with the project's kernels, inside the one update launch.
    pub fn step_clipped(&mut self, grads: &mut GradStore, clip: Option<f64>) -> Result<()> {
        self.step_with_copies(grads, clip, &HashMap::new())?;
        Ok(())
    }

    /// [`AdamW::step_clipped`], and where it runs as the one multi-tensor launch, the compute
    /// copies `copies` (by parameter name, [`crate::student::Student::compute_copies`]) written
    /// in the same launch from the updated weights. Returns whether they were (else the caller
    /// refreshes them); with no copies, whether the step ran as that launch.
    pub fn step_with_copies(
        &mut self,
        grads: &mut GradStore,
        clip: Option<f64>,
        copies: &HashMap<String, Var>,
    ) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if self.multi_tensor_applies(grads) {
            self.step += 1;
            self.step_multi_tensor(grads, clip, copies)?;
            return Ok(true);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = copies;
        if let Some(s) = clip {
            for p in &self.params {
                if let Some(g) = grads.get(p.var.as_tensor()) {
                    // In the moments' dtype first: a bf16 gradient scaled in bf16 would round.
                    let scaled = g.to_dtype(p.m.dtype())?.affine(s, 0.0)?;
                    grads.insert(p.var.as_tensor(), scaled);
                }
            }
        }
        self.step(grads)?;
        Ok(false)
    }

    /// Whether [`AdamW::step_multi_tensor`] runs this step: the project's CUDA kernels on, and
    /// every parameter an f32 variable on a CUDA device (no master copy) whose gradient, if it
    /// has one, is contiguous f32, bf16 or f16.
    #[cfg(feature = "cuda")]
    fn multi_tensor_applies(&self, grads: &GradStore) -> bool {
        use candle_core::DType;
        xdistill_shared::device::cuda_kernels()
            && self.params.iter().all(|p| {
                p.var.device().is_cuda()
                    && p.master.is_none()
                    && p.var.dtype() == DType::F32
                    && p.var.is_contiguous()
                    && grads.get(p.var.as_tensor()).is_none_or(|g| {
                        matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
                            && g.is_contiguous()
                    })
            })
    }

    /// The step of [`AdamW::step`] over every parameter with a gradient in one launch
    /// (`kernels/cuda/src/adamw.cu`), in place, with the CPU kernel's arithmetic; each
    /// parameter's compute copy in `copies` is written from its new weight. A parameter
    /// without a gradient keeps its weight, so its copy stays right.
    #[cfg(feature = "cuda")]
    fn step_multi_tensor(
        &mut self,
        grads: &GradStore,
        grad_scale: Option<f64>,
        copies: &HashMap<String, Var>,
    ) -> Result<()> {
        let c = &self.config;
        let mut tensors = Vec::with_capacity(self.params.len());
        for p in &self.params {
            if let Some(g) = grads.get(p.var.as_tensor()) {
                tensors.push(xdistill_cuda_kernels::AdamWTensor {
                    param: p.var.as_tensor(),
                    grad: g,
                    m: &p.m,
                    v: &p.v,
                    weight_decay: if p.decay { c.weight_decay } else { 0.0 },
                    copy: copies.get(&p.name).map(Var::as_tensor),
                });
            }
        }
        let h = xdistill_cuda_kernels::AdamWHyper {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            step: self.step,
            grad_scale,
        };
        xdistill_cuda_kernels::adamw_f32(&tensors, h)?;
        Ok(())
    }

    /// A copy of the optimiser state (moments, masters, step) for a checkpoint.
    pub fn state_dict(&self) -> Result<OptimizerState> {
        let mut tensors = HashMap::new();
        for p in &self.params {
            tensors.insert(format!("{}.exp_avg", p.name), p.m.copy()?);
            tensors.insert(format!("{}.exp_avg_sq", p.name), p.v.copy()?);
            if let Some(m) = &p.master {
                tensors.insert(format!("{}.master", p.name), m.copy()?);
            }
        }
        Ok(OptimizerState {
            step: self.step,
            tensors,
        })
    }

    /// Restores a state written by [`AdamW::state_dict`] for the same parameters (names, shapes).
    /// Masters are written back into the variables, so a resumed run continues bit-identically.
    pub fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        let get = |key: String, like: &Tensor| -> Result<Tensor> {
            let t = state
                .tensors
                .get(&key)
                .ok_or_else(|| OptimError::State(format!("missing tensor `{key}`")))?;
            if t.dims() != like.dims() {
                return Err(OptimError::State(format!(
                    "`{key}` has shape {:?}, the parameter needs {:?}",
                    t.dims(),
                    like.dims()
                )));
            }
            Ok(t.to_dtype(like.dtype())?.to_device(like.device())?.copy()?)
        };
        let mut expected = 0;
        let mut loaded = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let m = get(format!("{}.exp_avg", p.name), &p.m)?;
            let v = get(format!("{}.exp_avg_sq", p.name), &p.v)?;
            let master = match &p.master {
                Some(w) => Some(get(format!("{}.master", p.name), w)?),
                None => None,
            };
            expected += 2 + usize::from(master.is_some());
            loaded.push((m, v, master));
        }
        if state.tensors.len() != expected {
            return Err(OptimError::State(format!(
                "{} tensors in the state, {expected} expected for these parameters",
                state.tensors.len()
            )));
        }
        for (p, (m, v, master)) in self.params.iter_mut().zip(loaded) {
            p.m = m;
            p.v = v;
            if let Some(w) = master {
                p.var.set(&w.to_dtype(p.var.dtype())?)?;
                p.master = Some(w);
            }
        }
        self.step = state.step;
        Ok(())
    }
}

/// Lets the trainer use candle's `Optimizer` trait; parameters are named `param.{i}`.
impl candle_nn::Optimizer for AdamW {
    type Config = AdamWConfig;

    fn new(vars: Vec<Var>, config: AdamWConfig) -> candle_core::Result<Self> {
        let named = vars
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("param.{i}"), v))
            .collect();
        AdamW::with_names(named, config).map_err(candle_core::Error::wrap)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        AdamW::step(self, grads).map_err(candle_core::Error::wrap)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

#[cfg(test)]
mod tests;
