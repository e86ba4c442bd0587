//! Checks a model directory's `config.json` against its safetensors headers before anything is
//! allocated from it: the shared checks of [`xdistill_shared::model_check`] (limits, layers,
//! widths, heads, RoPE) and every parameter's shape, refused naming the key and the file.

use anyhow::Result;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::hf::{ModelConfig, ModelDir};
#[cfg(test)]
use xdistill_shared::model::param_specs;

pub use xdistill_shared::init::{
    check_init_size, check_rope, parameter_count, MAX_INIT_PARAMETERS, MAX_ROPE_TABLE,
};

/// Tensor name → (shape, file it is stored in), from the safetensors headers only.
pub fn header_shapes(files: &[PathBuf]) -> Result<HashMap<String, (Vec<usize>, PathBuf)>> {
    let mut out = HashMap::new();
    for f in files {
        for (name, shape) in xdistill_shared::hf::safetensors_header(f)? {
            out.insert(name, (shape, f.clone()));
        }
    }
    Ok(out)
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
    Ok(xdistill_shared::model_check::check_all_shapes(
        cfg, cfg_path, shapes,
    )?)
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
