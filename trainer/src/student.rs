//! The trainable student: a [`Decoder`] whose parameters are `Var`s in a `VarMap`.
//!
//! Master weights are f32 `Var`s. Computing in f32 the decoder reads the vars directly (optimizer
//! updates are seen in place). Computing in bf16/f16 (GPU) the decoder reads one compute copy
//! per parameter ([`Student::compute_copies`]), itself a leaf `Var`: the backward stops there,
//! with the bf16 gradient the copy received ([`Student::grad_keys`]; the accumulator sums it in
//! f32 for the master), instead of passing it through a differentiable cast to the master (a
//! cast, a zero tensor and an add per parameter and backward call, in f32). After an optimizer
//! step the copies are rewritten in place: by the multi-tensor AdamW inside its launch, or by
//! [`Student::refresh`]; the decoder is never rebuilt.

use anyhow::{bail, Context, Result};
use candle_core::TensorId;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use xdistill_shared::hf::{ModelConfig, ModelDir};
use xdistill_shared::model::arch::list_names;
use xdistill_shared::model::{param_specs, Decoder, Ops};

pub struct Student {
    pub config: ModelConfig,
    /// Master weights, f32 (or f64 in gradient checks), named as in transformers.
    pub varmap: VarMap,
    /// Dtype the forward pass runs in.
    pub compute_dtype: DType,
    pub device: Device,
    /// tokenizer.json of the model directory it was loaded from (copied on save).
    pub tokenizer_json: PathBuf,
    model: Decoder,
    /// The decoder's compute-dtype copy (a leaf `Var`) of each master it reads in another
    /// dtype, by name.
    copies: HashMap<String, Var>,
}

impl Student {
    /// Loads a Hugging Face directory as trainable f32 master weights.
    /// A GGUF file is refused: its weights are quantized (and stored for inference), and a
    /// student trains f32 master weights from a Hugging Face directory.
    pub fn load(dir: &Path, device: &Device, compute_dtype: DType) -> Result<Student> {
        if xdistill_shared::gguf::is_gguf(dir) {
            bail!(
                "student {} is a GGUF file: a student is trained from a Hugging Face model \
                 directory (config.json, safetensors, tokenizer.json); GGUF files load for \
                 inference only (the teacher, `trainer eval`)",
                dir.display()
            );
        }
        let md =
            ModelDir::open(dir).with_context(|| format!("opening student {}", dir.display()))?;
        refuse_unsupported(&md.config)?;
        // Sizes from config.json are checked against the stored shapes before any allocation.
        crate::model_check::check_model_dir(&md)?;
        let mut tensors = HashMap::new();
        for f in &md.weights {
            let loaded = candle_core::safetensors::load(f, device)
                .with_context(|| format!("reading {}", f.display()))?;
            tensors.extend(loaded);
        }
        Self::from_tensors(
            md.config.clone(),
            tensors,
            md.tokenizer.clone(),
            device,
            DType::F32,
            compute_dtype,
        )
    }

    /// Builds a student from named tensors (every parameter of `config` must be present).
    pub fn from_tensors(
        config: ModelConfig,
        mut tensors: HashMap<String, Tensor>,
        tokenizer_json: PathBuf,
        device: &Device,
        master_dtype: DType,
        compute_dtype: DType,
    ) -> Result<Student> {
        refuse_unsupported(&config)?;
        let varmap = VarMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| anyhow::anyhow!("varmap lock poisoned"))?;
            for spec in param_specs(&config, 0.0) {
                let t = tensors
                    .remove(&spec.name)
                    .with_context(|| format!("checkpoint is missing tensor {:?}", spec.name))?;
                if t.dims() != spec.shape.as_slice() {
                    bail!(
                        "tensor {:?} has shape {:?}, config needs {:?}",
                        spec.name,
                        t.dims(),
                        spec.shape
                    );
                }
                let t = t.to_dtype(master_dtype)?.to_device(device)?;
                data.insert(spec.name, Var::from_tensor(&t)?);
            }
        }
        // Leftovers (e.g. lm_head.weight of a tied checkpoint) are ignored, but said.
        for name in tensors.keys() {
            tracing::debug!(
                "ignoring tensor {name:?} not used by the {} architecture",
                config.model_type
            );
        }
        let (model, copies) = build(&config, &varmap, compute_dtype, device)?;
        Ok(Student {
            config,
            varmap,
            compute_dtype,
            device: device.clone(),
            tokenizer_json,
            model,
            copies,
        })
    }

    /// The decoder for the next forward pass.
    pub fn model(&self) -> &Decoder {
        &self.model
    }

    /// A decoder on the same weights with the fused (inference-only) kernels, for generation.
    /// Its weights are untracked (autograd records nothing during a rollout, so no step's
    /// activations stay alive through a graph). They share the storage of what training reads,
    /// the master vars in f32 and the compute copies in bf16, so no weight is cast or copied
    /// and the decoder sees every optimizer update.
    pub fn inference_model(&self) -> Result<Decoder> {
        let vb = VarBuilder::from_backend(
            Box::new(CastVars {
                vars: self.varmap.clone(),
                detach: true,
                made: Some(Arc::new(Mutex::new(self.copies.clone()))),
            }),
            self.compute_dtype,
            self.device.clone(),
        );
        Ok(self.model.with_weights(vb, Ops::Fused)?)
    }

    /// Rewrites every compute copy in place from its master (a cast and a copy each; no-op in
    /// f32), after an optimizer step that did not write them ([`crate::optim::AdamW::step_with_copies`]).
    pub fn refresh(&mut self) -> Result<()> {
        if self.copies.is_empty() {
            return Ok(());
        }
        for (name, master) in self.named_vars() {
            if let Some(copy) = self.copies.get(&name) {
                copy.set(&master.as_tensor().to_dtype(copy.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The decoder's compute-dtype copies of the masters, by parameter name (none in f32): the
    /// tensors its forward reads, each a leaf `Var` of its own storage, so that an optimizer
    /// may write the updated weights into them in place.
    pub fn compute_copies(&self) -> &HashMap<String, Var> {
        &self.copies
    }

    /// For each of `masters` (the student's vars), the tensor a backward pass through
    /// [`Student::model`] keys its gradient by: its compute copy (the gradient in the compute
    /// dtype), or the master itself when the decoder reads it directly.
    pub fn grad_keys(&self, masters: &[Var]) -> Vec<Tensor> {
        let by_id: HashMap<TensorId, String> = self
            .named_vars()
            .into_iter()
            .map(|(name, v)| (v.as_tensor().id(), name))
            .collect();
        masters
            .iter()
            .map(|m| {
                by_id
                    .get(&m.as_tensor().id())
                    .and_then(|name| self.copies.get(name))
                    .map_or_else(|| m.as_tensor().clone(), |c| c.as_tensor().clone())
            })
            .collect()
    }

    pub fn master_dtype(&self) -> DType {
        self.varmap
            .all_vars()
            .first()
            .map(|v| v.dtype())
            .unwrap_or(DType::F32)
    }

    /// Named master weights (sorted by name for determinism).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let data = self.varmap.data().lock().expect("varmap lock poisoned");
        let mut v: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Current weights as f32 CPU tensors, named as in transformers.
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>> {
        self.named_vars()
            .into_iter()
            .map(|(k, v)| {
                Ok((
                    k,
                    v.as_tensor()
                        .to_dtype(DType::F32)?
                        .to_device(&Device::Cpu)?,
                ))
            })
            .collect()
    }

    /// Writes the student as a Hugging Face directory (loadable by `teacher` and transformers).
    pub fn save(&self, dir: &Path) -> Result<()> {
        xdistill_shared::hf::write_model_dir(
            dir,
            &self.config,
            &self.tensors()?,
            &self.tokenizer_json,
        )?;
        Ok(())
    }

    pub fn num_parameters(&self) -> usize {
        self.varmap.all_vars().iter().map(|v| v.elem_count()).sum()
    }
}

/// Students may be any architecture the teacher serves except mixture-of-experts ones (the
/// router's top-k has no gradient here, and the expert loop is written for scoring), and not the
/// text tower of a multimodal checkpoint (it would be saved under names transformers does not expect).
fn refuse_unsupported(config: &ModelConfig) -> Result<()> {
    let facts = config.facts()?;
    if facts.moe {
        let dense = list_names(|f| (!f.moe).then(|| f.cli_name.to_string()));
        bail!(
            "{} students are not supported (MoE models can be teachers only): distil into a \
             dense architecture ({dense})",
            facts.name
        );
    }
    if let Some(prefix) = &config.weight_prefix {
        bail!(
            "the student is the text tower of a multimodal checkpoint (weights under \
             {prefix:?}): save the text model on its own (e.g. Gemma3ForCausalLM) and train that"
        );
    }
    Ok(())
}

/// The training decoder over `varmap` in `dtype` and the compute copies (leaf `Var`s) it reads.
fn build(
    config: &ModelConfig,
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
) -> Result<(Decoder, HashMap<String, Var>)> {
    let made = Arc::new(Mutex::new(HashMap::new()));
    let vars = CastVars {
        vars: varmap.clone(),
        detach: false,
        made: Some(made.clone()),
    };
    let vb = VarBuilder::from_backend(Box::new(vars), dtype, device.clone());
    let model = Decoder::new(config, vb, Ops::Differentiable)?;
    let copies = std::mem::take(
        &mut *made
            .lock()
            .map_err(|_| anyhow::anyhow!("compute copies lock poisoned"))?,
    );
    Ok((model, copies))
}

/// A builder reading the master vars in `dtype` (use this, not `VarBuilder::from_varmap`, for
/// any decoder over the student's weights: see `CastVars`).
pub fn compute_vars(varmap: &VarMap, dtype: DType, device: &Device) -> VarBuilder<'static> {
    let vars = CastVars {
        vars: varmap.clone(),
        detach: false,
        made: None,
    };
    VarBuilder::from_backend(Box::new(vars), dtype, device.clone())
}

/// The master `Var`s seen in the compute dtype. A `VarMap` alone hands out its vars in their own
/// dtype whatever the builder asks for; this converts them (a no-op when the dtypes agree, so an
/// f32 decoder still reads the vars in place).
struct CastVars {
    vars: VarMap,
    /// Hand out untracked tensors (generation): same storage, no gradient graph.
    detach: bool,
    /// When given, a master read in another dtype is handed out as a leaf `Var` holding its
    /// cast (the compute copy; detached, the same storage untracked), found or recorded here by
    /// name; a name asked for twice, as a tied head's weight may be, gets the same copy.
    /// Otherwise the cast itself (tracked back to the master, or detached).
    made: Option<Arc<Mutex<HashMap<String, Var>>>>,
}

impl SimpleBackend for CastVars {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let var = self.vars.get(s, name, init, dtype, dev)?;
        let made = self.made.as_ref().filter(|_| var.dtype() != dtype);
        let Some(made) = made else {
            let t = var.to_dtype(dtype)?;
            return Ok(if self.detach { t.detach() } else { t });
        };
        let mut made = made
            .lock()
            .map_err(|_| candle_core::Error::msg("compute copies lock poisoned"))?;
        let copy = match made.get(name) {
            Some(c) => c.clone(),
            None => {
                let c = Var::from_tensor(&var.to_dtype(dtype)?.detach())?;
                made.insert(name.to_string(), c.clone());
                c
            }
        };
        Ok(if self.detach {
            copy.as_detached_tensor()
        } else {
            copy.as_tensor().clone()
        })
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("tensor {name:?} needs its shape (VarMap-backed builder)")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars.data().lock().is_ok_and(|d| d.contains_key(name))
    }
}
