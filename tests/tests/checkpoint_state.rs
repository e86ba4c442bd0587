//! Every objective's checkpoints carry the same `TrainerState`: one loop writes them, so SFT,
//! off-policy and on-policy runs on the same data agree on the data position, and each records
//! the tokens it trained on (the sum of its metrics lines), the config hash and its validation
//! metric.

use std::path::Path;
use xdistill_demo::task::{make_splits, write_splits, TaskConfig};
use xdistill_testkit::models::{model, token_driven_teacher};
use xdistill_testkit::{teacher_binary, TeacherProcess};
use xdistill_tests::distill::config_with;
use xdistill_trainer::checkpoint::TrainerState;
use xdistill_trainer::train::{distill, off_policy, on_policy, sft};

const ON_POLICY: &str = r#"
[on_policy]
lambda = 1.0
[on_policy.generation]
max_new_tokens = 8
temperature = 1.0
stop_strings = []
"#;

fn state(dir: &Path) -> (TrainerState, serde_json::Value) {
    let text = std::fs::read_to_string(dir.join("trainer_state.json")).unwrap();
    (
        serde_json::from_str(&text).unwrap(),
        serde_json::from_str(&text).unwrap(),
    )
}

/// Σ `tokens` of the training lines of `out/metrics.jsonl` up to `step`.
fn logged_tokens(out: &Path, step: u64) -> u64 {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["split"] == "train" && v["step"].as_u64().unwrap() <= step)
        .map(|v| v["tokens"].as_u64().unwrap())
        .sum()
}

#[test]
fn every_objective_checkpoints_the_same_trainer_state() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = token_driven_teacher(dir.path(), "llama", "llama2", 1);
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 1, 0.02, 2);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]).expect("starting the teacher");
    let task = TaskConfig {
        train: 40,
        test: 4,
        seed: 1,
        ..Default::default()
    };
    write_splits(
        &dir.path().join("task"),
        &task,
        &make_splits(&task).unwrap(),
    )
    .unwrap();
    let data = dir.path().join("task/train.jsonl");
    let loss = "kd = { type = \"forward_kl\" }\ntail = \"bucket\"";
    let mut states = Vec::new();
    for name in ["sft", "off_policy", "on_policy"] {
        let out = dir.path().join(name);
        // 6 steps, a checkpoint at step 4 (save_period = 4) and the final model.
        let cfg = config_with(
            dir.path(),
            &student,
            &t.base,
            &out,
            6,
            loss,
            &data,
            "prompt",
            "completion",
            ON_POLICY,
        );
        let hash = cfg.training_hash();
        let (steps, val_metric) = match name {
            "sft" => (sft::train(&cfg, None, false, None).unwrap().steps, "val_ce"),
            "off_policy" => {
                let s = distill::setup(cfg).unwrap();
                (off_policy::train(&s, false, None).unwrap().steps, "val_kl")
            }
            _ => {
                let s = distill::setup(cfg).unwrap();
                (on_policy::train(&s, false, None).unwrap().steps, "val_kl")
            }
        };
        assert_eq!(steps, 6, "{name}");
        let (ck, ck_json) = state(&out.join("step_4"));
        let (fin, fin_json) = state(&out.join("final"));
        assert_eq!(ck.step, 4, "{name}");
        assert_eq!(fin.step, 6, "{name}");
        assert_eq!(ck.config_hash, hash, "{name}");
        assert_eq!(fin.config_hash, hash, "{name}");
        assert!(ck.tokens_seen > 0, "{name}: tokens_seen = 0 in step_4");
        assert_eq!(ck.tokens_seen, logged_tokens(&out, 4), "{name}");
        assert_eq!(fin.tokens_seen, logged_tokens(&out, 6), "{name}");
        // Validation ran at the end only (val_period = 0): its metric is in the final state.
        assert!(ck.metrics.is_empty(), "{name}: {:?}", ck.metrics);
        assert!(
            fin.metrics.contains_key(val_metric),
            "{name}: {:?}",
            fin.metrics
        );
        ck.rng.restore().unwrap();
        states.push((name, ck, ck_json, fin_json));
    }
    let keys =
        |v: &serde_json::Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    let (_, first, first_json, first_fin) = &states[0];
    for (name, ck, ck_json, fin_json) in &states[1..] {
        assert_eq!(
            keys(ck_json),
            keys(first_json),
            "{name}: trainer_state.json fields"
        );
        assert_eq!(
            keys(fin_json),
            keys(first_fin),
            "{name}: final trainer_state.json fields"
        );
        // Same data, seed and batch size: the same position after four batches.
        assert_eq!(ck.data, first.data, "{name}");
        assert_ne!(ck.data, Default::default(), "{name}");
    }
}
