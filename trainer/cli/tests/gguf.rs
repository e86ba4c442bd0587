//! GGUF files in the trainer: `trainer eval` (and every inference load, the local teacher of the
//! demo included) reads one as it reads a model directory; a GGUF student is refused by name.

use crate::common::model_args;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
use xdistill_shared::hf::ModelDir;
use xdistill_testkit::byte_tokenizer_json;

/// A tiny Llama model directory (init-model) and the same weights as an F32 GGUF file.
fn model_and_gguf(root: &Path) -> (PathBuf, PathBuf) {
    let mut args = model_args("llama", &byte_tokenizer_json(), false);
    args.out = root.join("model");
    xdistill_trainer::init_model::run(args).unwrap();
    let md = ModelDir::open(root.join("model")).unwrap();
    let mut params: HashMap<String, Tensor> = HashMap::new();
    for w in &md.weights {
        params.extend(candle_core::safetensors::load(w, &Device::Cpu).unwrap());
    }
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&md.tokenizer).unwrap()).unwrap();
    let mut meta = config_metadata("llama", &md.config);
    meta.extend(bpe_tokenizer_metadata(&tok, "default").unwrap());
    let file = root.join("model.gguf");
    write_gguf(&file, "llama", &md.config, &params, GgmlDType::F32, &meta).unwrap();
    (root.join("model"), file)
}

#[test]
fn eval_loads_a_gguf_file_as_the_model_dir_of_its_weights() {
    let dir = tempfile::tempdir().unwrap();
    let (model, file) = model_and_gguf(dir.path());
    let load = |p: &Path| xdistill_trainer::eval::load_model(p, &Device::Cpu, DType::F32).unwrap();
    let (want, want_tok) = load(&model);
    let (got, got_tok) = load(&file);
    let text = "Q: 17+25=?\nA: 42";
    let ids = want_tok.encode(text, true).unwrap().get_ids().to_vec();
    assert_eq!(got_tok.encode(text, true).unwrap().get_ids(), ids);
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let diff = (want.forward(&x).unwrap() - got.forward(&x).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff <= 1e-5, "logits differ by {diff}");

    // `trainer eval --model FILE.gguf` end to end.
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"Q: 1+2=?\\nA:\", \"answer\": \"3\"}\n",
    )
    .unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_trainer"))
        .arg("eval")
        .arg("--model")
        .arg(&file)
        .arg("--prompts")
        .arg(&prompts)
        .args(["--max-new-tokens", "4", "--samples", "1", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("greedy accuracy"));
}

#[test]
fn a_gguf_student_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (_, file) = model_and_gguf(dir.path());
    let e = xdistill_trainer::student::Student::load(&file, &Device::Cpu, DType::F32)
        .err()
        .expect("a GGUF student must be refused")
        .to_string();
    assert!(e.contains("model.gguf") && e.contains("GGUF file"), "{e}");
}
