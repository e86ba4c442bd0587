//! `teacher --model FILE.gguf`: a tiny random Llama written as llama.cpp's converter would (q/k
//! permuted, F32 or Q8_0 matrices, the Llama 3 byte-level BPE vocabulary as metadata) is served
//! with the scores of the same (dequantized) weights loaded from a Hugging Face directory, says
//! where its weights came from in `/v1/info`, and serves its rebuilt tokenizer.

use crate::common;

use crate::common::{client, ids, request, score, Reference};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::codec::Format;
use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
use xdistill_shared::hf::ModelDir;
use xdistill_shared::protocol::ValuesKind;

const TOL: f64 = 1e-5;

/// The tiny model's weights as stored in `ty` and read back.
fn stored(params: &HashMap<String, Tensor>, ty: GgmlDType) -> HashMap<String, Tensor> {
    params
        .iter()
        .map(|(k, w)| {
            let w = if w.rank() >= 2 {
                QTensor::quantize(w, ty)
                    .unwrap()
                    .dequantize(&Device::Cpu)
                    .unwrap()
            } else {
                w.clone()
            };
            (k.clone(), w)
        })
        .collect()
}

/// Writes `dir`'s model as `FILE.gguf` in `ty`, and a model directory of the weights as that
/// file stores them (the reference), named after `tag` (one per test: tests run at once).
/// Returns both paths.
fn convert(dir: &Path, ty: GgmlDType, tag: &str) -> (PathBuf, PathBuf) {
    let md = ModelDir::open(dir).unwrap();
    let mut params = HashMap::new();
    for w in &md.weights {
        params.extend(candle_core::safetensors::load(w, &Device::Cpu).unwrap());
    }
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&md.tokenizer).unwrap()).unwrap();
    let mut meta = config_metadata("llama", &md.config);
    meta.extend(bpe_tokenizer_metadata(&tok, "llama-bpe").unwrap());
    let file = dir.with_extension(format!("{tag}-{ty:?}.gguf"));
    write_gguf(&file, "llama", &md.config, &params, ty, &meta).unwrap();
    let reference = dir.with_extension(format!("{tag}-{ty:?}.ref"));
    if !reference.join("config.json").is_file() {
        xdistill_shared::hf::write_model_dir(
            &reference,
            &md.config,
            &stored(&params, ty),
            &md.tokenizer,
        )
        .unwrap();
    }
    (file, reference)
}

#[tokio::test]
async fn gguf_teacher_scores_equal_the_model_dir_of_its_weights() {
    let dir = common::tiny_model("gguf-llama", "llama", "llama3", 1);
    let c = client();
    for ty in [GgmlDType::F32, GgmlDType::Q8_0] {
        let (file, ref_dir) = convert(&dir, ty, "scores");
        let t = common::start_teacher(&file, &[]);
        let reference = Reference::load(&ref_dir);
        let info = common::info(&c, &t).await;
        let q = xdistill_shared::gguf::dtype_name(ty);
        assert_eq!(info.weights, format!("gguf {q}"));
        assert_eq!(info.model_type, "llama");
        assert_eq!(info.vocab_size, reference.vocab());
        let v = reference.vocab();
        let seqs = vec![ids(1, 12, v), ids(2, 5, v), ids(3, 20, v)];
        for (temperature, values, start) in [
            (1.0f32, ValuesKind::Logprobs, 0usize),
            (0.7, ValuesKind::Logits, 2),
        ] {
            let mut req = request(seqs.clone(), 16);
            req.temperature = temperature;
            req.values = values;
            req.start = start;
            let resp = score(&c, &t, &req, Format::Json).await;
            for (s, got) in seqs.iter().zip(&resp.results) {
                reference.check(got, s, start, temperature as f64, values, TOL);
            }
        }
        // The served tokenizer is the one rebuilt from the metadata: Llama 3's ids.
        let served = c
            .get(t.url("/tokenizer.json"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let served = tokenizers::Tokenizer::from_bytes(&served).unwrap();
        let real =
            xdistill_shared::hf::load_tokenizer(&ModelDir::open(&dir).unwrap().tokenizer).unwrap();
        let text = "Natalia sold clips to 48 of her friends in April, and then she sold half.";
        assert_eq!(
            served.encode(text, false).unwrap().get_ids(),
            real.encode(text, false).unwrap().get_ids()
        );
    }
}

/// `--check-args` opens a GGUF file without loading weights, and refuses a broken one by name.
#[test]
fn check_args_reads_and_refuses_gguf_files() {
    let dir = common::tiny_model("gguf-llama", "llama", "llama3", 1);
    let (file, _) = convert(&dir, GgmlDType::Q8_0, "check");
    let run = |model: &Path| {
        std::process::Command::new(common::teacher_bin())
            .args(["--check-args", "--model"])
            .arg(model)
            .output()
            .unwrap()
    };
    let ok = run(&file);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let bad = file.with_extension("truncated.gguf");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&bad, &bytes[..1000]).unwrap();
    let out = run(&bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("truncated.gguf") && err.contains("GGUF"),
        "{err}"
    );
}

/// `--gguf-weights quantized`: the projections of a Q8_0 file run candle's quantized matmuls, so
/// the served log-probs are the quantized model's own, near those of the dequantized weights
/// (the tiny random model's logits are spread wide; the real file's gap is in docs/models.md),
/// and `/v1/info` says so. An F32 file has no block-quantized matrix to keep: both modes serve
/// the same bits. A model directory is refused.
#[tokio::test]
async fn quantized_matmuls_serve_near_the_dequantized_scores() {
    // Measured 2.5e-2 (init std 0.1, hidden 32).
    const GAP: f32 = 0.1;
    let dir = common::tiny_model("gguf-llama", "llama", "llama3", 1);
    let c = client();
    for ty in [GgmlDType::F32, GgmlDType::Q8_0] {
        let (file, _) = convert(&dir, ty, "quantized");
        let dense = common::start_teacher(&file, &[]);
        let quant = common::start_teacher(&file, &["--gguf-weights", "quantized"]);
        let q = xdistill_shared::gguf::dtype_name(ty);
        let label = common::info(&c, &quant).await.weights;
        let v = common::info(&c, &dense).await.vocab_size;
        let seqs = vec![ids(1, 12, v), ids(2, 5, v), ids(3, 20, v)];
        let req = request(seqs.clone(), 8);
        let want = score(&c, &dense, &req, Format::Json).await;
        let got = score(&c, &quant, &req, Format::Json).await;
        if ty == GgmlDType::F32 {
            assert_eq!(label, "gguf F32");
            for (w, g) in want.results.iter().zip(&got.results) {
                assert_eq!(w.target_logprobs, g.target_logprobs);
                assert_eq!(w.topk_ids, g.topk_ids);
                assert_eq!(w.topk_values, g.topk_values);
            }
            continue;
        }
        assert_eq!(label, format!("gguf {q} (quantized matmuls)"));
        let mut worst = 0f32;
        for (w, g) in want.results.iter().zip(&got.results) {
            assert_eq!(w.rows, g.rows);
            for (a, b) in w.target_logprobs.iter().zip(&g.target_logprobs) {
                worst = worst.max((a - b).abs());
            }
        }
        eprintln!("{q}: served target log-probs, quantized vs dequantized: {worst:.2e}");
        assert!(worst > 0.0 && worst <= GAP, "{worst}");
    }
    let refused = xdistill_server::model::load_with(
        &dir,
        "cpu",
        "f32",
        xdistill_shared::gguf::WeightMode::Quantized,
    );
    let err = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("needs a GGUF file"), "{err}");
}
