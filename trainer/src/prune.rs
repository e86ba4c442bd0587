//! Depth pruning (behind `trainer prune`): a depth-pruned copy of a model — the layers you name, in order, with the
//! embeddings, final norm and head unchanged — written as a Hugging Face directory. It is how
//! DistilBERT and Minitron initialise a student from its teacher: the copy starts close to the
//! teacher and distillation recovers what the dropped layers did.
//!
//! The source is a model directory or a GGUF file (dequantized to f32, its tokenizer and chat
//! template written beside the weights), so a GGUF teacher yields a trainable student.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::gguf::{self, GgufModel};
use xdistill_shared::hf::{self, ModelConfig, ModelDir};

/// The layer count of a model directory or GGUF file.
pub fn source_layers(from: &Path) -> Result<usize> {
    Ok(if gguf::is_gguf(from) {
        GgufModel::open(from)?.config.num_hidden_layers
    } else {
        ModelDir::open(from)
            .with_context(|| format!("opening {}", from.display()))?
            .config
            .num_hidden_layers
    })
}

/// `"0,1,5-7"` → `[0, 1, 5, 6, 7]`; must be strictly increasing.
pub fn parse_layers(list: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .with_context(|| format!("--keep: `{s}` is not a layer index"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if b < a {
                    bail!("--keep: range `{part}` runs backwards");
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    if out.is_empty() {
        bail!("--keep names no layer");
    }
    if out.windows(2).any(|w| w[1] <= w[0]) {
        bail!("--keep: layers must be strictly increasing, got {out:?}");
    }
    Ok(out)
}

/// `n` of `total` layers, evenly spaced, always the first and (for `n > 1`) the last.
pub fn evenly_spaced(total: usize, n: usize) -> Result<Vec<usize>> {
    if n == 0 || n > total {
        bail!("--layers {n}: the model has {total} layers; keep between 1 and {total}");
    }
    if n == 1 {
        return Ok(vec![0]);
    }
    Ok((0..n)
        .map(|i| (i * (total - 1) + (n - 1) / 2) / (n - 1))
        .collect())
}

/// Writes the copy of `from` keeping layers `keep` to `out` (atomically); returns its
/// parameter count.
pub fn prune(from: &Path, keep: &[usize], out: &Path) -> Result<usize> {
    let src = Source::load(from)?;
    let total = src.config.num_hidden_layers;
    if let Some(&bad) = keep.iter().find(|&&l| l >= total) {
        bail!(
            "layer {bad} does not exist: {} has {total} layers (0..{total})",
            from.display()
        );
    }
    let config = pruned_config(&src.config, keep)?;
    let tensors = pruned_tensors(src.tensors, keep)?;
    let params = tensors.values().map(|t| t.elem_count()).sum();
    hf::write_model_dir(out, &config, &tensors, &src.tokenizer)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(params)
}

/// A model's config, weights under transformers' names, and a `tokenizer.json` path (with a
/// `tokenizer_config.json` beside it when the source has one).
struct Source {
    config: ModelConfig,
    tensors: HashMap<String, Tensor>,
    tokenizer: PathBuf,
    /// Holds the tokenizer files of a GGUF source until they are copied.
    _staging: Option<tempfile::TempDir>,
}

impl Source {
    fn load(from: &Path) -> Result<Source> {
        if gguf::is_gguf(from) {
            let g = GgufModel::open(from)?;
            let tensors = g.tensors(DType::F32, &Device::Cpu)?;
            let staging = tempfile::tempdir().context("creating a staging folder")?;
            let tokenizer = staging.path().join("tokenizer.json");
            std::fs::write(&tokenizer, &g.tokenizer_json)?;
            let vocab = g.load_tokenizer()?;
            let name = |id: Option<&serde_json::Value>| {
                id.and_then(|v| v.as_u64().or_else(|| v.as_array()?.first()?.as_u64()))
                    .and_then(|id| vocab.id_to_token(id as u32))
            };
            let mut tok_cfg = serde_json::json!({
                "bos_token": name(g.config.bos_token_id.as_ref()),
                "eos_token": name(g.config.eos_token_id.as_ref()),
            });
            if let Some(t) = &g.chat_template {
                tok_cfg["chat_template"] = serde_json::json!(t);
            }
            std::fs::write(
                staging.path().join("tokenizer_config.json"),
                serde_json::to_vec_pretty(&tok_cfg)?,
            )?;
            return Ok(Source {
                config: g.config.clone(),
                tensors,
                tokenizer,
                _staging: Some(staging),
            });
        }
        let md = ModelDir::open(from).with_context(|| format!("opening {}", from.display()))?;
        if md.config.weight_prefix.is_some() {
            bail!(
                "{} is a multimodal checkpoint: prune its text model's own directory",
                from.display()
            );
        }
        let mut tensors = HashMap::new();
        for w in &md.weights {
            tensors.extend(
                candle_core::safetensors::load(w, &Device::Cpu)
                    .with_context(|| format!("reading {}", w.display()))?,
            );
        }
        Ok(Source {
            config: md.config,
            tensors,
            tokenizer: md.tokenizer,
            _staging: None,
        })
    }
}

/// The config with `keep.len()` layers; per-layer lists (Gemma 3's and Qwen's `layer_types`,
/// Qwen3-MoE's `mlp_only_layers`) follow the kept layers. Qwen's `max_window_layers` is
/// refused: its meaning would shift with the renumbering.
fn pruned_config(c: &ModelConfig, keep: &[usize]) -> Result<ModelConfig> {
    let mut c = c.clone();
    if let Some(types) = &c.window.layer_types {
        c.window.layer_types = Some(keep.iter().map(|&l| types[l].clone()).collect());
    }
    if let Some(only) = &c.moe.mlp_only_layers {
        c.moe.mlp_only_layers = Some(
            keep.iter()
                .enumerate()
                .filter(|(_, l)| only.contains(l))
                .map(|(i, _)| i)
                .collect(),
        );
    }
    if c.window.use_sliding_window == Some(true)
        && c.window
            .max_window_layers
            .is_some_and(|m| m > 0 && m < c.num_hidden_layers)
    {
        bail!("pruning a model whose windowed layers start at max_window_layers is not supported");
    }
    if c.window.max_window_layers == Some(c.num_hidden_layers) {
        c.window.max_window_layers = Some(keep.len());
    }
    c.num_hidden_layers = keep.len();
    Ok(c)
}

/// Drops the layers not kept and renumbers the others: `model.layers.{keep[j]}.*` →
/// `model.layers.{j}.*`.
fn pruned_tensors(
    tensors: HashMap<String, Tensor>,
    keep: &[usize],
) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        let Some(rest) = name.strip_prefix("model.layers.") else {
            out.insert(name, t);
            continue;
        };
        let (idx, tail) = rest
            .split_once('.')
            .with_context(|| format!("unexpected weight name {name}"))?;
        let idx: usize = idx
            .parse()
            .with_context(|| format!("unexpected weight name {name}"))?;
        if let Some(j) = keep.iter().position(|&l| l == idx) {
            out.insert(format!("model.layers.{j}.{tail}"), t);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists() {
        assert_eq!(parse_layers("0,1, 5-7").unwrap(), vec![0, 1, 5, 6, 7]);
        assert!(parse_layers("3,2").is_err());
        assert!(parse_layers("2-1").is_err());
        assert!(parse_layers("x").is_err());
        assert!(parse_layers("").is_err());
        assert_eq!(evenly_spaced(30, 1).unwrap(), vec![0]);
        assert_eq!(evenly_spaced(30, 2).unwrap(), vec![0, 29]);
        assert_eq!(evenly_spaced(30, 30).unwrap(), (0..30).collect::<Vec<_>>());
        let ten = evenly_spaced(30, 10).unwrap();
        assert_eq!((ten[0], ten[9], ten.len()), (0, 29, 10));
        assert!(ten.windows(2).all(|w| w[1] > w[0]));
        assert!(evenly_spaced(4, 5).is_err() && evenly_spaced(4, 0).is_err());
    }
}
