//! GGUF files (llama.cpp's single-file format) loaded as they are: the architecture and
//! hyper-parameters from the metadata ([`config`]), the tokenizer rebuilt from the metadata
//! ([`tokenizer`]), and the weights dequantized at load to the serving dtype under transformers'
//! names ([`names`]), so the same [`crate::model::Decoder`] serves a GGUF file and a Hugging Face
//! directory.
//!
//! Read-only and for inference: a student is trained from Hugging Face directories. Anything
//! not implemented (an architecture, a quantization type, a tokenizer model, RoPE scaling, an
//! unknown tensor) is refused by name, never served approximately.

pub mod config;
pub mod header;
mod meta;
pub mod names;
pub mod tokenizer;
pub mod write;

use crate::hf::ModelConfig;
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use meta::Meta;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a GGUF file cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a readable GGUF file: {message}", path.display())]
    Format { path: PathBuf, message: String },
    #[error("{}: metadata key {key:?}: {message}", path.display())]
    Key {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error(
        "{}: GGUF architecture {arch:?} (general.architecture) is not implemented ({known} are)",
        path.display(),
        known = config::gguf_names()
    )]
    UnsupportedArch { path: PathBuf, arch: String },
    #[error(
        "{}: tensor {tensor:?} is stored as {dtype}, a quantization type this loader does not \
         dequantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K are)",
        path.display()
    )]
    UnsupportedQuant {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{}: tensor {tensor:?}: {message}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
    #[error("{}: building the decoder: {source}", path.display())]
    Decoder {
        path: PathBuf,
        source: candle_core::Error,
    },
}

/// Whether `path` names a GGUF file (a file whose first four bytes are `GGUF`), as opposed to a
/// model directory.
pub fn is_gguf(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// llama.cpp's name of a ggml type (`Q4_K`, not candle's `Q4K`).
pub fn dtype_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

/// The types model files store and this loader dequantizes (`Q8_1`/`Q8_K` are ggml's
/// intermediate dot-product types, never stored by llama.cpp's tools).
fn dequantizable(t: GgmlDType) -> bool {
    !matches!(t, GgmlDType::Q8_1 | GgmlDType::Q8K)
}

/// How a GGUF file's matrices are held for serving (`teacher --gguf-weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightMode {
    /// Every weight dequantized at load to the serving dtype: the scores are those of the
    /// dequantized weights (transformers' GGUF loader scores the same).
    #[default]
    Dequantize,
    /// The attention and MLP projections kept in their block format and run through candle's
    /// quantized matmuls (activations quantized to 8 bits per block, as llama.cpp does): the
    /// scores are the quantized model's own, as llama.cpp computes them, not the dequantized
    /// weights'. The embedding, the LM head (tied or not) and the norms stay dequantized.
    Quantized,
}

/// The weights of a GGUF file with the projections kept quantized
/// ([`GgufModel::quantized_tensors`]).
pub struct QuantizedWeights {
    /// Every weight by transformers' name, for [`candle_nn::VarBuilder::from_tensors`]:
    /// dequantized, except that each entry of `quantized` has a broadcast-zero placeholder of
    /// its shape here (one element of memory), replaced by
    /// [`crate::model::Decoder::quantize_linears`].
    pub dense: HashMap<String, Tensor>,
    /// The projections' `[out, in]` matrices in their stored block format.
    pub quantized: HashMap<String, Arc<QTensor>>,
}

/// Whether transformers parameter `name` is an attention or MLP projection's weight (a linear
/// layer [`crate::model::Decoder::quantize_linears`] can run quantized).
fn is_projection(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with("_proj.weight")
}

/// Whether `t` is a block-quantized type (F32, F16 and BF16 are plain floats: candle's
/// `QMatMul` would dequantize them anyway).
fn is_block_quantized(t: GgmlDType) -> bool {
    !matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// A block-quantized `[out, in]` matrix with llama.cpp's q/k row permutation over `heads` undone
/// ([`names::reverse_permute_rows`]), moving whole rows of blocks; on `device`.
fn permute_block_rows(q: &QTensor, heads: usize, device: &Device) -> candle_core::Result<QTensor> {
    let (rows, cols) = q.shape().dims2()?;
    let row_bytes = cols / q.dtype().block_size() * q.dtype().type_size();
    let data = q.data()?;
    if data.len() != rows * row_bytes {
        candle_core::bail!(
            "{} bytes of {} data for [{rows}, {cols}]",
            data.len(),
            dtype_name(q.dtype())
        );
    }
    let mut out = Vec::with_capacity(data.len());
    for r in names::reverse_permute_rows(rows, heads)? {
        out.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(out), device, q.dtype())?;
    QTensor::new(storage, (rows, cols))
}

/// One weight: its GGUF name, where it goes, and the RoPE permutation to undo.
#[derive(Debug, Clone)]
struct Mapped {
    gguf: String,
    hf: String,
    unpermute: Option<usize>,
}

/// An opened GGUF file: metadata read and checked, no tensor data read yet.
#[derive(Debug)]
pub struct GgufModel {
    pub path: PathBuf,
    /// `general.architecture` as the file says it (`llama`, `qwen2`, `qwen3`).
    pub architecture: String,
    /// The hyper-parameters as a `config.json` would give them.
    pub config: ModelConfig,
    /// The rebuilt `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
    /// Storage types of the matrices, most tensors first (e.g. `["Q4_1", "Q6_K"]`); 1-D
    /// tensors (norms, biases) are F32 in every llama.cpp file and are left out.
    pub quant_types: Vec<String>,
    content: Content,
    tensors: Vec<Mapped>,
}

impl GgufModel {
    /// Reads the metadata and tensor index of `path`, builds the config and the tokenizer and
    /// checks every tensor's name, type and shape against the config; reads no tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufModel, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        // The bounded first pass: candle's reader below trusts what it divides and sizes by.
        header::check(&path)?;
        let mut f = std::fs::File::open(&path).map_err(io)?;
        let content = Content::read(&mut f).map_err(|e| GgufError::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let meta = Meta {
            path: &path,
            map: &content.metadata,
        };
        let architecture = meta.str("general.architecture")?.to_string();
        config::arch_of(&meta, &architecture)?;
        let tok = tokenizer::build(&meta)?;
        let infos = &content.tensor_infos;
        let embed_rows = infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims().first().copied().unwrap_or(0))
            .ok_or_else(|| GgufError::Tensor {
                path: path.clone(),
                tensor: "token_embd.weight".into(),
                message: "missing".into(),
            })?;
        let facts = config::TensorFacts {
            tied: !infos.contains_key("output.weight"),
            attn_bias: infos.contains_key("blk.0.attn_q.bias"),
            embed_rows,
        };
        // The layer count is bounded by the file's own tensors before anything is sized from it
        // (a block_count of 2^32 − 1 must not make a 4-billion-entry list first).
        check_layers(
            &path,
            &architecture,
            meta.usize(&format!("{architecture}.block_count"))?,
            &content,
        )?;
        let config = config::model_config(&meta, &architecture, Some(tok.tokens), &facts)?;
        let tensors = map_tensors(&path, &architecture, &config, &content)?;
        let mut counts: BTreeMap<&'static str, usize> = BTreeMap::new();
        for info in infos.values().filter(|i| i.shape.rank() >= 2) {
            *counts.entry(dtype_name(info.ggml_dtype)).or_default() += 1;
        }
        let mut quant: Vec<(&str, usize)> = counts.into_iter().collect();
        quant.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        Ok(GgufModel {
            path,
            architecture,
            config,
            tokenizer_json: tok.json,
            chat_template: tok.chat_template,
            quant_types: quant.into_iter().map(|(n, _)| n.to_string()).collect(),
            content,
            tensors,
        })
    }

    /// The quantization as `/v1/info` reports it: the matrices' types joined by `+`
    /// (`Q4_1+Q6_K`), most tensors first.
    pub fn quantization(&self) -> String {
        self.quant_types.join("+")
    }

    /// The tokenizer.
    pub fn load_tokenizer(&self) -> Result<tokenizers::Tokenizer, GgufError> {
        crate::tokenizer_json::parse(self.tokenizer_json.as_bytes()).map_err(|e| {
            GgufError::Tokenizer {
                path: self.path.clone(),
                message: format!("the rebuilt tokenizer does not load: {e}"),
            }
        })
    }

    /// sha256 of [`GgufModel::tokenizer_json`], hex.
    pub fn tokenizer_sha256(&self) -> String {
        hex::encode(Sha256::digest(self.tokenizer_json.as_bytes()))
    }

    /// A cheap fingerprint (32 hex digits): sha256 over the file's metadata and tensor index and
    /// the first MiB of tensor data, as [`crate::hf::ModelDir::fingerprint`] does for
    /// safetensors.
    pub fn fingerprint(&self) -> Result<String, GgufError> {
        let io = |source| GgufError::Io {
            path: self.path.clone(),
            source,
        };
        let f = std::fs::File::open(&self.path).map_err(io)?;
        let mut head = Vec::new();
        f.take(self.content.tensor_data_offset.saturating_add(1 << 20))
            .read_to_end(&mut head)
            .map_err(io)?;
        Ok(hex::encode(&Sha256::digest(&head)[..16]))
    }

    /// Every weight, dequantized to `dtype` on `device`, under transformers' names, with
    /// llama.cpp's q/k permutation undone: what [`candle_nn::VarBuilder::from_tensors`] takes.
    pub fn tensors(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<HashMap<String, Tensor>, GgufError> {
        let mut f = self.reader()?;
        let mut out = HashMap::with_capacity(self.tensors.len());
        for m in &self.tensors {
            out.insert(m.hf.clone(), self.dense(&mut f, m, dtype, device)?);
        }
        Ok(out)
    }

    /// The weights with the attention and MLP projections kept in their block format for
    /// candle's quantized matmuls ([`WeightMode::Quantized`]): the projections stored in a
    /// block-quantized type (Q4_0 … Q6_K) go to [`QuantizedWeights::quantized`], q/k rows
    /// un-permuted block row by block row (exact: a row permutation moves whole rows of blocks);
    /// everything else (embedding, LM head, norms, biases, and projections stored as
    /// F32/F16/BF16) is dequantized to `dtype` as by [`GgufModel::tensors`].
    pub fn quantized_tensors(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<QuantizedWeights, GgufError> {
        let mut f = self.reader()?;
        let mut out = QuantizedWeights {
            dense: HashMap::with_capacity(self.tensors.len()),
            quantized: HashMap::new(),
        };
        for m in &self.tensors {
            if !self.keeps_quantized(m) {
                out.dense
                    .insert(m.hf.clone(), self.dense(&mut f, m, dtype, device)?);
                continue;
            }
            let fail = |e: candle_core::Error| GgufError::Tensor {
                path: self.path.clone(),
                tensor: m.gguf.clone(),
                message: e.to_string(),
            };
            let q = self
                .content
                .tensor(&mut f, &m.gguf, &Device::Cpu)
                .map_err(fail)?;
            let shape = q.shape().clone(); // [out, in]
            let q = match m.unpermute {
                Some(heads) => permute_block_rows(&q, heads, device).map_err(fail)?,
                None if device.is_cpu() => q,
                None => {
                    let data = q.data().map_err(fail)?;
                    let storage = QStorage::from_data(data, device, q.dtype()).map_err(fail)?;
                    QTensor::new(storage, shape.clone()).map_err(fail)?
                }
            };
            // A placeholder of the right shape for the decoder's dense build, replaced by
            // `Decoder::quantize_linears`: a broadcast zero holds one element.
            let placeholder = Tensor::zeros((), dtype, device)
                .and_then(|z| z.broadcast_as(shape))
                .map_err(fail)?;
            out.dense.insert(m.hf.clone(), placeholder);
            out.quantized.insert(m.hf.clone(), Arc::new(q));
        }
        Ok(out)
    }

    /// Whether [`WeightMode::Quantized`] keeps tensor `m` in its block format: an attention or
    /// MLP projection stored block-quantized whose rows candle's kernels take. Q4_1, Q5_0 and
    /// Q5_1 rows of an odd number of 32-element blocks stay dense: candle's dot products for
    /// them assert an even count (llama.cpp's legacy kernels work on block pairs).
    fn keeps_quantized(&self, m: &Mapped) -> bool {
        let info = &self.content.tensor_infos[&m.gguf];
        let t = info.ggml_dtype;
        let cols = info.shape.dims().last().copied().unwrap_or(0);
        let blocks = cols / t.block_size();
        let pairs_only = matches!(t, GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1);
        let kernel_takes = !pairs_only || blocks.is_multiple_of(2);
        is_projection(&m.hf) && is_block_quantized(t) && kernel_takes
    }

    /// The file, opened for reading tensor data.
    fn reader(&self) -> Result<std::fs::File, GgufError> {
        std::fs::File::open(&self.path).map_err(|source| GgufError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// Tensor `m`, dequantized to `dtype` on `device`, its q/k permutation undone.
    fn dense(
        &self,
        f: &mut std::fs::File,
        m: &Mapped,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, GgufError> {
        let fail = |e: candle_core::Error| GgufError::Tensor {
            path: self.path.clone(),
            tensor: m.gguf.clone(),
            message: e.to_string(),
        };
        let q = self
            .content
            .tensor(f, &m.gguf, &Device::Cpu)
            .map_err(fail)?;
        let mut t = q.dequantize(&Device::Cpu).map_err(fail)?;
        if let Some(heads) = m.unpermute {
            t = names::reverse_permute(&t, heads).map_err(fail)?;
        }
        t.to_dtype(dtype)
            .and_then(|t| t.to_device(device))
            .map_err(fail)
    }

    /// The decoder of this file on `device`: weights dequantized to `dtype`, or with the
    /// attention and MLP projections kept quantized ([`WeightMode`]).
    pub fn decoder(
        &self,
        mode: WeightMode,
        dtype: DType,
        device: &Device,
    ) -> Result<crate::model::Decoder, GgufError> {
        let fail = |source| GgufError::Decoder {
            path: self.path.clone(),
            source,
        };
        let ops = crate::model::Ops::Fused;
        match mode {
            WeightMode::Dequantize => {
                crate::model::Decoder::new(&self.config, self.var_builder(dtype, device)?, ops)
                    .map_err(fail)
            }
            WeightMode::Quantized => {
                let w = self.quantized_tensors(dtype, device)?;
                let vb = candle_nn::VarBuilder::from_tensors(w.dense, dtype, device);
                let mut decoder =
                    crate::model::Decoder::new(&self.config, vb, ops).map_err(fail)?;
                decoder.quantize_linears(w.quantized).map_err(fail)?;
                Ok(decoder)
            }
        }
    }

    /// What `/v1/info` reports as `weights` for `mode`: `gguf Q4_1+Q8_0`, and with
    /// [`WeightMode::Quantized`] `gguf Q4_1+Q8_0 (quantized matmuls)` when at least one
    /// projection is stored block-quantized (an all-F32/F16 file has none to keep).
    pub fn weights_label(&self, mode: WeightMode) -> String {
        let quantized =
            mode == WeightMode::Quantized && self.tensors.iter().any(|m| self.keeps_quantized(m));
        let suffix = if quantized {
            " (quantized matmuls)"
        } else {
            ""
        };
        format!("gguf {}{suffix}", self.quantization())
    }

    /// A [`candle_nn::VarBuilder`] over [`GgufModel::tensors`].
    pub fn var_builder(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<candle_nn::VarBuilder<'static>, GgufError> {
        Ok(candle_nn::VarBuilder::from_tensors(
            self.tensors(dtype, device)?,
            dtype,
            device,
        ))
    }
}

/// Refuses a layer count (`{arch}.block_count`) above the layers the file holds tensors of:
/// checked before the config is built, since the config's per-layer lists are sized by it.
fn check_layers(
    path: &Path,
    arch: &str,
    layers: usize,
    content: &Content,
) -> Result<(), GgufError> {
    let held =
        crate::model_check::layers_held(content.tensor_infos.keys().map(String::as_str), "blk.")
            .last()
            .map_or(0, |l| l + 1);
    if layers > held {
        return Err(GgufError::Key {
            path: path.to_path_buf(),
            key: format!("{arch}.block_count"),
            message: format!(
                "{layers} layers, but the file holds tensors of {held} (blk.0..blk.{})",
                held.saturating_sub(1)
            ),
        });
    }
    Ok(())
}

/// Maps every tensor of the file to its transformers name and checks the set and the shapes
/// against the parameters `config` needs: an unknown or missing tensor, a wrong shape or an
/// unimplemented storage type is refused by name.
fn map_tensors(
    path: &Path,
    arch: &str,
    config: &ModelConfig,
    content: &Content,
) -> Result<Vec<Mapped>, GgufError> {
    let fail = |tensor: &str, message: String| GgufError::Tensor {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        message,
    };
    let specs: HashMap<String, Vec<usize>> = crate::model::param_specs(config, 0.0)
        .into_iter()
        .map(|s| (s.name, s.shape))
        .collect();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let info = &content.tensor_infos[name];
        let hf = names::hf_name(name).ok_or_else(|| {
            let why = if name == "rope_freqs.weight" {
                "RoPE frequency factors (Llama 3 rope scaling) are not implemented for GGUF files"
            } else {
                "not a tensor of the implemented decoders (llama, qwen2, qwen3)"
            };
            fail(name, why.into())
        })?;
        let want = specs.get(&hf).ok_or_else(|| {
            fail(
                name,
                format!("({hf}) is not a parameter of this {arch} model's config"),
            )
        })?;
        if info.shape.dims() != want.as_slice() {
            return Err(fail(
                name,
                format!(
                    "shape {:?}, the metadata's hyper-parameters need {want:?} ({hf})",
                    info.shape.dims()
                ),
            ));
        }
        if !dequantizable(info.ggml_dtype) {
            return Err(GgufError::UnsupportedQuant {
                path: path.to_path_buf(),
                tensor: name.clone(),
                dtype: dtype_name(info.ggml_dtype).into(),
            });
        }
        let unpermute =
            names::permuted_heads(arch, name, config.num_attention_heads, config.kv_heads());
        out.push(Mapped {
            gguf: name.clone(),
            hf,
            unpermute,
        });
    }
    let have: std::collections::HashSet<&str> = out.iter().map(|m| m.hf.as_str()).collect();
    let mut missing: Vec<&String> = specs
        .keys()
        .filter(|n| !have.contains(n.as_str()))
        .collect();
    missing.sort();
    if let Some(m) = missing.first() {
        let g = names::gguf_name(m).unwrap_or_else(|| m.to_string());
        return Err(fail(
            &g,
            format!("missing ({m}; {} parameters missing in all)", missing.len()),
        ));
    }
    Ok(out)
}
