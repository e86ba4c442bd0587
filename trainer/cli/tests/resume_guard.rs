//! `--resume` never restarts silently (issue 33, item 5), as `trainer sft` processes see it:
//! once every checkpoint has been set aside as corrupt, a second `--resume` stops with an error
//! naming the `.corrupt` checkpoints and `metrics.jsonl` instead of training from step 0;
//! `checkpointing.start_fresh` starts over on purpose; and a fresh run never appends to an
//! earlier run's `metrics.jsonl` (it is set aside).

use std::path::{Path, PathBuf};
use std::process::Output;

fn trainer(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_trainer"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run trainer")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The `train` lines' steps of a metrics file, in order.
fn train_steps(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["split"] == "train")
        .map(|v| v["step"].as_u64().unwrap())
        .collect()
}

/// A tiny student, a small SFT data file and a 4-step config saving every 2 steps into `out`
/// (`step_2/`, then `final/`).
fn setup(dir: &Path, out: &Path) -> PathBuf {
    let student = dir.join("student");
    xdistill_trainer::init_model::run(xdistill_trainer::init_model::Args {
        arch: "llama".into(),
        tokenizer: xdistill_testkit::tokenizer_json("llama2"),
        hidden_size: 16,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        intermediate_size: 32,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 64,
        tie_embeddings: true,
        init_std: 0.02,
        seed: 5,
        out: student.clone(),
        features: Default::default(),
    })
    .expect("init-model");
    let data = dir.join("train.jsonl");
    let lines: Vec<String> = (0..12)
        .map(|i| format!("{{\"prompt\": \"{i}+1=\", \"completion\": \"{}\"}}", i + 1))
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let cfg = dir.join("sft.toml");
    std::fs::write(
        &cfg,
        format!(
            "[policy]\nmodel_name = {:?}\nmax_total_sequence_length = 32\n\
             [data]\ntrain_path = {:?}\nprompt_field = \"prompt\"\n\
             completion_field = \"completion\"\nval_count = 0\n\
             [distillation]\nnum_prompts_per_step = 2\nmax_num_steps = 4\n\
             [checkpointing]\ncheckpoint_dir = {:?}\nsave_period = 2\n\
             [logger]\nprogress_bar = false\n",
            student.display().to_string(),
            data.display().to_string(),
            out.display().to_string()
        ),
    )
    .unwrap();
    cfg
}

/// Flips one byte inside the tensor data of `step_dir`'s weights.
fn corrupt(step_dir: &Path) {
    let p = step_dir.join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let mid = bytes.len() - 8;
    bytes[mid] ^= 0x40;
    std::fs::write(&p, &bytes).unwrap();
}

#[test]
fn resume_with_nothing_valid_never_restarts_silently() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let cfg = setup(dir.path(), &out);
    let cfg = cfg.to_str().unwrap();
    let metrics = out.join("metrics.jsonl");

    // 1. A first run: a checkpoint at step 2 and the final model, one metrics line per step.
    let o = trainer(&["sft", "--config", cfg]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(train_steps(&metrics), [1, 2, 3, 4]);

    // 2. Every checkpoint corrupt: the first --resume sets each aside and fails (as before).
    let steps: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step_"))
        .collect();
    assert!(!steps.is_empty());
    for s in &steps {
        corrupt(&out.join(s));
    }
    let o = trainer(&["sft", "--config", cfg, "--resume"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let aside: Vec<String> = steps.iter().map(|s| format!("{s}.corrupt")).collect();
    assert!(aside.iter().all(|a| out.join(a).is_dir()));

    // 3. The second --resume finds nothing valid: an error naming the traces, nothing trained,
    //    metrics.jsonl untouched.
    let before = std::fs::read(&metrics).unwrap();
    let o = trainer(&["sft", "--config", cfg, "--resume"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    for name in aside.iter().map(String::as_str).chain(["metrics.jsonl"]) {
        assert!(err.contains(name), "{name} not named: {err}");
    }
    assert!(err.contains("--start-fresh"), "{err}");
    assert!(!err.contains("starting fresh"), "{err}");
    assert_eq!(std::fs::read(&metrics).unwrap(), before);
    assert!(steps.iter().all(|s| !out.join(s).exists()));

    // 4. Starting over on purpose: trains from step 0; the old lines are set aside. The flag
    //    only makes sense with --resume.
    let o = trainer(&["sft", "--config", cfg, "--start-fresh"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
    let o = trainer(&["sft", "--config", cfg, "--resume", "--start-fresh"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(train_steps(&metrics), [1, 2, 3, 4]);
    assert_eq!(
        std::fs::read(out.join("metrics.prev-1.jsonl")).unwrap(),
        before
    );

    // 5. A fresh run (no --resume) into the same folder does not append either.
    let o = trainer(&["sft", "--config", cfg]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(train_steps(&metrics), [1, 2, 3, 4]);
    assert_eq!(train_steps(&out.join("metrics.prev-2.jsonl")), [1, 2, 3, 4]);

    // 6. --resume on an empty folder is a first start, not an error.
    let empty = dir.path().join("empty");
    let o = trainer(&[
        "sft",
        "--config",
        cfg,
        "--resume",
        "--output",
        empty.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(train_steps(&empty.join("metrics.jsonl")), [1, 2, 3, 4]);
}
