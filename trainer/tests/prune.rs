//! `trainer prune`: the pruned copy computes what the source computes without the dropped
//! layers. The reference is the source model itself with the dropped layer silenced (its
//! attention and MLP output projections zeroed: the residual stream passes it unchanged), so the
//! two are computed by different weights and code paths.

use crate::common::model_args;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
use xdistill_shared::hf::ModelDir;
use xdistill_testkit::byte_tokenizer_json;

fn params(dir: &Path) -> HashMap<String, Tensor> {
    let md = ModelDir::open(dir).unwrap();
    let mut p = HashMap::new();
    for w in &md.weights {
        p.extend(candle_core::safetensors::load(w, &Device::Cpu).unwrap());
    }
    p
}

fn max_logit_diff(a: &Path, b: &Path) -> f32 {
    let load = |p: &Path| xdistill_trainer::eval::load_model(p, &Device::Cpu, DType::F32).unwrap();
    let ((ma, ta), (mb, _)) = (load(a), load(b));
    let ids = ta
        .encode("Q: 17+25=?\nA: 42 apples", true)
        .unwrap()
        .get_ids()
        .to_vec();
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    (ma.forward(&x).unwrap() - mb.forward(&x).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn a_pruned_copy_equals_its_source_with_the_dropped_layers_silenced() {
    let root = tempfile::tempdir().unwrap();
    let tok = byte_tokenizer_json();
    let mut args = model_args("llama", &tok, true);
    args.layers = 4;
    args.out = root.path().join("source");
    xdistill_trainer::init_model::run(args).unwrap();
    let source = root.path().join("source");
    let md = ModelDir::open(&source).unwrap();

    // Keeping every layer changes nothing.
    let all = root.path().join("all");
    xdistill_trainer::prune::prune(&source, &[0, 1, 2, 3], &all).unwrap();
    assert_eq!(max_logit_diff(&source, &all), 0.0);

    // Dropping layers 1 and 2 = the source with layers 1 and 2 silenced.
    let mut silenced = params(&source);
    for l in [1, 2] {
        for w in ["self_attn.o_proj.weight", "mlp.down_proj.weight"] {
            let k = format!("model.layers.{l}.{w}");
            let z = silenced[&k].zeros_like().unwrap();
            silenced.insert(k, z);
        }
    }
    let reference = root.path().join("silenced");
    xdistill_shared::hf::write_model_dir(&reference, &md.config, &silenced, &md.tokenizer).unwrap();
    let pruned = root.path().join("pruned");
    let n = xdistill_trainer::prune::prune(&source, &[0, 3], &pruned).unwrap();
    let diff = max_logit_diff(&reference, &pruned);
    assert!(diff <= 1e-5, "logits differ by {diff}");
    let pm = ModelDir::open(&pruned).unwrap();
    assert_eq!(pm.config.num_hidden_layers, 2);
    let full: usize = params(&source).values().map(|t| t.elem_count()).sum();
    let per_layer: usize = params(&source)
        .iter()
        .filter(|(k, _)| k.starts_with("model.layers.0."))
        .map(|(_, t)| t.elem_count())
        .sum();
    assert_eq!(n, full - 2 * per_layer);
    // Without the silencing the dropped layers matter (the check above can fail).
    assert!(max_logit_diff(&source, &pruned) > 1e-3);

    // From a GGUF file of the same weights: the same pruned model, and the tokenizer and chat
    // template (GGUF metadata) written beside it.
    let tok_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&md.tokenizer).unwrap()).unwrap();
    let mut meta = config_metadata("llama", &md.config);
    meta.extend(bpe_tokenizer_metadata(&tok_json, "default").unwrap());
    meta.push((
        "tokenizer.chat_template".into(),
        candle_core::quantized::gguf_file::Value::String("{{ messages[0].content }}".into()),
    ));
    let file = root.path().join("source.gguf");
    write_gguf(
        &file,
        "llama",
        &md.config,
        &params(&source),
        GgmlDType::F32,
        &meta,
    )
    .unwrap();
    let from_gguf = root.path().join("from_gguf");
    xdistill_trainer::prune::prune(&file, &[0, 3], &from_gguf).unwrap();
    assert!(max_logit_diff(&pruned, &from_gguf) <= 1e-5);
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(from_gguf.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["chat_template"], "{{ messages[0].content }}");

    // Bad layer lists are refused before anything is written.
    let e = xdistill_trainer::prune::prune(&source, &[0, 4], &root.path().join("x")).unwrap_err();
    assert!(e.to_string().contains("layer 4 does not exist"), "{e}");
    assert!(!root.path().join("x").exists());
}
