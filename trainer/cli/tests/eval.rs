//! `evaluate` and `trainer eval` / `trainer make-task` end to end on a tiny random model.

use crate::common::model_args;
use xdistill_testkit::{byte_tokenizer_json, load_tokenizer as load, tiny_decoder as tiny};
use xdistill_trainer::eval::answer::{answers_match, extract_answer};
use xdistill_trainer::eval::{evaluate, load_records, EvalConfig, EvalRecord};
use xdistill_trainer::generate::{generate_seeded, GenerationConfig};

fn prompts() -> Vec<String> {
    (0..8)
        .map(|i| format!("Q: {}+{}=?\nA:", 10 + 7 * i, 3 * i))
        .collect()
}

#[test]
fn accuracy_counts_the_right_examples() {
    let tok_path = byte_tokenizer_json();
    let tok = load(&tok_path);
    let model = tiny("qwen3", &tok_path, 256, true);
    let cfg = EvalConfig {
        max_new_tokens: 24,
        samples: 3,
        batch_size: 5,
        stop_strings: vec![],
        ..Default::default()
    };
    let texts = prompts();
    // Reference: greedy completions generated directly, answers extracted from them.
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t.as_str(), true).unwrap().get_ids().to_vec())
        .collect();
    let greedy = generate_seeded(&model, tok, &ids, &GenerationConfig::greedy(24)).unwrap();
    let predicted: Vec<Option<String>> = greedy
        .iter()
        .map(|g| extract_answer(&g.completion_text))
        .collect();
    // Gold = the model's own answer on even examples (when it has one), a wrong one on odd.
    let records: Vec<EvalRecord> = texts
        .iter()
        .zip(&predicted)
        .enumerate()
        .map(|(i, (t, p))| EvalRecord {
            prompt: t.clone(),
            answer: match (i % 2, p) {
                (0, Some(p)) => p.clone(),
                _ => "123456789".into(),
            },
        })
        .collect();
    let expected_right = predicted
        .iter()
        .enumerate()
        .filter(|(i, p)| i % 2 == 0 && p.is_some())
        .count();
    assert!(expected_right > 0, "fixture has no numeric greedy answers");

    let r = evaluate(&model, tok, &records, &cfg).unwrap();
    assert_eq!(r.n, 8);
    assert_eq!(r.greedy_accuracy, expected_right as f64 / 8.0);
    for (e, g) in r.examples.iter().zip(&greedy) {
        assert_eq!(e.greedy.completion, g.completion_text);
        assert_eq!(e.greedy.tokens, g.completion_ids.len());
        assert_eq!(e.sampled.len(), 3);
    }
    // Sampled accuracy: the mean of per-sample correctness, re-derived from the texts.
    let flags: Vec<f64> = r
        .examples
        .iter()
        .flat_map(|e| {
            e.sampled.iter().map(|s| {
                let ok = extract_answer(&s.completion).is_some_and(|p| answers_match(&p, &e.gold));
                if ok {
                    1.0
                } else {
                    0.0
                }
            })
        })
        .collect();
    let mean = flags.iter().sum::<f64>() / flags.len() as f64;
    assert!((r.sampled_accuracy.unwrap() - mean).abs() < 1e-12);
    let pass = r
        .examples
        .iter()
        .filter(|e| e.sampled.iter().any(|s| s.correct))
        .count() as f64
        / 8.0;
    assert_eq!(r.pass_at_samples, Some(pass));
    let mean_tokens = greedy.iter().map(|g| g.completion_ids.len()).sum::<usize>() as f64 / 8.0;
    assert_eq!(r.mean_completion_tokens, mean_tokens);
    let all_tokens: usize = r
        .examples
        .iter()
        .map(|e| e.greedy.tokens + e.sampled.iter().map(|s| s.tokens).sum::<usize>())
        .sum();
    assert_eq!(r.generated_tokens, all_tokens);

    // Greedy only.
    let g_only = evaluate(
        &model,
        tok,
        &records,
        &EvalConfig {
            samples: 0,
            ..cfg.clone()
        },
    )
    .unwrap();
    assert_eq!(g_only.greedy_accuracy, r.greedy_accuracy);
    assert_eq!(g_only.sampled_accuracy, None);
    assert!(g_only.examples.iter().all(|e| e.sampled.is_empty()));
}

#[test]
fn cli_make_task_then_eval() {
    let dir = tempfile::tempdir().unwrap();
    let tok_path = byte_tokenizer_json();
    // Model directory via `init-model`'s library entry.
    let mut args = model_args("qwen3", &tok_path, true);
    args.out = dir.path().join("model");
    xdistill_trainer::init_model::run(args).unwrap();

    let bin = env!("CARGO_BIN_EXE_trainer");
    let task = dir.path().join("task");
    let st = std::process::Command::new(bin)
        .args(["make-task", "--train", "30", "--test", "6", "--digits", "2"])
        .args(["--ops", "add,sub", "--seed", "5", "--out"])
        .arg(&task)
        .status()
        .unwrap();
    assert!(st.success());
    let test = load_records(&task.join("test.jsonl"), None).unwrap();
    assert_eq!(test.len(), 6);
    assert_eq!(
        load_records(&task.join("train.jsonl"), None).unwrap().len(),
        30
    );

    let out = dir.path().join("examples.jsonl");
    let report = dir.path().join("report.json");
    let o = std::process::Command::new(bin)
        .arg("eval")
        .arg("--model")
        .arg(dir.path().join("model"))
        .arg("--prompts")
        .arg(task.join("test.jsonl"))
        .args([
            "--limit",
            "4",
            "--max-new-tokens",
            "6",
            "--samples",
            "2",
            "--quiet",
        ])
        .args(["--stop", r"\n"])
        .arg("--output")
        .arg(&out)
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("greedy accuracy"), "{stdout}");
    assert!(stdout.contains("sampled accuracy"), "{stdout}");
    let lines = std::fs::read_to_string(&out).unwrap();
    assert_eq!(lines.lines().count(), 4);
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(rep["n"], 4);
    assert_eq!(rep["samples"], 2);

    // A bad prompts file is a clear error, not a panic.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": 3}\n").unwrap();
    let o = std::process::Command::new(bin)
        .arg("eval")
        .arg("--model")
        .arg(dir.path().join("model"))
        .arg("--prompts")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bad.jsonl:1"), "{err}");
}
