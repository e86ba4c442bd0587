//! `trainer sft`: held-out cross-entropy falls on the synthetic task, `--resume` is exact, and the
//! loss covers exactly the completion (and the appended EOS).

use candle_core::{DType, Device};
use std::path::{Path, PathBuf};
use xdistill_testkit::models::model_weights as weights;
use xdistill_trainer::config::{CommonArgs, Config};
use xdistill_trainer::data::{Content, Record};
use xdistill_trainer::train::sft::{encode_record, sft_loss, train, SftArgs, Summary, TaskEval};

fn model(dir: &Path, name: &str, arch: &str, tokenizer: &str, seed: u64) -> PathBuf {
    let out = dir.join(name);
    xdistill_trainer::init_model::run(xdistill_trainer::init_model::Args {
        arch: arch.into(),
        tokenizer: xdistill_testkit::tokenizer_json(tokenizer),
        hidden_size: 32,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 64,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 256,
        tie_embeddings: true,
        init_std: 0.02,
        seed,
        out: out.clone(),
        features: Default::default(),
    })
    .expect("init-model");
    out
}

/// The synthetic task's train and test files in `dir`.
fn task(dir: &Path, train: usize) -> PathBuf {
    let cfg = xdistill_demo::task::TaskConfig {
        train,
        test: 16,
        ..Default::default()
    };
    let splits = xdistill_demo::task::make_splits(&cfg).unwrap();
    let out = dir.join("task");
    xdistill_demo::task::write_splits(&out, &cfg, &splits).unwrap();
    out
}

fn config(dir: &Path, student: &Path, data: &Path, out: &Path, steps: u64) -> Config {
    let text = format!(
        r#"
[policy]
model_name = "{student}"
max_total_sequence_length = 96
train_micro_batch_size = 3
[policy.optimizer]
lr = 1e-2
min_lr = 1e-3
weight_decay = 0.0
warmup_steps = 2
[data]
train_path = "{data}"
prompt_field = "prompt"
completion_field = "completion"
val_count = 16
[distillation]
num_prompts_per_step = 8
max_num_steps = {steps}
max_num_epochs = 50
seed = 3
val_at_start = true
val_at_end = true
[checkpointing]
checkpoint_dir = "{out}"
save_period = 2
[logger]
progress_bar = false
"#,
        student = student.display(),
        data = data.display(),
        out = out.display(),
    );
    let path = dir.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&path, text).unwrap();
    SftArgs {
        common: CommonArgs::with_config(path),
        ..Default::default()
    }
    .load_config()
    .expect("config")
}

#[test]
fn held_out_ce_falls_and_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let student = model(dir.path(), "student", "llama", "llama2", 7);
    let data = task(dir.path(), 200).join("train.jsonl");

    // 1. Thirty steps bring held-out CE (completion + EOS) well below its start (ln V ≈ 10.4),
    //    and task accuracy is evaluated and logged.
    let out = dir.path().join("run");
    let eval = TaskEval {
        records: xdistill_trainer::eval::load_records(
            &dir.path().join("task").join("test.jsonl"),
            Some(4),
        )
        .unwrap(),
        period: 15,
        config: xdistill_trainer::eval::EvalConfig {
            max_new_tokens: 4,
            samples: 0,
            ..Default::default()
        },
    };
    let s: Summary = train(
        &config(dir.path(), &student, &data, &out, 30),
        Some(&eval),
        false,
        None,
    )
    .unwrap();
    let (ce0, ce1) = (s.val_ce_start.unwrap(), s.val_ce_end.unwrap());
    eprintln!(
        "sft: held-out CE {ce0:.3} -> {ce1:.3} in {} steps ({:.1}s)",
        s.steps, s.seconds
    );
    assert_eq!(s.steps, 30);
    assert!(
        ce0 > 8.0,
        "a random 32k-vocabulary model starts near ln V: {ce0}"
    );
    assert!(ce1 < 0.5 * ce0, "held-out CE {ce0} -> {ce1}");
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let count = |split: &str| {
        lines
            .lines()
            .filter(|l| l.contains(&format!("\"split\":\"{split}\"")))
            .count()
    };
    assert_eq!(count("train"), 30);
    assert_eq!(count("eval"), 3, "accuracy at steps 0, 15 and 30");
    assert!(s.accuracy_end.is_some_and(|a| (0.0..=1.0).contains(&a)));
    assert!(out.join("final").join("config.json").is_file());

    // 2. Interrupted after step 5 (checkpoint at 4), resumed: the same weights as a straight run,
    //    in f32 and in the GPU's mixed precision (bf16 compute copies the optimizer's updates
    //    are written into, f32 masters; restored from the checkpoint's masters on resume).
    let mut finals = Vec::new();
    // (bf16 on the CPU is slow: 4 steps, interrupted after step 3, checkpoint at 2.)
    for (precision, steps, cut_at) in [("f32", 8, 5), ("bf16", 4, 3)] {
        let with = |out: &Path| {
            let mut c = config(dir.path(), &student, &data, out, steps);
            c.policy.precision = precision.into();
            c
        };
        let straight = dir.path().join(format!("straight-{precision}"));
        let s = train(&with(&straight), None, false, None).unwrap();
        // The updates reach the forward (in bf16 through the rewritten compute copies).
        let (ce0, ce1) = (s.val_ce_start.unwrap(), s.val_ce_end.unwrap());
        eprintln!("sft {precision}: held-out CE {ce0:.3} -> {ce1:.3} in {steps} steps");
        assert!(ce1 < ce0 - 0.5, "{precision}: held-out CE {ce0} -> {ce1}");
        let resumed = dir.path().join(format!("resumed-{precision}"));
        let cut = train(&with(&resumed), None, false, Some(cut_at)).unwrap();
        assert_eq!(cut.steps, cut_at);
        assert!(!resumed.join("final").exists());
        let done = train(&with(&resumed), None, true, None).unwrap();
        assert_eq!(done.steps, steps);
        let (a, b) = (
            weights(&straight.join("final")),
            weights(&resumed.join("final")),
        );
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(va == vb, "{precision}: {na} differs after resume");
        }
        finals.push(a);
    }
    // The bf16 run computed in bf16: its weights are not the f32 run's.
    assert!(
        finals[0]
            .iter()
            .zip(&finals[1])
            .any(|((_, a), (_, b))| a != b),
        "the bf16 run trained the same weights as the f32 run"
    );
}

/// Mean NLL in f64 from the full logits `[T, V]` of one sequence over the given target positions.
fn naive_nll(logits: &[Vec<f32>], ids: &[u32], positions: &[usize]) -> f64 {
    let mut s = 0.0;
    for &p in positions {
        let row: Vec<f64> = logits[p].iter().map(|&x| x as f64).collect();
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        s += lse - row[ids[p + 1] as usize];
    }
    s / positions.len() as f64
}

#[test]
fn loss_covers_exactly_the_completion_and_eos() {
    let dir = tempfile::tempdir().unwrap();
    for (arch, tokname) in [("qwen3", "qwen3"), ("llama", "llama2")] {
        let m = model(dir.path(), tokname, arch, tokname, 11);
        let student =
            xdistill_trainer::student::Student::load(&m, &Device::Cpu, DType::F32).unwrap();
        let tok = xdistill_shared::hf::load_tokenizer(&m.join("tokenizer.json")).unwrap();
        let eos = student.config.eos_ids()[0];
        let (prompt, completion) = ("Q: 47+38=?\nA:", " 7+8=15, carry 1. 4+3+1=8. #### 85");
        let record = Record {
            line: 1,
            content: Content::Pair {
                prompt: prompt.into(),
                completion: completion.into(),
            },
            completion_only_loss: true,
            teacher: None,
        };
        let e = encode_record(&tok, &record, Some(eos), 128).unwrap();
        // Independently: the prompt's own encoding is a prefix (both tokenizers split before the
        // completion's leading space here), the completion follows, then EOS.
        let p_ids = tok.encode(prompt, true).unwrap().get_ids().to_vec();
        let full = tok
            .encode(format!("{prompt}{completion}"), true)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(&full[..p_ids.len()], &p_ids[..], "{tokname}");
        assert_eq!(e.ids[..full.len()], full[..], "{tokname}");
        assert_eq!(e.ids.last(), Some(&eos));
        assert_eq!(e.ids.len(), full.len() + 1);
        // Targets: every token after the prompt (positions p predict p + 1).
        let completion_positions: Vec<usize> = (p_ids.len() - 1..e.ids.len() - 1).collect();
        let all_positions: Vec<usize> = (0..e.ids.len() - 1).collect();

        let (loss, n) =
            sft_loss(student.model(), std::slice::from_ref(&e), 1.0, &Device::Cpu).unwrap();
        assert_eq!(n as usize, completion_positions.len());
        let got = loss.to_scalar::<f32>().unwrap() as f64 / n;
        let ids_t = candle_core::Tensor::new(e.ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits: Vec<Vec<f32>> = student
            .model()
            .forward(&ids_t)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec2()
            .unwrap();
        let want = naive_nll(&logits, &e.ids, &completion_positions);
        let everything = naive_nll(&logits, &e.ids, &all_positions);
        assert!(
            (got - want).abs() < 1e-4 * want,
            "{tokname}: sft loss {got} vs completion-only reference {want}"
        );
        assert!(
            (got - everything).abs() > 1e-3,
            "{tokname}: the reference over all positions should differ ({everything})"
        );

        // Gradients: the same as those of a plain masked CE over the full logits whose mask is
        // built from the prompt's own encoding (prompt positions contribute nothing).
        let (t, vars) = (e.ids.len(), student.named_vars());
        let mut targets = vec![0u32; t];
        let mut mask = vec![0f32; t];
        for &p in &completion_positions {
            targets[p] = e.ids[p + 1];
            mask[p] = 1.0;
        }
        let (reference, _) = xdistill_trainer::loss::cross_entropy(
            &student.model().forward(&ids_t).unwrap(),
            &candle_core::Tensor::from_vec(targets, (1, t), &Device::Cpu).unwrap(),
            &candle_core::Tensor::from_vec(mask, (1, t), &Device::Cpu).unwrap(),
            None,
        )
        .unwrap();
        let (mean_loss, _) =
            sft_loss(student.model(), std::slice::from_ref(&e), n, &Device::Cpu).unwrap();
        let (ga, gb) = (mean_loss.backward().unwrap(), reference.backward().unwrap());
        for (name, v) in &vars {
            let a: Vec<f32> = ga
                .get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let b: Vec<f32> = gb
                .get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let diff = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff <= 1e-4 * scale,
                "{tokname}: gradient of {name} differs by {diff} (scale {scale})"
            );
        }
    }
}
