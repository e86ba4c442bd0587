//! Decoder invariants on tiny random models: the two op modes agree, incremental decoding with a
//! KV cache equals a full forward, and padding never changes the logits of real tokens.

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use xdistill_shared::hf::{LayerKind, ModelConfig};
use xdistill_shared::model::{param_specs, Decoder, Init, KvCache, Ops};

/// `cpu` unless `XDISTILL_TEST_DEVICE` names another (`cuda`, `cuda:N`: the GPU check runs these
/// tests there with a CUDA build).
/// Opened once: two opens of a GPU are two candle devices whose tensors do not mix.
pub(crate) fn dev() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| {
        let name = std::env::var("XDISTILL_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
        xdistill_shared::device::parse_device(&name).unwrap()
    })
    .clone()
}

fn config(model_type: &str) -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "model_type": model_type, "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": model_type == "llama",
        "attention_bias": false
    }))
    .unwrap()
}

/// [`config`] of `model_type` with the keys of `extra` set (validated).
pub(crate) fn config_with(model_type: &str, extra: serde_json::Value) -> ModelConfig {
    let mut v = serde_json::to_value(config(model_type)).unwrap();
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    let cfg: ModelConfig = serde_json::from_value(v).unwrap();
    cfg.validate().unwrap();
    cfg
}

/// Every architecture, each with its features switched on: windows shorter than [`SEQ`],
/// Gemma's local/global layers, Phi-3's partial rotary, Qwen3-MoE's experts with a dense layer.
fn arch_configs() -> Vec<(&'static str, ModelConfig)> {
    let with = config_with;
    vec![
        ("qwen3", config("qwen3")),
        ("qwen2", config("qwen2")),
        ("llama", config("llama")),
        (
            "mistral",
            with("mistral", serde_json::json!({"sliding_window": 3})),
        ),
        (
            "ministral",
            with(
                "ministral",
                serde_json::json!({"sliding_window": 3,
                    "layer_types": ["sliding_attention", "full_attention"]}),
            ),
        ),
        (
            "qwen3 window",
            with(
                "qwen3",
                serde_json::json!({"sliding_window": 3, "use_sliding_window": true,
                    "max_window_layers": 1}),
            ),
        ),
        (
            "gemma3",
            with(
                "gemma3_text",
                serde_json::json!({"num_hidden_layers": 3, "sliding_window": 3,
                    "sliding_window_pattern": 3, "query_pre_attn_scalar": 8,
                    "rope_local_base_freq": 100.0, "tie_word_embeddings": true}),
            ),
        ),
        (
            "phi3",
            with(
                "phi3",
                serde_json::json!({"head_dim": null, "hidden_size": 32, "partial_rotary_factor": 0.5,
                    "sliding_window": 4}),
            ),
        ),
        (
            "qwen3_moe",
            with(
                "qwen3_moe",
                serde_json::json!({"num_hidden_layers": 3, "num_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": true,
                    "mlp_only_layers": [1]}),
            ),
        ),
    ]
}

/// Deterministic pseudo-random parameters (a simple LCG; no RNG crate needed).
pub(crate) fn params(cfg: &ModelConfig) -> HashMap<String, Tensor> {
    let mut state = 12345u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    param_specs(cfg, 0.2)
        .into_iter()
        .map(|s| {
            let n: usize = s.shape.iter().product();
            let v: Vec<f32> = match s.init {
                Init::Normal(_) => (0..n).map(|_| next() * 0.6).collect(),
                // Non-trivial norms and biases so their code paths matter.
                _ => (0..n).map(|_| 1.0 + next() * 0.5).collect(),
            };
            (s.name, Tensor::from_vec(v, s.shape, &dev()).unwrap())
        })
        .collect()
}

fn model(cfg: &ModelConfig, ops: Ops) -> Decoder {
    let vb = VarBuilder::from_tensors(params(cfg), DType::F32, &dev());
    Decoder::new(cfg, vb, ops).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(D::Minus1)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn ids(v: &[u32]) -> Tensor {
    Tensor::new(v, &dev()).unwrap().unsqueeze(0).unwrap()
}

const SEQ: [u32; 9] = [3, 17, 42, 8, 8, 1, 49, 0, 23];

#[test]
fn fused_and_differentiable_ops_agree() {
    for (arch, cfg) in arch_configs() {
        let a = model(&cfg, Ops::Fused).forward(&ids(&SEQ)).unwrap();
        let b = model(&cfg, Ops::Differentiable)
            .forward(&ids(&SEQ))
            .unwrap();
        assert_eq!(a.dims(), &[1, SEQ.len(), 50]);
        assert!(
            max_abs_diff(&a, &b) < 1e-4,
            "{arch}: {}",
            max_abs_diff(&a, &b)
        );
    }
}

#[test]
fn kv_cache_matches_full_forward() {
    for ((arch, cfg), ops) in arch_configs()
        .into_iter()
        .flat_map(|c| [(c.clone(), Ops::Fused), (c, Ops::Differentiable)])
    {
        let m = model(&cfg, ops);
        let full = m.forward(&ids(&SEQ)).unwrap();
        let mut cache = KvCache::new(cfg.num_hidden_layers);
        let mut parts = vec![m
            .logits(
                &m.forward_hidden(&ids(&SEQ[..4]), Some(&mut cache), None, None)
                    .unwrap(),
            )
            .unwrap()];
        for &t in &SEQ[4..] {
            parts.push(
                m.logits(
                    &m.forward_hidden(&ids(&[t]), Some(&mut cache), None, None)
                        .unwrap(),
                )
                .unwrap(),
            );
        }
        assert_eq!(cache.seq_len(), SEQ.len());
        let inc = Tensor::cat(&parts, 1).unwrap();
        assert!(
            max_abs_diff(&full, &inc) < 1e-4,
            "{arch} {ops:?}: {}",
            max_abs_diff(&full, &inc)
        );
    }
}

#[test]
fn right_padding_and_batching_do_not_change_real_logits() {
    let cfg = config("llama");
    let m = model(&cfg, Ops::Fused);
    let short = &SEQ[..5];
    let alone = m.forward(&ids(short)).unwrap();
    // Batch [short + pads, full]: the causal mask keeps pads out of the real positions.
    let mut padded = short.to_vec();
    padded.resize(SEQ.len(), 0);
    let flat: Vec<u32> = padded.iter().chain(SEQ.iter()).copied().collect();
    let batch = Tensor::from_vec(flat, (2, SEQ.len()), &dev()).unwrap();
    let out = m.forward(&batch).unwrap();
    let first = out
        .get(0)
        .unwrap()
        .narrow(0, 0, short.len())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    assert!(max_abs_diff(&alone, &first) < 1e-5);
    let second = out.get(1).unwrap().unsqueeze(0).unwrap();
    assert!(max_abs_diff(&m.forward(&ids(&SEQ)).unwrap(), &second) < 1e-5);
}

#[test]
fn left_padding_with_positions_and_key_mask() {
    let cfg = config("qwen2");
    let m = model(&cfg, Ops::Differentiable);
    let short = &SEQ[..5];
    let alone = m.forward(&ids(short)).unwrap();
    let pad = 3usize;
    let mut row = vec![0u32; pad];
    row.extend_from_slice(short);
    let positions: Vec<u32> = (0..row.len())
        .map(|i| i.saturating_sub(pad) as u32)
        .collect();
    let valid: Vec<u8> = (0..row.len()).map(|i| (i >= pad) as u8).collect();
    let pos = Tensor::new(positions.as_slice(), &dev())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let kv = Tensor::new(valid.as_slice(), &dev())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let h = m
        .forward_hidden(&ids(&row), None, Some(&pos), Some(&kv))
        .unwrap();
    let out = m.logits(&h).unwrap().narrow(1, pad, short.len()).unwrap();
    assert!(
        max_abs_diff(&alone, &out) < 1e-4,
        "{}",
        max_abs_diff(&alone, &out)
    );
    // Pad rows stay finite (they attend to themselves), so no NaN leaks anywhere.
    let all = m
        .logits(&h)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(all.iter().all(|x| x.is_finite()));
}

#[test]
fn too_long_sequence_is_an_error_not_a_panic() {
    let cfg = config("qwen3");
    let m = model(&cfg, Ops::Fused);
    let long: Vec<u32> = (0..65).map(|i| i % 50).collect();
    assert!(m.forward(&ids(&long)).is_err());
}

/// A config from JSON edits of the llama test config.
fn edited(edit: serde_json::Value) -> Result<ModelConfig, String> {
    let mut v = serde_json::to_value(config("llama")).unwrap();
    for (k, x) in edit.as_object().unwrap() {
        if x.is_null() {
            v.as_object_mut().unwrap().remove(k);
        } else {
            v[k] = x.clone();
        }
    }
    let cfg: ModelConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// transformers ≥ 5 writes RoPE settings under `rope_parameters`: the same model written either
/// way gives bit-identical logits, and a different base gives different ones (the key is read,
/// not ignored as it was: θ = 10,000 served silently).
#[test]
fn rope_parameters_equal_top_level_rope_settings() {
    let llama3 = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16});
    let old = edited(serde_json::json!({"rope_theta": 500000.0})).unwrap();
    let new = edited(serde_json::json!({"rope_theta": null,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}))
    .unwrap();
    let base = edited(serde_json::json!({"rope_theta": null})).unwrap();
    let old_scaled =
        edited(serde_json::json!({"rope_theta": 500000.0, "rope_scaling": llama3})).unwrap();
    let mut p = llama3.clone();
    p["rope_theta"] = serde_json::json!(500000.0);
    let new_scaled = edited(serde_json::json!({"rope_theta": null, "rope_parameters": p})).unwrap();
    assert_eq!(new.rope_theta(), 500000.0);
    let logits = |c: &ModelConfig| model(c, Ops::Fused).forward(&ids(&SEQ)).unwrap();
    assert_eq!(max_abs_diff(&logits(&old), &logits(&new)), 0.0);
    assert_eq!(
        max_abs_diff(&logits(&old_scaled), &logits(&new_scaled)),
        0.0
    );
    assert!(max_abs_diff(&logits(&base), &logits(&new)) > 1e-4);
    assert!(max_abs_diff(&logits(&old), &logits(&old_scaled)) > 1e-4);
}

/// Every setting that changes the math but is not implemented is refused, naming the key.
#[test]
fn unimplemented_settings_are_refused_by_name() {
    for (edit, needle) in [
        (
            serde_json::json!({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}),
            "mrope",
        ),
        (
            serde_json::json!({"rope_parameters": {"rope_type": "proportional", "factor": 2.0,
            "rope_theta": 10000.0}}),
            "proportional",
        ),
        (
            serde_json::json!({"rope_parameters": {"full_attention": {"rope_theta": 1e6},
            "chunked_attention": {"rope_theta": 1e4}}}),
            "chunked_attention",
        ),
        (
            serde_json::json!({"layer_types": ["full_attention", "linear_attention"]}),
            "linear_attention",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            "low_freq_factor",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "yarn"}}),
            "factor",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
            "long_factor": [1.0, 2.0]}}),
            "short_factor",
        ),
        (
            serde_json::json!({"rope_theta": 20000.0, "rope_parameters": {"rope_theta": 500000.0,
            "rope_type": "default"}}),
            "disagree",
        ),
        (serde_json::json!({"mlp_bias": true}), "mlp_bias"),
        (
            serde_json::json!({"partial_rotary_factor": 0.3}),
            "partial_rotary_factor",
        ),
        (
            serde_json::json!({"final_logit_softcapping": 30.0}),
            "final_logit_softcapping",
        ),
        (
            serde_json::json!({"attn_logit_softcapping": 50.0}),
            "attn_logit_softcapping",
        ),
        (
            serde_json::json!({"use_bidirectional_attention": true}),
            "use_bidirectional_attention",
        ),
        (serde_json::json!({"hidden_act": "relu"}), "hidden_act"),
        (serde_json::json!({"model_type": "gpt2"}), "gpt2"),
    ] {
        let err = edited(edit.clone()).expect_err(&edit.to_string());
        assert!(err.contains(needle), "{edit}: {err}");
    }
    // What real checkpoints carry and is implemented, or changes nothing, is accepted.
    for ok in [
        serde_json::json!({"sliding_window": 16, "use_sliding_window": false}),
        serde_json::json!({"sliding_window": null}),
        serde_json::json!({"sliding_window": 4096}),
        serde_json::json!({"mlp_bias": false, "partial_rotary_factor": 1.0,
            "final_logit_softcapping": null}),
        serde_json::json!({"rope_scaling": {"rope_type": "default"}}),
        serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 16}}),
        serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
        serde_json::json!({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
            "rope_theta": 10000.0}}),
        serde_json::json!({"partial_rotary_factor": 0.5}),
        serde_json::json!({"hidden_act": "gelu_pytorch_tanh"}),
    ] {
        edited(ok.clone()).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
}

/// Scores of a window model for the rows of `seq`: alone, right-padded in a batch with a longer
/// sequence, and in chunks over a KV cache all agree; and the window is honoured (a model
/// without it scores differently).
#[test]
fn sliding_windows_hold_batched_alone_and_chunked() {
    for (arch, cfg) in arch_configs() {
        if cfg
            .layer_kinds()
            .unwrap()
            .iter()
            .all(|k| *k == LayerKind::Full)
        {
            continue;
        }
        let m = model(&cfg, Ops::Fused);
        let short = &SEQ[..7];
        let alone = m.forward(&ids(short)).unwrap();
        // Batched: [short + pads, SEQ].
        let mut padded = short.to_vec();
        padded.resize(SEQ.len(), 0);
        let flat: Vec<u32> = padded.iter().chain(SEQ.iter()).copied().collect();
        let batch = Tensor::from_vec(flat, (2, SEQ.len()), &dev()).unwrap();
        let batched = m.forward(&batch).unwrap();
        let first = batched.get(0).unwrap().narrow(0, 0, short.len()).unwrap();
        assert!(
            max_abs_diff(&alone.get(0).unwrap(), &first) < 1e-5,
            "{arch} batched"
        );
        // Chunked: 3 + 3 + 1 positions over a cache planned for the whole sequence.
        let mut cache = KvCache::for_sequence(short.len());
        let mut parts = Vec::new();
        for chunk in short.chunks(3) {
            let h = m
                .forward_hidden(&ids(chunk), Some(&mut cache), None, None)
                .unwrap();
            parts.push(m.logits(&h).unwrap());
        }
        let chunked = Tensor::cat(&parts, 1).unwrap();
        assert!(max_abs_diff(&alone, &chunked) < 1e-4, "{arch} chunked");
        // The window matters: without it the last rows change.
        let mut wide = serde_json::to_value(&cfg).unwrap();
        wide["sliding_window"] = serde_json::json!(64);
        let wide: ModelConfig = serde_json::from_value(wide).unwrap();
        let unwindowed = model(&wide, Ops::Fused).forward(&ids(short)).unwrap();
        assert!(
            max_abs_diff(&alone, &unwindowed) > 1e-3,
            "{arch}: window ignored"
        );
    }
}

/// The window's edge, against an independent reference: RoPE scores depend only on the
/// distance between positions, so in a one-layer model with window `w` the row of position `i`
/// equals the last row of the `w` tokens ending at `i` scored by the same weights without a
/// window — and not that of the `w + 1` tokens ending there (no off-by-one).
#[test]
fn window_edge_matches_truncated_sequences() {
    let mut v = serde_json::to_value(config("mistral")).unwrap();
    v["num_hidden_layers"] = serde_json::json!(1);
    let full_cfg: ModelConfig = serde_json::from_value(v.clone()).unwrap();
    v["sliding_window"] = serde_json::json!(3);
    let cfg: ModelConfig = serde_json::from_value(v).unwrap();
    let windowed = model(&cfg, Ops::Fused)
        .forward(&ids(&SEQ))
        .unwrap()
        .get(0)
        .unwrap();
    let plain = model(&full_cfg, Ops::Fused);
    let last_row = |s: &[u32]| {
        plain
            .forward(&ids(s))
            .unwrap()
            .get(0)
            .unwrap()
            .get(s.len() - 1)
            .unwrap()
    };
    for i in 0..SEQ.len() {
        let d = max_abs_diff(
            &windowed.get(i).unwrap(),
            &last_row(&SEQ[i.saturating_sub(2)..=i]),
        );
        assert!(d < 1e-4, "position {i}: {d}");
        if i >= 3 {
            let wider = max_abs_diff(&windowed.get(i).unwrap(), &last_row(&SEQ[i - 3..=i]));
            assert!(wider > 1e-3, "position {i} sees a fourth key");
        }
    }
}

/// A Qwen3-MoE layer whose experts are all one dense MLP computes that MLP (the routing weights
/// of each token sum to one with `norm_topk_prob`): its logits equal the dense Qwen3's, whether
/// the experts are stored per expert (the Hub) or fused (transformers 5 in memory).
#[test]
fn moe_of_identical_experts_equals_the_dense_model() {
    let dense_cfg = config("qwen3");
    let mut v = serde_json::to_value(&dense_cfg).unwrap();
    v["model_type"] = serde_json::json!("qwen3_moe");
    v["num_experts"] = serde_json::json!(4);
    v["num_experts_per_tok"] = serde_json::json!(2);
    v["moe_intermediate_size"] = serde_json::json!(24);
    v["norm_topk_prob"] = serde_json::json!(true);
    let moe_cfg: ModelConfig = serde_json::from_value(v).unwrap();
    let dense = params(&dense_cfg);
    let mut moe = params(&moe_cfg); // random routers
    for (name, t) in &dense {
        if let Some((layer, proj)) = name.split_once(".mlp.") {
            moe.remove(name);
            for e in 0..4 {
                moe.insert(format!("{layer}.mlp.experts.{e}.{proj}"), t.clone());
            }
        } else {
            moe.insert(name.clone(), t.clone());
        }
    }
    let load = |cfg: &ModelConfig, p: HashMap<String, Tensor>| {
        Decoder::new(
            cfg,
            VarBuilder::from_tensors(p, DType::F32, &dev()),
            Ops::Fused,
        )
        .unwrap()
    };
    // transformers 5's fused layout of the same experts: gate_up [E, 2I, H], down [E, H, I].
    let mut fused = moe.clone();
    for l in 0..moe_cfg.num_hidden_layers {
        let pre = format!("model.layers.{l}.mlp.experts");
        let take = |fused: &mut HashMap<String, Tensor>, e: usize, p: &str| {
            fused.remove(&format!("{pre}.{e}.{p}.weight")).unwrap()
        };
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..4 {
            let (g, u) = (
                take(&mut fused, e, "gate_proj"),
                take(&mut fused, e, "up_proj"),
            );
            gate_up.push(Tensor::cat(&[g, u], 0).unwrap());
            down.push(take(&mut fused, e, "down_proj"));
        }
        fused.insert(
            format!("{pre}.gate_up_proj"),
            Tensor::stack(&gate_up, 0).unwrap(),
        );
        fused.insert(format!("{pre}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    let a = load(&dense_cfg, dense).forward(&ids(&SEQ)).unwrap();
    let b = load(&moe_cfg, moe).forward(&ids(&SEQ)).unwrap();
    assert!(max_abs_diff(&a, &b) < 1e-4, "{}", max_abs_diff(&a, &b));
    let c = load(&moe_cfg, fused).forward(&ids(&SEQ)).unwrap();
    assert!(max_abs_diff(&b, &c) < 1e-5, "fused expert layout");
}

/// The text tower of a multimodal Gemma 3 checkpoint (`text_config`, weights under
/// `model.language_model.` or `language_model.model.`) loads and scores as the text-only model.
#[test]
fn gemma3_text_tower_of_a_multimodal_checkpoint() {
    let (_, cfg) = arch_configs()
        .into_iter()
        .find(|(a, _)| *a == "gemma3")
        .unwrap();
    let p = params(&cfg);
    let want = Decoder::new(
        &cfg,
        VarBuilder::from_tensors(p.clone(), DType::F32, &dev()),
        Ops::Fused,
    )
    .unwrap()
    .forward(&ids(&SEQ))
    .unwrap();
    for prefix in ["model.language_model.", "language_model.model."] {
        let dir = tempfile::tempdir().unwrap();
        let mut text = serde_json::to_value(&cfg).unwrap();
        text.as_object_mut().unwrap().remove("tie_word_embeddings");
        let top = serde_json::json!({"model_type": "gemma3", "architectures":
            ["Gemma3ForConditionalGeneration"], "text_config": text, "tie_word_embeddings": true,
            "vision_config": {"hidden_size": 8}});
        std::fs::write(dir.path().join("config.json"), top.to_string()).unwrap();
        let mut stored: Vec<(String, Tensor)> = p
            .iter()
            .map(|(k, t)| {
                (
                    format!("{prefix}{}", k.strip_prefix("model.").unwrap()),
                    t.clone(),
                )
            })
            .collect();
        stored.push((
            "model.vision_tower.patch.weight".into(),
            Tensor::zeros((2, 2), DType::F32, &dev()).unwrap(),
        ));
        let st = dir.path().join("model.safetensors");
        safetensors::serialize_to_file(stored.iter().map(|(k, t)| (k.as_str(), t)), None, &st)
            .unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        let md = xdistill_shared::hf::ModelDir::open(dir.path()).unwrap();
        assert_eq!(md.config.weight_prefix.as_deref(), Some(prefix));
        assert!(param_specs(&md.config, 0.0)
            .iter()
            .all(|s| s.name.starts_with(prefix)));
        // SAFETY: written above, not modified while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &dev()) }
            .unwrap();
        let got = Decoder::new(&md.config, vb, Ops::Fused)
            .unwrap()
            .forward(&ids(&SEQ))
            .unwrap();
        assert_eq!(max_abs_diff(&want, &got), 0.0, "{prefix}");
    }
}

/// An absent `sliding_window` takes the architecture's default as transformers does (4096 for
/// Mistral, Gemma 3 and the Qwen families when switched on); `null` means no window.
#[test]
fn absent_and_null_windows_follow_transformers_defaults() {
    let parse = |v: serde_json::Value| serde_json::from_value::<ModelConfig>(v).unwrap();
    let base = |t: &str| serde_json::to_value(config(t)).unwrap();
    let mistral = base("mistral");
    assert_eq!(parse(mistral.clone()).sliding_window(), Some(4096));
    let mut null = mistral;
    null["sliding_window"] = serde_json::Value::Null;
    assert_eq!(parse(null).sliding_window(), None);
    let mut gemma = base("gemma3_text");
    gemma["num_hidden_layers"] = serde_json::json!(6);
    let gemma = parse(gemma);
    let kinds = gemma.layer_kinds().unwrap();
    assert_eq!(
        kinds.iter().filter(|k| **k == LayerKind::Sliding).count(),
        5
    );
    assert_eq!(gemma.layer_window(LayerKind::Sliding), Some(4096));
    let mut qwen = base("qwen3");
    qwen["use_sliding_window"] = serde_json::json!(true);
    qwen["num_hidden_layers"] = serde_json::json!(30);
    let kinds = parse(qwen).layer_kinds().unwrap();
    // max_window_layers defaults to 28: layers 28 and 29 slide.
    assert_eq!(
        kinds.iter().position(|k| *k == LayerKind::Sliding),
        Some(28)
    );
    assert_eq!(parse(base("llama")).sliding_window(), None);
    assert_eq!(parse(base("phi3")).sliding_window(), None);
    // A saved model keeps an explicit null (absent would read back as a 4096 window).
    let mut v = base("mistral");
    v["sliding_window"] = serde_json::Value::Null;
    let cfg = parse(v);
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("src-tokenizer.json");
    std::fs::write(&tok, "{}").unwrap();
    let out = dir.path().join("saved");
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params(&cfg), &tok).unwrap();
    let back = xdistill_shared::hf::ModelDir::open(&out).unwrap().config;
    assert_eq!(back.sliding_window(), None);
    assert_eq!(back.window.sliding_window, Some(None));
}

/// The Qwen3-MoE test model (experts on layers 0 and 2, a dense MLP on layer 1) written as a
/// model directory, with `edit` applied to its config.json.
fn moe_dir(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let (_, cfg) = arch_configs()
        .into_iter()
        .find(|(a, _)| *a == "qwen3_moe")
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("src-tokenizer.json");
    std::fs::write(&tok, "{}").unwrap();
    let out = dir.path().join("m");
    xdistill_shared::hf::write_model_dir(&out, &cfg, &params(&cfg), &tok).unwrap();
    let p = out.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    dir
}

/// transformers ≤ 5.23 writes the expert count as `num_experts`, 5.24 and later as
/// `num_local_experts`: a directory with either (or both, equal) opens as the same MoE model and
/// scores the same; written back, it keeps its key. Both keys set and disagreeing are refused,
/// naming both.
#[test]
fn either_expert_count_key_loads_as_moe() {
    let rename = |m: &mut serde_json::Map<String, serde_json::Value>| {
        let n = m.remove("num_experts").unwrap();
        m.insert("num_local_experts".into(), n);
    };
    let old = moe_dir(|m| assert_eq!(m["num_experts"], 4));
    let new = moe_dir(rename);
    let both = moe_dir(|m| {
        m.insert("num_local_experts".into(), serde_json::json!(4));
    });
    let mut logits = Vec::new();
    for (dir, key) in [
        (&old, "num_experts"),
        (&new, "num_local_experts"),
        (&both, "num_local_experts"),
    ] {
        let md = xdistill_shared::hf::ModelDir::open(dir.path().join("m")).unwrap();
        let c = &md.config;
        assert_eq!((c.moe.experts(), c.moe.experts_key()), (4, key));
        assert_eq!(
            (0..3).map(|l| c.is_moe_layer(l)).collect::<Vec<_>>(),
            [true, false, true]
        );
        assert!(param_specs(c, 0.0)
            .iter()
            .any(|s| s.name == "model.layers.2.mlp.experts.3.down_proj.weight"));
        // SAFETY: written by this test, not modified while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &dev()) }
            .unwrap();
        logits.push(
            Decoder::new(c, vb, Ops::Fused)
                .unwrap()
                .forward(&ids(&SEQ))
                .unwrap(),
        );
    }
    assert_eq!(max_abs_diff(&logits[0], &logits[1]), 0.0);
    assert_eq!(max_abs_diff(&logits[0], &logits[2]), 0.0);
    // Saved again, a 5.24 config keeps its key (and gains no other).
    let md = xdistill_shared::hf::ModelDir::open(new.path().join("m")).unwrap();
    let cfg = serde_json::to_value(&md.config).unwrap();
    assert_eq!(cfg["num_local_experts"], 4);
    assert!(cfg.get("num_experts").is_none(), "{cfg}");
    // Disagreeing keys: refused by validate, naming both.
    let bad = moe_dir(|m| {
        m.insert("num_local_experts".into(), serde_json::json!(8));
    });
    let e = xdistill_shared::hf::ModelDir::open(bad.path().join("m"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("num_experts (4) and num_local_experts (8) disagree"),
        "{e}"
    );
}

/// Where config.json and the safetensors headers disagree about the experts, opening the
/// directory (before any weight is loaded) says so by config key and tensor name.
#[test]
fn config_and_weights_disagreeing_on_experts_are_refused_by_name() {
    use xdistill_shared::hf::{HfError, ModelDir};
    let open_err = |dir: &tempfile::TempDir| -> String {
        let e = ModelDir::open(dir.path().join("m")).unwrap_err();
        assert!(matches!(e, HfError::ConfigVsWeights { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("config.json: "), "the file is named: {e}");
        e
    };
    // 1. The expert count lost (a key name this reader did not know): dense MLPs would be built.
    let e = open_err(&moe_dir(|m| {
        m.remove("num_experts");
    }));
    for needle in [
        "neither `num_experts` nor `num_local_experts`",
        "model.layers.0.mlp.experts.*",
        "e.g. model.layers.0.mlp.experts.0.down_proj.weight",
        "number of experts (4 in the weights)",
    ] {
        assert!(e.contains(needle), "{needle:?} in {e}");
    }
    // 2. A dense model_type over MoE weights.
    let e = open_err(&moe_dir(|m| {
        m.insert("model_type".into(), serde_json::json!("qwen3"));
    }));
    assert!(
        e.contains("model_type \"qwen3\" has dense MLPs") && e.contains("mlp.experts."),
        "{e}"
    );
    // 3. Layer 1 is dense in the weights; the config makes it MoE.
    let e = open_err(&moe_dir(|m| {
        m.insert("mlp_only_layers".into(), serde_json::json!([]));
    }));
    assert!(
        e.contains("`num_experts` = 4 (with `mlp_only_layers` = [], `decoder_sparse_step` = 1)")
            && e.contains("makes layer 1 a mixture-of-experts layer")
            && e.contains("e.g. model.layers.1.mlp.down_proj.weight")
            && e.contains("no model.layers.1.mlp.experts.* tensor"),
        "{e}"
    );
    // 4. Layer 2 holds experts in the weights; the config makes it dense.
    let e = open_err(&moe_dir(|m| {
        m.insert("mlp_only_layers".into(), serde_json::json!([1, 2]));
    }));
    assert!(
        e.contains("`mlp_only_layers` = [1, 2], `decoder_sparse_step` = 1 make layer 2 a dense")
            && e.contains("model.layers.2.mlp.experts.*"),
        "{e}"
    );
    // 5. The count: 8 said, 4 held (`num_experts_per_tok` stays valid).
    let e = open_err(&moe_dir(|m| {
        m.remove("num_experts");
        m.insert("num_local_experts".into(), serde_json::json!(8));
    }));
    assert!(
        e.contains(
            "config key `num_local_experts` = 8 does not match the weights: \
             model.layers.0.mlp.experts.* hold 4 experts"
        ),
        "{e}"
    );
}

/// The same checks read transformers 5's fused expert tensors (`mlp.experts.gate_up_proj`
/// `[E, 2I, H]`): the count comes from their first dimension.
#[test]
fn fused_expert_tensors_are_counted_from_their_shape() {
    use xdistill_shared::hf::check_experts;
    let (_, cfg) = arch_configs()
        .into_iter()
        .find(|(a, _)| *a == "qwen3_moe")
        .unwrap();
    let mut names: Vec<(String, Vec<usize>)> = Vec::new();
    for l in [0, 2] {
        let pre = format!("model.layers.{l}.mlp");
        names.push((format!("{pre}.gate.weight"), vec![4, 16]));
        names.push((format!("{pre}.experts.gate_up_proj"), vec![4, 16, 16]));
        names.push((format!("{pre}.experts.down_proj"), vec![4, 16, 8]));
    }
    names.push(("model.layers.1.mlp.gate_proj.weight".into(), vec![24, 16]));
    let p = std::path::Path::new("m/config.json");
    check_experts(&cfg, p, &names).unwrap();
    let mut six = cfg.clone();
    six.moe.num_experts = Some(6);
    let e = check_experts(&six, p, &names).unwrap_err().to_string();
    assert!(
        e.contains("`num_experts` = 6 does not match the weights") && e.contains("hold 4 experts"),
        "{e}"
    );
    let mut none = cfg.clone();
    none.moe.num_experts = None;
    let e = check_experts(&none, p, &names).unwrap_err().to_string();
    assert!(
        e.starts_with("m/config.json: ")
            && e.contains("e.g. model.layers.0.mlp.experts.down_proj")
            && e.contains("(4 in the weights)"),
        "{e}"
    );
}

/// The LM head at inference on f32 host tensors, 32 rows or more: every logit is
/// `matmul::dot_blocked`'s sum — the bits of the AVX-512 head kernel, at every SIMD level (issue
/// 49: candle's gemm lost 2.6× more against f64 there) — in whole rows and in column tiles;
/// fewer rows, and the differentiable ops, keep candle's matmul.
#[test]
fn lm_head_sums_in_blocks_at_inference() {
    if !dev().is_cpu() {
        return;
    }
    let cfg = config("llama");
    let (fused, diff) = (model(&cfg, Ops::Fused), model(&cfg, Ops::Differentiable));
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let head: Vec<f32> = fused.lm_head().flatten_all().unwrap().to_vec1().unwrap();
    let fma = xdistill_cpu_kernels::simd::Simd::current() >= xdistill_cpu_kernels::simd::Simd::Avx2;
    for rows in [40usize, 5] {
        let x: Vec<f32> = (0..rows * h)
            .map(|i| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * 3.0)
            .collect();
        let hidden = Tensor::from_vec(x.clone(), (rows, h), &dev()).unwrap();
        let candle = hidden
            .matmul(&fused.lm_head().t().unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let logits: Vec<Vec<f32>> = fused.logits(&hidden).unwrap().to_vec2().unwrap();
        assert_eq!(
            diff.logits(&hidden).unwrap().to_vec2::<f32>().unwrap(),
            candle
        );
        if rows < xdistill_cpu_kernels::matmul::NP {
            assert_eq!(logits, candle, "{rows} rows: candle's matmul");
            continue;
        }
        for r in 0..rows {
            for c in 0..v {
                let dot = xdistill_cpu_kernels::matmul::dot_blocked(
                    &head[c * h..(c + 1) * h],
                    &x[r * h..(r + 1) * h],
                    fma,
                );
                assert_eq!(logits[r][c].to_bits(), dot.to_bits(), "row {r} col {c}");
            }
        }
        let tile: Vec<Vec<f32>> = fused
            .logits_cols(&hidden, 7..19)
            .unwrap()
            .to_vec2()
            .unwrap();
        for r in 0..rows {
            assert_eq!(
                tile[r],
                logits[r][7..19],
                "row {r}: a tile is the logits' columns"
            );
        }
    }
}

/// The op-by-op trace of `model::precision` is the forward it measures: with every op in f32
/// the f32 decoder's forward bit for bit (fused ops and candle's), with every op in f64 the f64
/// decoder's; each kind of op in f32 alone moves the logits by f32 rounding only; an
/// architecture it does not follow is refused.
#[test]
fn precision_trace_is_the_forward() {
    use xdistill_shared::model::precision::{OpKind, ScoreErrors, Trace};
    if !dev().is_cpu() {
        return;
    }
    // 2 × 20 = 40 rows: the linear layers and the head take the blocked kernel.
    let ids: Vec<u32> = (0..40u32).map(|i| i * 7 % 50).collect();
    let ids = Tensor::from_vec(ids, (2, 20), &dev()).unwrap();
    for arch in ["llama", "qwen3"] {
        let cfg = config(arch);
        let p64: HashMap<String, Tensor> = params(&cfg)
            .into_iter()
            .map(|(k, t)| (k, t.to_dtype(DType::F64).unwrap()))
            .collect();
        let vb = VarBuilder::from_tensors(p64, DType::F64, &dev());
        let exact = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
        let direct = exact.forward(&ids).unwrap();
        for ops in [Ops::Fused, Ops::Differentiable] {
            let f32_model = model(&cfg, ops);
            let trace = Trace::new(&exact, &f32_model).unwrap();
            trace.check(&ids).unwrap();
            let all64 = trace.logits(&ids, &|_| false).unwrap();
            let d = (&all64 - &direct)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert_eq!(
                d.to_scalar::<f64>().unwrap(),
                0.0,
                "{arch} {ops:?}: f64 trace"
            );
            for kind in OpKind::ALL {
                let one = trace.logits(&ids, &|k| k == kind).unwrap();
                let e = ScoreErrors::of(&one, &all64, &ids, 5).unwrap().worst();
                assert!(e < 1e-5, "{arch} {ops:?} {}: {e}", kind.name());
            }
        }
    }
    let (_, gemma) = arch_configs()
        .into_iter()
        .find(|(a, _)| *a == "gemma3")
        .unwrap();
    let p64: HashMap<String, Tensor> = params(&gemma)
        .into_iter()
        .map(|(k, t)| (k, t.to_dtype(DType::F64).unwrap()))
        .collect();
    let vb = VarBuilder::from_tensors(p64, DType::F64, &dev());
    let exact = Decoder::new(&gemma, vb, Ops::Differentiable).unwrap();
    assert!(Trace::new(&exact, &model(&gemma, Ops::Fused)).is_err());
}

/// The packed forward (the teacher's batch-invariant mode without a forward per sequence): a
/// sequence's rows are the same bits whatever it is packed with and wherever it lands (alone,
/// first, between others, with matmul blocks of 16 and of 64 rows, so that the sequences
/// straddle blocks and the last block is padded), for every architecture that packs; and they
/// are its own forward's rows: on the CPU bit for bit where both run the same row kernel (32
/// rows or more, `matmul::NP`), within rounding elsewhere and on a GPU (whose matmul kernels
/// differ between a sequence's own shape and the fixed blocks).
#[test]
fn packed_rows_do_not_depend_on_their_neighbours() {
    use xdistill_shared::model::PackedSeq;
    let seqs: Vec<Vec<u32>> = [40usize, 5, 33, 1, 64]
        .iter()
        .enumerate()
        .map(|(s, &n)| (0..n).map(|i| ((i * 7 + s * 13 + 3) % 50) as u32).collect())
        .collect();
    let host = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
    for (arch, cfg) in arch_configs() {
        let m = model(&cfg, Ops::Fused);
        if arch == "qwen3_moe" {
            assert!(!m.packs(), "sparse MoE does not pack");
            continue;
        }
        assert!(m.packs(), "{arch}");
        let h = cfg.hidden_size;
        for rows in [16usize, 64] {
            // Each sequence's rows in a packing of `order` (indices into `seqs`).
            let packed = |order: &[usize]| -> Vec<Vec<f32>> {
                let ps: Vec<PackedSeq> = order
                    .iter()
                    .map(|&i| PackedSeq {
                        ids: &seqs[i],
                        total: seqs[i].len(),
                    })
                    .collect();
                let out = host(&m.forward_packed(&ps, rows).unwrap());
                let mut at = 0;
                let mut by_seq = vec![Vec::new(); seqs.len()];
                for &i in order {
                    let n = seqs[i].len() * h;
                    by_seq[i] = out[at..at + n].to_vec();
                    at += n;
                }
                assert_eq!(at, out.len());
                by_seq
            };
            let mixed = packed(&[1, 0, 2, 3, 4]);
            let reordered = packed(&[4, 3, 2, 0, 1]);
            for (i, s) in seqs.iter().enumerate() {
                let alone = packed(&[i]);
                let what = format!(
                    "{arch}, blocks of {rows}, sequence {i} ({} tokens)",
                    s.len()
                );
                assert_eq!(alone[i], mixed[i], "{what}: alone vs mixed");
                assert_eq!(alone[i], reordered[i], "{what}: alone vs reordered");
                let mut cache = KvCache::for_sequence(s.len());
                let own = host(
                    &m.forward_hidden(&ids(s), Some(&mut cache), None, None)
                        .unwrap(),
                );
                // The CPU's row kernel runs for 32 rows or more: both sides then take it.
                if dev().is_cpu() && s.len() >= 32 && rows >= 32 {
                    assert_eq!(alone[i], own, "{what}: its own forward's bits");
                } else {
                    let d = alone[i]
                        .iter()
                        .zip(&own)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(d < 1e-4, "{what}: {d} from its own forward");
                }
            }
        }
    }
}
