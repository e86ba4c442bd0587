//! Checkpoint round trips, corruption fallback, crash safety, resume and retention.

use super::*;
use crate::data::DataPosition;
use candle_core::{DType, Device, Tensor};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use xdistill_shared::hf::ModelConfig;

fn tiny_config() -> ModelConfig {
    serde_json::from_str(
        r#"{"model_type":"qwen3","vocab_size":16,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":4}"#,
    )
    .unwrap()
}

fn tensors(seed: u64) -> HashMap<String, Tensor> {
    // Random bit patterns (including values that print identically but differ in the last
    // bit) so that any lossy conversion would show.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut f = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| f32::from_bits((rng.next_u32() & 0x3fff_ffff) | 0x3000_0000))
            .collect()
    };
    let dev = Device::Cpu;
    // Every parameter of the config (so that the saved step opens as a model directory), the
    // final norm in BF16.
    let mut m = HashMap::new();
    for spec in xdistill_shared::model::param_specs(&tiny_config(), 0.0) {
        let n = spec.shape.iter().product();
        let mut t = Tensor::from_vec(f(n), spec.shape, &dev).unwrap();
        if spec.name == "model.norm.weight" {
            t = t.to_dtype(DType::BF16).unwrap();
        }
        m.insert(spec.name, t);
    }
    m
}

fn bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::BF16 => t
            .flatten_all()
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        _ => t
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
    }
}

fn assert_same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) {
    assert_eq!(a.len(), b.len());
    for (k, t) in a {
        let u = &b[k];
        assert_eq!(t.dtype(), u.dtype(), "{k}");
        assert_eq!(t.dims(), u.dims(), "{k}");
        assert_eq!(bits(t), bits(u), "{k}");
    }
}

fn tokenizer_file(dir: &Path) -> PathBuf {
    let p = dir.join("tok").join("tokenizer.json");
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, b"{\"not\": \"a real tokenizer\"}").unwrap();
    p
}

fn state(step: u64) -> TrainerState {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for _ in 0..step {
        rng.next_u64();
    }
    TrainerState::new(
        step,
        DataPosition {
            epoch: 1,
            index: 3 * step as usize,
        },
        &rng,
        "h".into(),
    )
}

fn save_step(out: &Path, tok: &Path, step: u64, metric: Option<f64>) -> PathBuf {
    let mut st = state(step);
    if let Some(v) = metric {
        st.metrics.insert("val_loss".into(), v);
    }
    save(
        out,
        &CheckpointData {
            model: &tensors(step),
            model_config: &tiny_config(),
            tokenizer_json: tok,
            optimizer: &tensors(step + 100),
            state: &st,
        },
    )
    .unwrap()
}

#[test]
fn round_trip_is_bit_exact_and_loadable_as_a_model_dir() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_file(dir.path());
    let out = dir.path().join("out");
    let p = save_step(&out, &tok, 7, Some(1.5));
    assert_eq!(p, out.join("step_7"));
    let ck = load(&p, &Device::Cpu).unwrap();
    assert_same(&ck.model, &tensors(7));
    assert_same(&ck.optimizer, &tensors(107));
    let mut expect = state(7);
    expect.metrics.insert("val_loss".into(), 1.5);
    assert_eq!(ck.state, expect);
    assert_eq!(ck.model_config.hidden_size, 8);
    // The directory is a Hugging Face model directory the teacher can open.
    let md = xdistill_shared::hf::ModelDir::open(&p).unwrap();
    assert_eq!(md.weights, vec![p.join(MODEL_FILE)]);
    // Saving the same step again replaces it.
    save_step(&out, &tok, 7, Some(1.0));
    assert_eq!(read_state(&p).unwrap().metrics["val_loss"], 1.0);
    assert_eq!(list(&out).unwrap().len(), 1);
}

#[test]
fn corrupt_newest_checkpoint_falls_back_to_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_file(dir.path());
    let out = dir.path().join("out");
    save_step(&out, &tok, 2, None);
    let p4 = save_step(&out, &tok, 4, None);
    // Every file is in the manifest, which verifies.
    let manifest = std::fs::read_to_string(p4.join(CHECKSUM_FILE)).unwrap();
    for f in [
        MODEL_FILE,
        OPTIMIZER_FILE,
        STATE_FILE,
        "config.json",
        "tokenizer.json",
    ] {
        assert!(manifest.contains(&format!("  {f}\n")), "{manifest}");
    }
    assert!(verify(&p4).unwrap());
    // One flipped bit in the last tensor byte of the newest checkpoint.
    let mut bytes = std::fs::read(p4.join(MODEL_FILE)).unwrap();
    *bytes.last_mut().unwrap() ^= 0x01;
    std::fs::write(p4.join(MODEL_FILE), &bytes).unwrap();
    let e = verify(&p4).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("SHA-256"),
        "{e}"
    );
    let ck = load_newest_valid(&out, &Device::Cpu).unwrap().unwrap();
    assert_eq!(ck.state.step, 2);
    assert_same(&ck.model, &tensors(2));
    // The corrupt one is set aside, so it is neither resumed nor counted by pruning.
    assert!(out.join("step_4.corrupt").is_dir());
    assert_eq!(list(&out).unwrap(), vec![(2, out.join("step_2"))]);
    // A checkpoint without a manifest (an older trainer's) still loads, unverified.
    std::fs::remove_file(out.join("step_2").join(CHECKSUM_FILE)).unwrap();
    assert!(!verify(&out.join("step_2")).unwrap());
    assert_eq!(
        load_newest_valid(&out, &Device::Cpu)
            .unwrap()
            .unwrap()
            .state
            .step,
        2
    );
    // When every checkpoint is corrupt, resuming is an error.
    std::fs::write(out.join("step_2").join(MODEL_FILE), b"garbage").unwrap();
    assert!(load_newest_valid(&out, &Device::Cpu).is_err());
}

#[test]
fn non_finite_weights_make_a_checkpoint_unusable() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_file(dir.path());
    let out = dir.path().join("out");
    save_step(&out, &tok, 1, None);
    let mut model = tensors(3);
    model.insert(
        "model.embed_tokens.weight".into(),
        Tensor::from_vec(vec![f32::NAN; 16 * 8], (16, 8), &Device::Cpu).unwrap(),
    );
    save(
        &out,
        &CheckpointData {
            model: &model,
            model_config: &tiny_config(),
            tokenizer_json: &tok,
            optimizer: &HashMap::new(),
            state: &state(3),
        },
    )
    .unwrap();
    assert_eq!(
        load_newest_valid(&out, &Device::Cpu)
            .unwrap()
            .unwrap()
            .state
            .step,
        1
    );
}

#[test]
fn rng_state_restores_the_exact_stream() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    rng.set_stream(3);
    for _ in 0..13 {
        rng.next_u32(); // odd count: mid-block position
    }
    let saved: RngState =
        serde_json::from_str(&serde_json::to_string(&RngState::capture(&rng)).unwrap()).unwrap();
    let mut back = saved.restore().unwrap();
    let a: Vec<u64> = (0..40).map(|_| rng.next_u64()).collect();
    let b: Vec<u64> = (0..40).map(|_| back.next_u64()).collect();
    assert_eq!(a, b);
    let bad = RngState {
        seed: "00".into(),
        ..saved
    };
    assert!(bad.restore().is_err());
}

#[test]
fn interrupted_saves_are_invisible() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_file(dir.path());
    let out = dir.path().join("out");
    assert_eq!(latest(&out).unwrap(), None);
    save_step(&out, &tok, 2, None);
    // A crash mid-write leaves a hidden temp dir with a partial checkpoint of a later step.
    let crashed = out.join(".step_4.tmp-999-1");
    std::fs::create_dir_all(&crashed).unwrap();
    std::fs::write(crashed.join(MODEL_FILE), b"partial").unwrap();
    // And a step directory without its state file (e.g. copied by hand, incompletely).
    std::fs::create_dir_all(out.join("step_9")).unwrap();
    assert_eq!(latest(&out).unwrap(), Some((2, out.join("step_2"))));
    // A save that fails midway (the tokenizer is missing) leaves nothing behind.
    let err = save(
        &out,
        &CheckpointData {
            model: &tensors(3),
            model_config: &tiny_config(),
            tokenizer_json: &dir.path().join("missing.json"),
            optimizer: &HashMap::new(),
            state: &state(3),
        },
    );
    assert!(err.is_err());
    assert!(!out.join("step_3").exists());
    assert_eq!(latest(&out).unwrap(), Some((2, out.join("step_2"))));
    assert_eq!(remove_temp_dirs(&out).unwrap(), 1);
    assert!(!crashed.exists());
}

/// The pieces a resume needs (data position, RNG, tensors) compose: a toy run whose update
/// depends on the batch text and on RNG draws, interrupted after step 3 and resumed from
/// its checkpoint, ends bit-identical to the uninterrupted run.
#[test]
fn toy_run_resumed_from_a_checkpoint_matches_an_uninterrupted_one() {
    use crate::data::{BatchOptions, Batcher, Content, Record};
    let records: Vec<Record> = (0..7)
        .map(|i| Record {
            line: i + 1,
            content: Content::Text {
                text: format!("record number {i}"),
            },
            completion_only_loss: false,
            teacher: None,
        })
        .collect();
    let opts = BatchOptions {
        batch_size: 2,
        seed: 3,
        shuffle: true,
        drop_last: false,
        max_epochs: 3,
    };
    // One "step": w ← 0.9·w + (bytes of the batch) · noise, momentum m ← 0.5·m + w.
    let step = |w: &mut Vec<f32>, m: &mut Vec<f32>, texts: &[String], rng: &mut ChaCha8Rng| {
        let bytes: f32 = texts.iter().map(|t| t.len() as f32).sum();
        for (wi, mi) in w.iter_mut().zip(m.iter_mut()) {
            let noise = (rng.next_u32() % 1000) as f32 / 1000.0;
            *wi = 0.9 * *wi + bytes * noise * 1e-3;
            *mi = 0.5 * *mi + *wi;
        }
    };
    let run = |from: Option<&Path>, stop_after: usize, out: &Path| -> (Vec<f32>, Vec<f32>) {
        let dev = Device::Cpu;
        let (mut w, mut m, mut rng, mut batcher, mut n) = match from {
            None => {
                let mut rng = ChaCha8Rng::seed_from_u64(3);
                rng.set_stream(1);
                (
                    vec![0.1f32; 4],
                    vec![0f32; 4],
                    rng,
                    Batcher::new(records.clone(), opts),
                    0,
                )
            }
            Some(dir) => {
                let ck = load(dir, &dev).unwrap();
                let mut b = Batcher::new(records.clone(), opts);
                b.seek(ck.state.data).unwrap();
                (
                    ck.model["w"].to_vec1::<f32>().unwrap(),
                    ck.optimizer["m"].to_vec1::<f32>().unwrap(),
                    ck.state.rng.restore().unwrap(),
                    b,
                    ck.state.step as usize,
                )
            }
        };
        let tok = tokenizer_file(out);
        for batch in batcher.by_ref() {
            let texts: Vec<String> = batch.records.iter().map(Record::text).collect();
            step(&mut w, &mut m, &texts, &mut rng);
            n += 1;
            let st = TrainerState::new(n as u64, batch.next, &rng, "h".into());
            save(
                out,
                &CheckpointData {
                    model: &[("w".to_string(), Tensor::new(w.as_slice(), &dev).unwrap())].into(),
                    model_config: &tiny_config(),
                    tokenizer_json: &tok,
                    optimizer: &[("m".to_string(), Tensor::new(m.as_slice(), &dev).unwrap())]
                        .into(),
                    state: &st,
                },
            )
            .unwrap();
            if n == stop_after {
                break;
            }
        }
        (w, m)
    };
    let dir = tempfile::tempdir().unwrap();
    let full = run(None, usize::MAX, &dir.path().join("a"));
    let out = dir.path().join("b");
    run(None, 3, &out);
    let (_, ck) = latest(&out).unwrap().unwrap();
    assert_eq!(ck, out.join("step_3"));
    let resumed = run(Some(&ck), usize::MAX, &out);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&resumed.0), bits(&full.0));
    assert_eq!(bits(&resumed.1), bits(&full.1));
    // 7 records in batches of 2: 4 steps per epoch, 3 epochs.
    assert_eq!(latest(&out).unwrap().unwrap().0, 12);
}

#[test]
fn retention_keeps_the_newest_and_the_best() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_file(dir.path());
    let out = dir.path().join("out");
    let vals = [(1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0), (5, 4.0)];
    for (s, v) in vals {
        save_step(&out, &tok, s, Some(v));
    }
    std::fs::create_dir_all(out.join(FINAL_DIR)).unwrap();
    let steps = |out: &Path| {
        list(out)
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect::<Vec<_>>()
    };

    let ranking = Ranking::Metric {
        name: "val_loss".into(),
        higher_is_better: false,
    };
    retain(&out, 3, &ranking).unwrap();
    // Newest (5) plus the two lowest val_loss among the rest (2: 1.0, 3: 2.0).
    assert_eq!(steps(&out), [2, 3, 5]);
    retain(&out, 2, &Ranking::Newest).unwrap();
    assert_eq!(steps(&out), [3, 5]);
    retain(&out, 1, &Ranking::Newest).unwrap();
    assert_eq!(steps(&out), [5]);
    assert!(out.join(FINAL_DIR).is_dir());
}
