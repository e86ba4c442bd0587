//! GGUF files load as they are: a tiny random model written here as llama.cpp's converter would
//! (q/k permuted for Llama, matrices F32 or quantized) scores exactly as the same weights in a
//! Hugging Face directory; the tokenizer rebuilt from GGUF metadata gives the ids of the
//! `tokenizer.json` it came from on real text; what is not implemented is refused by name.

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
use xdistill_shared::gguf::{GgufError, GgufModel, WeightMode};
use xdistill_shared::hf::{write_model_dir, ModelConfig, ModelDir};
use xdistill_shared::model::{Decoder, Ops};

/// Counts this thread's live heap bytes and their peak, so that the fuzz test can bound what one
/// open allocates (other tests' threads count on their own).
struct Counting;

thread_local! {
    static LIVE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
    static PEAK: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE.try_with(|l| {
        let v = l.get() + delta;
        l.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters move.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        count(l.size() as isize);
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        count(-(l.size() as isize));
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        count(l.size() as isize);
        unsafe { std::alloc::System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        count(new as isize - l.size() as isize);
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The most bytes `f` had live at once on this thread beyond what was live before it.
fn peak_allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(|l| l.get());
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, (PEAK.with(|p| p.get()) - base).max(0) as usize)
}

/// A byte-level BPE vocabulary of 260 tokens: the 256 bytes, three merges and a control token.
fn tiny_tokenizer_json() -> serde_json::Value {
    // GPT-2's byte alphabet.
    let mut alphabet = Vec::new();
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        alphabet.push(if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        });
    }
    let mut vocab = serde_json::Map::new();
    for (i, c) in alphabet.iter().enumerate() {
        vocab.insert(c.to_string(), i.into());
    }
    for (i, t) in ["Ġt", "he", "Ġthe"].iter().enumerate() {
        vocab.insert(t.to_string(), (256 + i).into());
    }
    serde_json::json!({
        "model": {"type": "BPE", "vocab": vocab, "merges": ["Ġ t", "h e", "Ġt he"]},
        "added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": true}],
    })
}

fn tiny_config(arch: &str, tied: bool) -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": arch,
        "vocab_size": 260,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": 259,
        "eos_token_id": 259,
    }))
    .unwrap()
}

fn metadata(arch: &str, cfg: &ModelConfig) -> Vec<(String, Value)> {
    let mut m = config_metadata(arch, cfg);
    m.extend(bpe_tokenizer_metadata(&tiny_tokenizer_json(), "qwen2").unwrap());
    m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(259)));
    m.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(259)));
    m.push((
        "tokenizer.chat_template".into(),
        Value::String("{{ messages }}".into()),
    ));
    m
}

/// The decoder of a Hugging Face directory holding `params`, with the GGUF's own tokenizer.
fn hf_decoder(
    dir: &Path,
    cfg: &ModelConfig,
    params: &HashMap<String, Tensor>,
    tok: &str,
) -> Decoder {
    let tok_path = dir.with_extension("tokenizer.json");
    std::fs::write(&tok_path, tok).unwrap();
    write_model_dir(dir, cfg, params, &tok_path).unwrap();
    let md = ModelDir::open(dir).unwrap();
    // SAFETY: written above, not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu) }
        .unwrap();
    Decoder::new(&md.config, vb, Ops::Fused).unwrap()
}

fn gguf_decoder(path: &Path) -> (GgufModel, Decoder) {
    let g = GgufModel::open(path).unwrap();
    let vb = g.var_builder(DType::F32, &Device::Cpu).unwrap();
    let d = Decoder::new(&g.config, vb, Ops::Fused).unwrap();
    (g, d)
}

const IDS: [u32; 12] = [3, 17, 256, 42, 8, 8, 258, 1, 200, 0, 23, 259];

fn logits(d: &Decoder) -> Tensor {
    let x = Tensor::new(&IDS[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    d.forward(&x).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// `w` as stored in `ty` and read back (each row's blocks quantized on their own, so the row
/// permutation of q/k does not change it).
fn roundtrip(w: &Tensor, ty: GgmlDType) -> Tensor {
    if w.rank() < 2 {
        return w.clone();
    }
    QTensor::quantize(w, ty)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
}

fn tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gguf-tests")
}

/// F32 and quantized files of Llama (q/k permuted) and Qwen3 (not permuted, q/k norms), tied
/// and untied: the GGUF model's logits equal those of the same (dequantized) weights loaded
/// from a Hugging Face directory.
#[test]
fn gguf_scores_equal_the_same_weights_from_a_model_dir() {
    let root = tmp().join("scores");
    std::fs::create_dir_all(&root).unwrap();
    let cases = [
        ("llama", GgmlDType::F32, false),
        ("llama", GgmlDType::Q8_0, true),
        ("llama", GgmlDType::Q4_0, false),
        ("llama", GgmlDType::Q4_1, true),
        ("llama", GgmlDType::F16, false),
        ("qwen3", GgmlDType::F32, true),
        ("qwen3", GgmlDType::Q8_0, false),
        ("qwen2", GgmlDType::Q5_0, false),
    ];
    for (arch, ty, tied) in cases {
        let name = format!("{arch}-{ty:?}-{tied}");
        let cfg = tiny_config(arch, tied);
        let params = xdistill_shared::init::random_params(&cfg, 0.2, 11).unwrap();
        let file = root.join(format!("{name}.gguf"));
        write_gguf(&file, arch, &cfg, &params, ty, &metadata(arch, &cfg)).unwrap();
        let (g, got) = gguf_decoder(&file);
        assert_eq!(g.architecture, arch);
        assert_eq!(g.config.vocab_size, 260, "{name}");
        assert_eq!(g.config.num_key_value_heads, Some(2), "{name}");
        assert_eq!(g.config.head_dim(), 8, "{name}");
        assert_eq!(g.config.tie_word_embeddings, tied, "{name}");
        assert_eq!(g.config.max_position_embeddings, 128, "{name}");
        assert_eq!(
            g.quant_types,
            vec![xdistill_shared::gguf::dtype_name(ty)],
            "{name}"
        );
        assert_eq!(g.chat_template.as_deref(), Some("{{ messages }}"));
        let stored: HashMap<String, Tensor> = params
            .iter()
            .map(|(k, v)| (k.clone(), roundtrip(v, ty)))
            .collect();
        let want = hf_decoder(&root.join(&name), &cfg, &stored, &g.tokenizer_json);
        let (want, got) = (logits(&want), logits(&got));
        let diff = max_abs_diff(&want, &got);
        assert!(diff <= 1e-5, "{name}: logits differ by {diff}");
        if ty != GgmlDType::F32 {
            // The quantized file is its own model: it differs from the f32 weights.
            let f32_model = hf_decoder(
                &root.join(format!("{name}-f32")),
                &cfg,
                &params,
                &g.tokenizer_json,
            );
            let gap = max_abs_diff(&logits(&f32_model), &got);
            assert!(gap > 0.0, "{name}: quantization changed nothing");
            eprintln!("{name}: vs dequantized weights {diff:.2e}, vs f32 weights {gap:.2e}");
        }
    }
}

/// The permutation is undone exactly: without it a Llama file would score differently.
#[test]
fn llama_qk_permutation_matters() {
    let root = tmp().join("perm");
    std::fs::create_dir_all(&root).unwrap();
    let cfg = tiny_config("llama", false);
    let params = xdistill_shared::init::random_params(&cfg, 0.2, 5).unwrap();
    let file = root.join("m.gguf");
    // Written as if it were Qwen3 (no permutation) but labelled llama: the loader un-permutes
    // rows that were never permuted, so the scores must change.
    let mut meta = metadata("llama", &cfg);
    write_gguf(&file, "qwen3", &cfg, &params, GgmlDType::F32, &meta).unwrap();
    let (_, wrong) = gguf_decoder(&file);
    let want = hf_decoder(
        &root.join("m"),
        &cfg,
        &params,
        &GgufModel::open(&file).unwrap().tokenizer_json,
    );
    assert!(max_abs_diff(&logits(&want), &logits(&wrong)) > 1e-3);
    meta.retain(|(k, _)| k != "x");
    write_gguf(&file, "llama", &cfg, &params, GgmlDType::F32, &meta).unwrap();
    let (_, right) = gguf_decoder(&file);
    assert!(max_abs_diff(&logits(&want), &logits(&right)) <= 1e-5);
}

fn write_with(
    root: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut HashMap<String, Tensor>),
) -> PathBuf {
    std::fs::create_dir_all(root).unwrap();
    let cfg = tiny_config("llama", false);
    let mut params = xdistill_shared::init::random_params(&cfg, 0.2, 3).unwrap();
    let mut meta = metadata("llama", &cfg);
    edit(&mut meta, &mut params);
    let file = root.join(format!("{name}.gguf"));
    write_gguf(&file, "llama", &cfg, &params, GgmlDType::Q8_0, &meta).unwrap();
    file
}

fn set(meta: &mut Vec<(String, Value)>, key: &str, v: Value) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.into(), v));
}

/// What is not implemented, and what is malformed, is refused with an error naming it.
#[test]
fn unimplemented_and_malformed_files_are_refused_by_name() {
    let root = tmp().join("refused");
    let err = |f: &Path| GgufModel::open(f).unwrap_err().to_string();

    let f = write_with(&root, "arch", |m, _| {
        set(m, "general.architecture", Value::String("gemma3".into()))
    });
    let e = err(&f);
    assert!(
        e.contains("\"gemma3\"") && e.contains("not implemented"),
        "{e}"
    );

    let f = write_with(&root, "spm", |m, _| {
        set(m, "tokenizer.ggml.model", Value::String("llama".into()))
    });
    let e = err(&f);
    assert!(
        e.contains("tokenizer.ggml.model \"llama\" is not implemented"),
        "{e}"
    );

    let f = write_with(&root, "rope", |_, p| {
        p.insert(
            "rope_freqs.weight".into(),
            Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = err(&f);
    assert!(
        e.contains("rope_freqs.weight") && e.contains("Llama 3"),
        "{e}"
    );

    let f = write_with(&root, "scaling", |m, _| {
        set(m, "llama.rope.scaling.type", Value::String("yarn".into()))
    });
    let e = err(&f);
    assert!(
        e.contains("llama.rope.scaling.type") && e.contains("yarn"),
        "{e}"
    );

    let f = write_with(&root, "nokey", |m, _| {
        m.retain(|(k, _)| k != "llama.attention.head_count")
    });
    let e = err(&f);
    assert!(
        e.contains("llama.attention.head_count") && e.contains("missing"),
        "{e}"
    );

    let f = write_with(&root, "badtype", |m, _| {
        set(m, "llama.block_count", Value::String("two".into()))
    });
    let e = err(&f);
    assert!(e.contains("llama.block_count"), "{e}");

    let f = write_with(&root, "layers", |m, _| {
        set(m, "llama.block_count", Value::U32(3))
    });
    let e = err(&f);
    assert!(
        e.contains("llama.block_count") && e.contains("3 layers"),
        "{e}"
    );

    let f = write_with(&root, "huge", |m, _| {
        set(m, "llama.block_count", Value::U32(u32::MAX))
    });
    let e = err(&f);
    assert!(
        e.contains("llama.block_count") && e.contains("holds tensors of 2"),
        "{e}"
    );

    let f = write_with(&root, "context", |m, _| {
        set(m, "llama.context_length", Value::U64(u64::MAX >> 1))
    });
    let e = err(&f);
    assert!(
        e.contains("llama.context_length") && e.contains("too large"),
        "{e}"
    );

    let f = write_with(&root, "shape", |m, _| {
        set(m, "llama.embedding_length", Value::U32(64))
    });
    let e = err(&f);
    assert!(e.contains("shape"), "{e}");

    let f = write_with(&root, "extra", |_, p| {
        p.remove("lm_head.weight");
        p.insert(
            "model.layers.0.mlp.gate_proj.bias".into(),
            Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = err(&f);
    assert!(e.contains("blk.0.ffn_gate.bias"), "{e}");

    // Truncated anywhere: an error, never a panic.
    let good = std::fs::read(write_with(&root, "good", |_, _| {})).unwrap();
    assert!(GgufModel::open(root.join("good.gguf")).is_ok());
    for cut in [0, 3, 8, 30, 200, 5000, good.len() / 2, good.len() - 1] {
        let f = root.join("cut.gguf");
        std::fs::write(&f, &good[..cut]).unwrap();
        match GgufModel::open(&f) {
            Err(_) => {}
            Ok(g) => {
                let e = g.tensors(DType::F32, &Device::Cpu).unwrap_err();
                assert!(matches!(e, GgufError::Tensor { .. }), "{e}");
            }
        }
    }
    // Flipped bytes in the header: an error or a model, never a panic.
    for at in (0..good.len().min(4000)).step_by(97) {
        let mut bad = good.clone();
        bad[at] ^= 0xA5;
        let f = root.join("flip.gguf");
        std::fs::write(&f, &bad).unwrap();
        if let Ok(g) = GgufModel::open(&f) {
            let _ = g.tensors(DType::F32, &Device::Cpu);
        }
    }
}

/// Real text from the GSM8K file, a few hundred lines.
fn real_text() -> Vec<String> {
    let data = std::env::var_os("XDISTILL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/work/shared/data"));
    let text = std::fs::read_to_string(data.join("gsm8k/train.jsonl"))
        .expect("GSM8K at $XDISTILL_DATA/gsm8k/train.jsonl (default /work/shared/data)");
    let mut out = Vec::new();
    for line in text.lines().take(300) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        out.push(v["question"].as_str().unwrap().to_string());
        out.push(v["answer"].as_str().unwrap().to_string());
    }
    out.push("  leading spaces, tabs\tand\nnew lines\n\n  ".into());
    out.push("Ünïcödé — “quotes”, emoji 🙂, 日本語のテキスト, 1234567 + 89".into());
    out
}

/// A GGUF tokenizer made from the vocabulary, merges and added tokens of a real `tokenizer.json`
/// (as llama.cpp's converter stores them) gives that tokenizer's ids on real text.
#[test]
fn gguf_tokenizer_gives_the_ids_of_its_tokenizer_json() {
    for (name, pre, specials) in [
        (
            "qwen3",
            "qwen2",
            "<|im_start|>user\nhi<|im_end|><|endoftext|>",
        ),
        ("llama3", "llama-bpe", "<|begin_of_text|>hi<|eot_id|>"),
    ] {
        let path = xdistill_testkit::tokenizer_json(name);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let reference = tokenizers::Tokenizer::from_file(&path).unwrap();
        let meta: HashMap<String, Value> = bpe_tokenizer_metadata(&json, pre)
            .unwrap()
            .into_iter()
            .collect();
        let built =
            xdistill_shared::gguf::tokenizer::from_metadata(Path::new(name), &meta).unwrap();
        let tok: tokenizers::Tokenizer = built.json.parse().unwrap();
        assert_eq!(
            tok.get_vocab_size(true),
            reference.get_vocab_size(true),
            "{name}"
        );
        let mut texts = real_text();
        texts.push(specials.into());
        let mut n = 0;
        for t in &texts {
            let want = reference.encode(t.as_str(), false).unwrap();
            let got = tok.encode(t.as_str(), false).unwrap();
            assert_eq!(got.get_ids(), want.get_ids(), "{name}: {t:?}");
            assert_eq!(tok.decode(got.get_ids(), false).unwrap(), *t, "{name}");
            n += got.len();
        }
        eprintln!("{name}: {} texts, {n} tokens, ids equal", texts.len());
    }
}

/// BOS/EOS on encode and added tokens as transformers 5.24 builds them from the same metadata
/// (the expected ids were printed by `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on a
/// file written by the `gguf` Python package with these keys).
#[test]
fn bos_eos_and_user_defined_tokens_follow_transformers() {
    let mut tokens: Vec<Value> = (33u8..127)
        .map(|c| Value::String(char::from(c).into()))
        .collect();
    let mut types = vec![Value::I32(1); tokens.len()];
    for (t, ty) in [("<s>", 3), ("</s>", 3), ("<|u|>", 4), ("hi", 1)] {
        tokens.push(Value::String(t.into()));
        types.push(Value::I32(ty));
    }
    for (bos, eos, want) in [
        (true, false, vec![94, 97, 96, 71]),
        (false, true, vec![97, 96, 71, 95]),
        (true, true, vec![94, 97, 96, 71, 95]),
        (false, false, vec![97, 96, 71]),
    ] {
        let meta: HashMap<String, Value> = [
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("default".into())),
            ("tokenizer.ggml.tokens", Value::Array(tokens.clone())),
            ("tokenizer.ggml.token_type", Value::Array(types.clone())),
            (
                "tokenizer.ggml.merges",
                Value::Array(vec![Value::String("h i".into())]),
            ),
            ("tokenizer.ggml.bos_token_id", Value::U32(94)),
            ("tokenizer.ggml.eos_token_id", Value::U32(95)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(bos)),
            ("tokenizer.ggml.add_eos_token", Value::Bool(eos)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let built =
            xdistill_shared::gguf::tokenizer::from_metadata(Path::new("t.gguf"), &meta).unwrap();
        let tok: tokenizers::Tokenizer = built.json.parse().unwrap();
        let got = tok.encode("hi<|u|>h", true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "add_bos {bos}, add_eos {eos}");
    }
}

/// Log-softmax over the vocabulary of `[1, T, V]` logits, f64.
fn log_probs(logits: &Tensor) -> Tensor {
    candle_nn::ops::log_softmax(
        &logits.to_dtype(DType::F64).unwrap(),
        candle_core::D::Minus1,
    )
    .unwrap()
}

fn max_abs_f64(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// `--gguf-weights quantized`: the projections stay in their block format and run candle's
/// quantized matmuls (activations quantized to 8 bits per block), so the scores are the quantized
/// model's own, within [`QUANTIZED_GAP`] of the dequantized weights' log-probs on these tiny
/// random models. Q8_0 has an exact reference: re-quantizing a Q8_0 matrix's dequantized values
/// gives back its blocks, so a decoder built from the dequantized (un-permuted) weights with
/// those projections re-quantized must give the same bits — which checks the block-row
/// un-permutation of Llama's q/k and that no placeholder survives. Projections stored as F32 or
/// F16 are not block-quantized and stay dense: bit-identical to the dequantized mode.
#[test]
fn quantized_matmuls_score_near_the_dequantized_weights() {
    /// The largest |log-prob difference| allowed, quantized vs dequantized matmuls, on these
    /// random tiny models (measured: 7.2e-3 to 4.3e-2 for Q8_0, 1.1e-2 to 2.6e-2 for
    /// Q4_0/Q4_1/Q5_0, 7.5e-2 Q4_K and 8.3e-2 Q6_K at hidden 256; the real SmolLM2 file's gap
    /// is in docs/models.md).
    const QUANTIZED_GAP: f64 = 0.2;
    /// Weights' init std: small enough that the random models do not amplify the activations'
    /// 8-bit rounding into wide log-prob swings (at 0.2 a Q4_K model of hidden 256 moved by 2.6).
    const STD: f64 = 0.05;
    let root = tmp().join("quantized");
    std::fs::create_dir_all(&root).unwrap();
    // Wider configs: rows of two 32-element blocks (Q4_1, Q5_0, Q5_1 kernels work on block
    // pairs; rows of one block stay dense) and of the K-quants' 256-element blocks.
    let sized = |arch: &str, tied: bool, hidden: usize| -> ModelConfig {
        let mut v = serde_json::to_value(tiny_config(arch, tied)).unwrap();
        v["hidden_size"] = hidden.into();
        v["intermediate_size"] = (2 * hidden).into();
        v["head_dim"] = (hidden / 4).into();
        serde_json::from_value(v).unwrap()
    };
    let cases = [
        ("llama", GgmlDType::F32, tiny_config("llama", false)),
        ("llama", GgmlDType::F16, tiny_config("llama", true)),
        ("llama", GgmlDType::Q8_0, tiny_config("llama", true)),
        ("llama", GgmlDType::Q8_0, sized("llama", false, 256)),
        ("llama", GgmlDType::Q4_1, sized("llama", false, 64)),
        ("llama", GgmlDType::Q4_0, tiny_config("llama", true)),
        ("qwen3", GgmlDType::Q8_0, tiny_config("qwen3", false)),
        ("qwen2", GgmlDType::Q5_0, sized("qwen2", true, 64)),
        ("llama", GgmlDType::Q4K, sized("llama", true, 256)),
        ("qwen3", GgmlDType::Q6K, sized("qwen3", false, 256)),
    ];
    for (arch, ty, cfg) in cases {
        let name = format!("{arch}-{ty:?}-{}", cfg.hidden_size);
        let params = xdistill_shared::init::random_params(&cfg, STD, 11).unwrap();
        let file = root.join(format!("{name}.gguf"));
        write_gguf(&file, arch, &cfg, &params, ty, &metadata(arch, &cfg)).unwrap();
        let g = GgufModel::open(&file).unwrap();
        let (dtype, dev) = (DType::F32, Device::Cpu);
        let dense = g.decoder(WeightMode::Dequantize, dtype, &dev).unwrap();
        let quant = g.decoder(WeightMode::Quantized, dtype, &dev).unwrap();
        let kept = g.quantized_tensors(dtype, &dev).unwrap().quantized.len();
        let label = g.weights_label(WeightMode::Quantized);
        let (want, got) = (logits(&dense), logits(&quant));
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        if matches!(ty, GgmlDType::F32 | GgmlDType::F16) {
            assert_eq!(kept, 0, "{name}: plain floats stay dense");
            assert_eq!(label, g.weights_label(WeightMode::Dequantize), "{name}");
            assert_eq!(bits(&want), bits(&got), "{name}: bit-identical");
            continue;
        }
        // Every attention and MLP projection of both layers is kept quantized.
        assert_eq!(kept, 2 * 7, "{name}");
        assert_eq!(
            label,
            format!("gguf {} (quantized matmuls)", g.quantization())
        );
        let gap = max_abs_f64(&log_probs(&want), &log_probs(&got));
        eprintln!("{name}: quantized vs dequantized matmuls, max |log-prob diff| {gap:.2e}");
        assert!(gap > 0.0, "{name}: the quantized kernels ran");
        assert!(gap <= QUANTIZED_GAP, "{name}: log-probs differ by {gap}");
        if ty == GgmlDType::Q8_0 {
            let weights = g.tensors(dtype, &dev).unwrap();
            let requantized: HashMap<String, std::sync::Arc<QTensor>> = weights
                .iter()
                .filter(|(k, _)| k.starts_with("model.layers.") && k.ends_with("_proj.weight"))
                .map(|(k, w)| {
                    let q = QTensor::quantize(w, GgmlDType::Q8_0).unwrap();
                    (k.clone(), std::sync::Arc::new(q))
                })
                .collect();
            let vb = VarBuilder::from_tensors(weights, dtype, &dev);
            let mut reference = Decoder::new(&g.config, vb, Ops::Fused).unwrap();
            reference.quantize_linears(requantized).unwrap();
            assert_eq!(
                bits(&logits(&reference)),
                bits(&got),
                "{name}: exact reference"
            );
        }
    }
    // Q4_1 rows of one block (hidden 32) stay dense, where candle's kernel asserts block
    // pairs; `down_proj`'s rows (intermediate 64: two blocks) are kept quantized.
    let cfg = tiny_config("llama", true);
    let params = xdistill_shared::init::random_params(&cfg, STD, 11).unwrap();
    let file = root.join("llama-Q4_1-odd.gguf");
    write_gguf(
        &file,
        "llama",
        &cfg,
        &params,
        GgmlDType::Q4_1,
        &metadata("llama", &cfg),
    )
    .unwrap();
    let g = GgufModel::open(&file).unwrap();
    let w = g.quantized_tensors(DType::F32, &Device::Cpu).unwrap();
    let mut kept: Vec<&String> = w.quantized.keys().collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.mlp.down_proj.weight"
        ]
    );
    let quant = g
        .decoder(WeightMode::Quantized, DType::F32, &Device::Cpu)
        .unwrap();
    let dense = g
        .decoder(WeightMode::Dequantize, DType::F32, &Device::Cpu)
        .unwrap();
    let gap = max_abs_f64(&log_probs(&logits(&dense)), &log_probs(&logits(&quant)));
    assert!(gap > 0.0 && gap <= QUANTIZED_GAP, "{gap}");
}

/// The bytes of a small valid GGUF file (the tiny Llama, Q8_0), written once per test binary.
fn good_file() -> &'static [u8] {
    static GOOD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    GOOD.get_or_init(|| {
        // Per process: nextest runs this binary's tests side by side.
        let root = tmp().join(format!("good-file-{}", std::process::id()));
        let f = write_with(&root, "good", |m, _| {
            // Written explicitly, so that patches can reach what candle divides by.
            set(m, "general.alignment", Value::U32(32))
        });
        std::fs::read(f).unwrap()
    })
}

/// Where the header's fields are in [`good_file`]: the length prefix and the end of every key
/// and tensor name (what follows a name is its value type and value, or its dimension count,
/// dimensions, type and offset), so that patches land on fields rather than inside strings.
fn anchors() -> &'static [usize] {
    static ANCHORS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    ANCHORS.get_or_init(|| {
        let bytes = good_file();
        let c = candle_core::quantized::gguf_file::Content::read(&mut std::io::Cursor::new(bytes))
            .unwrap();
        let names = c.metadata.keys().chain(c.tensor_infos.keys());
        let mut out: Vec<usize> = vec![8, 16];
        for n in names {
            let mut needle = (n.len() as u64).to_le_bytes().to_vec();
            needle.extend_from_slice(n.as_bytes());
            let at = find(bytes, &needle);
            out.extend([at, at + needle.len()]);
        }
        out.push(c.tensor_data_offset as usize);
        out
    })
}

/// Offset of the first occurrence of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

/// What candle's reader divides by, or keeps the last of, or reads past the end of: refused by
/// name at open, never a panic or a silent pick.
#[test]
fn alignment_duplicates_and_truncation_are_refused_at_open() {
    let root = tmp().join("header");
    let err = |f: &Path| GgufModel::open(f).unwrap_err().to_string();

    // general.alignment 0 (candle divides by it) and 48 (not a power of two).
    for a in [0u32, 48] {
        let f = write_with(&root, &format!("align{a}"), |m, _| {
            set(m, "general.alignment", Value::U32(a))
        });
        let e = err(&f);
        assert!(
            e.contains("general.alignment") && e.contains("power of two"),
            "{e}"
        );
    }

    // A key given twice (candle keeps the last).
    let f = write_with(&root, "dupkey", |m, _| {
        m.push(("llama.block_count".into(), Value::U32(2)))
    });
    let e = err(&f);
    assert!(
        e.contains("\"llama.block_count\"") && e.contains("given twice"),
        "{e}"
    );

    // A second record named like an existing tensor, pointing at other data (candle keeps the
    // last, so the file used to load with other weights): an extra tensor, renamed in place.
    let f = write_with(&root, "extra", |_, p| {
        let w = Tensor::randn(0f32, 1.0, (32, 32), &Device::Cpu).unwrap();
        p.insert("xxx.0.attn_q.weight".into(), w);
    });
    let mut bytes = std::fs::read(&f).unwrap();
    let at = find(&bytes, b"xxx.0.attn_q.weight");
    bytes[at..at + 3].copy_from_slice(b"blk");
    let f = root.join("duptensor.gguf");
    std::fs::write(&f, &bytes).unwrap();
    let e = err(&f);
    assert!(
        e.contains("blk.0.attn_q.weight") && e.contains("given twice"),
        "{e}"
    );

    // One byte short: the last tensor's data runs past the end, said at open.
    let good = good_file();
    let f = root.join("short.gguf");
    std::fs::write(&f, &good[..good.len() - 1]).unwrap();
    let e = err(&f);
    assert!(
        e.contains("past the end of the file") && e.contains("truncated"),
        "{e}"
    );

    // Not a GGUF file at all.
    let f = root.join("empty.gguf");
    std::fs::write(&f, b"").unwrap();
    assert!(err(&f).contains("not a GGUF file"), "{}", err(&f));
}

/// Opens `bytes` (written to a file of this thread's own) under `catch_unwind`: whether it
/// panicked, and the most bytes the open had allocated at once.
fn open_patched(bytes: &[u8]) -> (bool, usize) {
    let root = tmp().join(format!("fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let name = format!("{:?}.gguf", std::thread::current().id()).replace(['(', ')'], "");
    let f = root.join(name);
    std::fs::write(&f, bytes).unwrap();
    let (opened, peak) =
        peak_allocated(|| std::panic::catch_unwind(|| GgufModel::open(&f).map(|_| ())));
    (opened.is_err(), peak)
}

/// Every header field (each 4-byte step after each name, and each length prefix) set to 0 and
/// to all ones: never a panic (`general.alignment` 0 made candle divide by zero), never more
/// than 64 MiB allocated by one open.
#[test]
fn every_header_field_at_its_extremes_is_an_error_or_a_model() {
    let good = good_file();
    let mut most = 0;
    for &a in anchors() {
        for d in (0..24).step_by(4) {
            for v in [0u32, u32::MAX] {
                let mut bytes = good.to_vec();
                apply(&mut bytes, &Patch::U32(a + d, v));
                let (panicked, peak) = open_patched(&bytes);
                assert!(!panicked, "open panicked with {v:#x} at byte {}", a + d);
                assert!(
                    peak < 64 << 20,
                    "open allocated {peak} bytes ({v:#x} at {})",
                    a + d
                );
                most = most.max(peak);
            }
        }
    }
    eprintln!("the most one open allocated: {most} bytes");
}

/// One change to a file: a flipped byte, or an extreme 4- or 8-byte integer written over it.
#[derive(Debug, Clone)]
enum Patch {
    Flip(usize, u8),
    U32(usize, u32),
    U64(usize, u64),
}

fn apply(bytes: &mut [u8], p: &Patch) {
    let put = |bytes: &mut [u8], at: usize, v: &[u8]| {
        let at = at.min(bytes.len().saturating_sub(v.len()));
        bytes[at..at + v.len()].copy_from_slice(v);
    };
    match *p {
        Patch::Flip(at, x) => bytes[at % bytes.len()] ^= x.max(1),
        Patch::U32(at, v) => put(bytes, at, &v.to_le_bytes()),
        Patch::U64(at, v) => put(bytes, at, &v.to_le_bytes()),
    }
}

fn patch() -> impl proptest::strategy::Strategy<Value = Patch> {
    use proptest::prelude::*;
    // Mostly the header's fields (up to 24 bytes past an anchor), else anywhere in the header
    // (about the first 8 KiB) or the file.
    let field = (0..anchors().len(), 0usize..24).prop_map(|(i, d)| anchors()[i] + d);
    let at = prop_oneof![4 => field, 2 => 0usize..8192, 1 => 0usize..1 << 20];
    let u32s = prop_oneof![
        Just(0u32),
        Just(1),
        Just(3),
        Just(u32::MAX),
        Just(1 << 31),
        any::<u32>()
    ];
    let u64s = prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(1 << 31),
        Just(1 << 40),
        Just(u64::MAX >> 1),
        any::<u64>()
    ];
    prop_oneof![
        (at.clone(), any::<u8>()).prop_map(|(a, x)| Patch::Flip(a, x)),
        (at.clone(), u32s).prop_map(|(a, v)| Patch::U32(a, v)),
        (at, u64s).prop_map(|(a, v)| Patch::U64(a, v)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..Default::default()
    })]

    /// Byte patches of a real file: opening it is an error or a model, never a panic, and no
    /// open allocates more than 64 MiB (the file is 60 KiB).
    #[test]
    fn patched_files_never_panic_and_allocate_little(
        patches in proptest::collection::vec(patch(), 1..4)
    ) {
        let mut bytes = good_file().to_vec();
        for p in &patches {
            apply(&mut bytes, p);
        }
        let (panicked, peak) = open_patched(&bytes);
        proptest::prop_assert!(!panicked, "open panicked on {patches:?}");
        proptest::prop_assert!(peak < 64 << 20, "open allocated {peak} bytes on {patches:?}");
    }
}
