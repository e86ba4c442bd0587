//! Checks a model directory's `config.json` against its safetensors headers before anything is
//! allocated from it. The decoder sizes its buffers from the config (a `Vec` per layer, RoPE
//! tables of `max_position_embeddings` rows, the parameter list), so an absurd value — a billion
//! layers, a huge `hidden_size` — would allocate until the OOM killer ends the process. Here every
//! size is compared with the tensors actually stored (only the headers are read: names and
//! shapes), and a mismatch is refused with the key and the file named.

use anyhow::{bail, Context, Result};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use xdistill_shared::hf::{ModelConfig, ModelDir};
use xdistill_shared::model::param_specs;

pub use xdistill_shared::init::{
    check_init_size, check_rope, parameter_count, MAX_INIT_PARAMETERS, MAX_ROPE_TABLE,
};

/// Tensor name → (shape, file it is stored in), from the safetensors headers only.
pub fn header_shapes(files: &[PathBuf]) -> Result<HashMap<String, (Vec<usize>, PathBuf)>> {
    let mut out = HashMap::new();
    for f in files {
        for (name, shape) in read_header(f)? {
            out.insert(name, (shape, f.clone()));
        }
    }
    Ok(out)
}

/// Names and shapes of one safetensors file, read from its header.
fn read_header(path: &Path) -> Result<Vec<(String, Vec<usize>)>> {
    Ok(xdistill_shared::hf::safetensors_header(path)?)
}

/// Checks `md.config` against the weights of `md` (see the module docs). Call before loading.
pub fn check_model_dir(md: &ModelDir) -> Result<()> {
    let shapes = header_shapes(&md.weights)?;
    check_config(&md.config, &md.path.join("config.json"), &shapes)
}

/// Checks `cfg` (read from `cfg_path`) against tensor shapes from the headers.
pub fn check_config(
    cfg: &ModelConfig,
    cfg_path: &Path,
    shapes: &HashMap<String, (Vec<usize>, PathBuf)>,
) -> Result<()> {
    let file = cfg_path.display();
    let shape = |name: &str| -> Result<&(Vec<usize>, PathBuf)> {
        shapes
            .get(name)
            .with_context(|| format!("{file}: the weights have no tensor {name:?}"))
    };
    // 1. Layers: the distinct N of `model.layers.N.` must be exactly 0..num_hidden_layers.
    let layers: BTreeSet<usize> = shapes
        .keys()
        .filter_map(|k| {
            k.strip_prefix("model.layers.")?
                .split('.')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    if cfg.num_hidden_layers != layers.len() {
        bail!(
            "{file}: config key `num_hidden_layers` = {} does not match the weights, which hold {} \
             layers (model.layers.N.*)",
            cfg.num_hidden_layers,
            layers.len()
        );
    }
    if let Some(gap) = (0..layers.len()).find(|l| !layers.contains(l)) {
        bail!(
            "{file}: the weights have no tensors model.layers.{gap}.* (`num_hidden_layers` = {})",
            cfg.num_hidden_layers
        );
    }
    // 2. Embedding: [vocab_size, hidden_size].
    let (emb, emb_file) = shape("model.embed_tokens.weight")?;
    let key_vs_dim = |key: &str, value: usize, what: &str, got: usize, f: &Path| {
        anyhow::anyhow!(
            "{file}: config key `{key}` = {value} does not match the weights: {what} is {got} in {}",
            f.display()
        )
    };
    if emb.len() != 2 {
        bail!(
            "{}: model.embed_tokens.weight has shape {emb:?}, expected 2 dimensions",
            emb_file.display()
        );
    }
    if emb[0] != cfg.vocab_size {
        return Err(key_vs_dim(
            "vocab_size",
            cfg.vocab_size,
            "model.embed_tokens.weight's row count",
            emb[0],
            emb_file,
        ));
    }
    if emb[1] != cfg.hidden_size {
        return Err(key_vs_dim(
            "hidden_size",
            cfg.hidden_size,
            "model.embed_tokens.weight's column count",
            emb[1],
            emb_file,
        ));
    }
    // 3. Attention and MLP widths, on layer 0 (every layer is compared below).
    let rows = |name: &str| -> Result<(usize, &Path)> {
        let (s, f) = shape(name)?;
        Ok((s.first().copied().unwrap_or(0), f.as_path()))
    };
    // (Phi-3's fused qkv_proj / gate_up_proj and Qwen3-MoE's experts are compared by shape
    // in step 5 only.)
    let separate_qkv = shapes.contains_key("model.layers.0.self_attn.q_proj.weight")
        || !shapes.contains_key("model.layers.0.self_attn.qkv_proj.weight");
    if separate_qkv {
        check_attention_rows(cfg, &file.to_string(), shapes)?;
    }
    if shapes.contains_key("model.layers.0.mlp.gate_proj.weight") {
        let (i_rows, gf) = rows("model.layers.0.mlp.gate_proj.weight")?;
        if cfg.intermediate_size != i_rows {
            return Err(key_vs_dim(
                "intermediate_size",
                cfg.intermediate_size,
                "gate_proj's row count",
                i_rows,
                gf,
            ));
        }
    }
    // 4. RoPE tables are sized by max_position_embeddings alone (no tensor to compare with).
    check_rope(cfg).with_context(|| format!("{file}"))?;
    // 5. Now the parameter list is bounded by the weights: compare every shape.
    for spec in param_specs(cfg, 0.0) {
        let (got, f) = shape(&spec.name)?;
        if *got != spec.shape {
            bail!(
                "{file}: the config implies shape {:?} for {:?}, but it is {got:?} in {}",
                spec.shape,
                spec.name,
                f.display()
            );
        }
    }
    Ok(())
}

/// q_proj and k_proj rows against the head counts (named keys in the message).
fn check_attention_rows(
    cfg: &ModelConfig,
    file: &str,
    shapes: &HashMap<String, (Vec<usize>, PathBuf)>,
) -> Result<()> {
    let rows = |name: &str| -> Result<(usize, &Path)> {
        let (s, f) = shapes
            .get(name)
            .with_context(|| format!("{file}: the weights have no tensor {name:?}"))?;
        Ok((s.first().copied().unwrap_or(0), f.as_path()))
    };
    let d = cfg.head_dim();
    let (q_rows, qf) = rows("model.layers.0.self_attn.q_proj.weight")?;
    if cfg.num_attention_heads.checked_mul(d) != Some(q_rows) {
        let key = if cfg.head_dim.is_some() {
            "num_attention_heads` × `head_dim"
        } else {
            "num_attention_heads"
        };
        return Err(anyhow::anyhow!(
            "{file}: config key `{key}` ({} heads × head_dim {d}) does not match the weights: \
             q_proj has {q_rows} rows in {}",
            cfg.num_attention_heads,
            qf.display()
        ));
    }
    let (k_rows, kf) = rows("model.layers.0.self_attn.k_proj.weight")?;
    if cfg.kv_heads().checked_mul(d) != Some(k_rows) {
        return Err(anyhow::anyhow!(
            "{file}: config key `num_key_value_heads` = {} (× head_dim {d}) does not match the \
             weights: k_proj has {k_rows} rows in {}",
            cfg.kv_heads(),
            kf.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(layers: usize) -> ModelConfig {
        serde_json::from_value(serde_json::json!({"model_type": "qwen3", "vocab_size": 16,
            "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}))
        .unwrap()
    }

    fn shapes_of(c: &ModelConfig) -> HashMap<String, (Vec<usize>, PathBuf)> {
        param_specs(c, 0.0)
            .into_iter()
            .map(|s| (s.name, (s.shape, PathBuf::from("model.safetensors"))))
            .collect()
    }

    #[test]
    fn absurd_values_are_refused_with_the_key() {
        let good = cfg(2);
        let shapes = shapes_of(&good);
        let p = Path::new("m/config.json");
        check_config(&good, p, &shapes).unwrap();
        let err = |c: ModelConfig| format!("{:#}", check_config(&c, p, &shapes).unwrap_err());
        let e = err(cfg(1_000_000_000));
        assert!(
            e.contains("`num_hidden_layers` = 1000000000") && e.contains("m/config.json"),
            "{e}"
        );
        let mut c = good.clone();
        c.hidden_size = 1 << 40;
        assert!(err(c).contains("`hidden_size`"));
        let mut c = good.clone();
        c.vocab_size = usize::MAX;
        assert!(err(c).contains("`vocab_size`"));
        let mut c = good.clone();
        c.intermediate_size = 1 << 50;
        assert!(err(c).contains("`intermediate_size`"));
        let mut c = good.clone();
        c.num_attention_heads = usize::MAX / 2;
        c.num_key_value_heads = Some(1);
        assert!(err(c).contains("num_attention_heads"));
        let mut c = good.clone();
        c.max_position_embeddings = 1 << 40;
        assert!(err(c).contains("`max_position_embeddings`"));
    }

    #[test]
    fn init_size_cap() {
        check_init_size(&cfg(2)).unwrap();
        let mut c = cfg(1_000_000_000);
        c.hidden_size = 4096;
        c.intermediate_size = 16384;
        let e = check_init_size(&c).unwrap_err().to_string();
        assert!(e.contains("parameters"), "{e}");
    }
}
