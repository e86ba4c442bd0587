//! `trainer demo --fast`, both tasks.
//!
//! The pretrained task on a tiny GGUF teacher written here (a real tokenizer with ChatML turns
//! and a chat template in its metadata, as SmolLM2's file has): fetch bypassed, pruning,
//! chat-formatted data, the teacher binary serving the GGUF, SFT and distillation runs, the
//! held-out measurements and the report.
//!
//! The arithmetic task: the whole pipeline (task and its scarce-label files, teacher SFT with
//! corrected prefixes, its after-mistake measurement, teacher server, cross-tokenizer student,
//! both scenarios' warm-ups and SFT / off-policy / on-policy runs, evaluation, summary) through
//! the real binaries, on tiny models; checks the summary's shape and the sanity of its values.

use std::process::Command;

#[test]
fn fast_demo_end_to_end() {
    let trainer = xdistill_testkit::trainer_binary();
    let teacher = xdistill_testkit::teacher_binary();
    let probe = Command::new(&trainer)
        .args(["on-policy", "--help"])
        .output()
        .unwrap();
    assert!(
        probe.status.success(),
        "the demo needs `trainer on-policy` (merged from the on-policy branch)"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo");
    let run = || {
        let o = Command::new(&trainer)
            .args(["demo", "--task", "arithmetic", "--fast", "--output"])
            .arg(&out)
            .arg("--teacher-bin")
            .arg(&teacher)
            .env("CI", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success(),
            "demo failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        stdout
    };
    let stdout = run();
    for name in [
        "teacher",
        "student_init",
        "sft",
        "off_policy",
        "on_policy",
        "scarce labels",
        "all labels",
    ] {
        assert!(stdout.contains(name), "table lacks {name}:\n{stdout}");
    }
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let settings = &summary["settings"];
    let steps = settings["student_training"]["steps"].as_u64().unwrap();
    let labelled = settings["scarce"]["labelled"].as_u64().unwrap();
    let train = settings["task"]["train"].as_u64().unwrap();
    assert!(0 < labelled && labelled < train, "{labelled} of {train}");
    assert_eq!(summary["teacher"]["kl"].as_f64(), Some(0.0));
    let acc = summary["teacher"]["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc), "teacher accuracy {acc}");
    // The teacher's advice after a mistake: shares of the digits scored.
    let m = &summary["teacher_after_mistake"];
    assert!(m["digits"].as_u64().unwrap() > 0, "{m}");
    for key in ["after_mistake_top1", "clean_top1"] {
        let v = m[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&v), "{key} {v}");
    }
    let task = out.join("task");
    let lines = |name: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(task.join(name))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert_eq!(lines("labelled.jsonl").len() as u64, labelled);
    // On-policy's prompts in the scarce scenario carry no solution.
    let prompts = lines("prompts.jsonl");
    assert_eq!(prompts.len() as u64, train);
    assert!(prompts.iter().all(|p| p.as_object().unwrap().len() == 1));
    let on_cfg = std::fs::read_to_string(out.join("scarce/runs/on_policy.toml")).unwrap();
    assert!(on_cfg.contains("prompts_only = true") && on_cfg.contains("prompts.jsonl"));
    for (key, records, prompts_only) in [("scarce", labelled, true), ("control", train, false)] {
        let sc = &summary[key];
        assert_eq!(sc["labelled_records"].as_u64(), Some(records), "{key}");
        assert_eq!(sc["prompts"].as_u64(), Some(train), "{key}");
        assert_eq!(sc["prompts_only"].as_bool(), Some(prompts_only), "{key}");
        for name in ["student_init", "sft", "off_policy", "on_policy"] {
            let row = &sc[name];
            for k in ["accuracy", "kl", "steps", "seconds"] {
                assert!(row[k].is_number(), "{key}.{name}.{k} missing: {row}");
            }
            let acc = row["accuracy"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&acc), "{key}.{name}: accuracy {acc}");
            assert!(row["kl"].as_f64().unwrap().is_finite(), "{key}.{name}: kl");
            assert!(row["seconds"].as_f64().unwrap() >= 0.0);
        }
        // The common starting point is the random student after the warm-up SFT on the
        // scenario's labels.
        assert_eq!(
            sc["student_init"]["steps"].as_u64(),
            settings["student_warmup"]["steps"].as_u64()
        );
        assert!(out
            .join(key)
            .join("student_warmup/run/final/config.json")
            .is_file());
        for name in ["sft", "off_policy", "on_policy"] {
            let row = &sc[name];
            assert_eq!(
                row["steps"].as_u64(),
                Some(steps),
                "{key}.{name}: same budget"
            );
            assert!(
                row["seconds"].as_f64().unwrap() > 0.0,
                "{key}.{name}: seconds"
            );
            // The curve starts at the initial student and ends at the final model.
            let curve = row["curve"].as_array().unwrap();
            assert!(curve.len() >= 2, "{key}.{name}: curve {curve:?}");
            assert_eq!(curve[0][0].as_u64(), Some(0));
            assert_eq!(curve[0][1], sc["student_init"]["accuracy"]);
            assert_eq!(curve.last().unwrap()[0].as_u64(), Some(steps));
            assert_eq!(curve.last().unwrap()[1], row["accuracy"]);
        }
        let g = &sc["goal"];
        assert!((g["target_accuracy"].as_f64().unwrap() - 0.9 * acc).abs() < 1e-9);
        assert!(g["met"].is_boolean());
    }
    assert_eq!(summary["scarce"]["goal"]["min_ratio"].as_f64(), Some(2.0));
    let curves: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("curves.json")).unwrap()).unwrap();
    for key in ["scarce", "control"] {
        for name in ["sft", "off_policy", "on_policy"] {
            assert_eq!(
                curves[key][name], summary[key][name]["curve"],
                "curves.json {key}.{name}"
            );
        }
    }
    for name in ["curves.svg", "curves_control.svg"] {
        let svg = std::fs::read_to_string(out.join(name)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.matches("<polyline").count() == 3,
            "{name}"
        );
    }
    assert_eq!(summary["teacher_cached"].as_bool(), Some(false));

    // A second run reuses the cached teacher.
    run();
    let again: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(again["teacher_cached"].as_bool(), Some(true));
    assert_eq!(again["teacher"]["accuracy"], summary["teacher"]["accuracy"]);
}

/// A 3-layer random llama with the Qwen3 tokenizer as a GGUF file: the shape of SmolLM2's
/// (ChatML turns, `<|im_end|>` as EOS, the chat template in the metadata).
fn tiny_chat_gguf(dir: &std::path::Path) -> std::path::PathBuf {
    use candle_core::quantized::gguf_file::Value;
    use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
    let tok = xdistill_testkit::tokenizer_json("qwen3");
    let model = dir.join("teacher_dir");
    xdistill_trainer::init_model::run(xdistill_trainer::init_model::Args {
        arch: "llama".into(),
        tokenizer: tok.clone(),
        hidden_size: 32,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 64,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 512,
        tie_embeddings: true,
        init_std: 0.1,
        seed: 5,
        out: model.clone(),
        features: Default::default(),
    })
    .unwrap();
    let md = xdistill_shared::hf::ModelDir::open(&model).unwrap();
    let mut params = std::collections::HashMap::new();
    for w in &md.weights {
        params.extend(candle_core::safetensors::load(w, &candle_core::Device::Cpu).unwrap());
    }
    let tok_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&tok).unwrap()).unwrap();
    let id = |t: &str| {
        let added = tok_json["added_tokens"].as_array().unwrap();
        let a = added.iter().find(|a| a["content"] == t).unwrap();
        Value::U32(a["id"].as_u64().unwrap() as u32)
    };
    let mut meta = config_metadata("llama", &md.config);
    meta.extend(bpe_tokenizer_metadata(&tok_json, "qwen2").unwrap());
    meta.push(("tokenizer.ggml.bos_token_id".into(), id("<|im_start|>")));
    meta.push(("tokenizer.ggml.eos_token_id".into(), id("<|im_end|>")));
    meta.push((
        "tokenizer.chat_template".into(),
        Value::String(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
             message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt \
             %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
                .into(),
        ),
    ));
    let file = dir.join("teacher.gguf");
    write_gguf(
        &file,
        "llama",
        &md.config,
        &params,
        candle_core::quantized::GgmlDType::Q8_0,
        &meta,
    )
    .unwrap();
    file
}

#[test]
fn fast_pretrained_demo_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = tiny_chat_gguf(dir.path());
    let out = dir.path().join("demo");
    let o = Command::new(xdistill_testkit::trainer_binary())
        .args(["demo", "--fast", "--output"])
        .arg(&out)
        .arg("--teacher-gguf")
        .arg(&gguf)
        .arg("--teacher-bin")
        .arg(xdistill_testkit::teacher_binary())
        .env("CI", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A first run is quiet: the demo writes only records its runs keep (no skipped-record
    // warnings about data it wrote itself), and nothing else warns either.
    let stderr = String::from_utf8_lossy(&o.stderr);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("WARN")).collect();
    assert!(
        warnings.is_empty(),
        "the demo warned:\n{}",
        warnings.join("\n")
    );
    for name in ["teacher (3 layers)", "student_init", "sft", "distill"] {
        assert!(stdout.contains(name), "table lacks {name}:\n{stdout}");
    }
    let s: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let steps = s["preset"]["steps"].as_u64().unwrap();
    assert_eq!(
        s["kept_layers"],
        serde_json::json!([0]),
        "--fast keeps one layer"
    );
    let ppl = s["teacher_perplexity"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "teacher perplexity {ppl}");
    let init_kl = s["student_init"]["kl"][0][1].as_f64().unwrap();
    assert!(
        init_kl > 0.0 && init_kl.is_finite(),
        "a pruned student differs: {init_kl}"
    );
    for m in ["sft", "distill"] {
        for key in ["kl", "perplexity"] {
            let c = s[m][key].as_array().unwrap();
            assert_eq!(
                c[0], s["student_init"][key][0],
                "{m}.{key} starts at the pruned student"
            );
            assert_eq!(
                c.last().unwrap()[0].as_u64(),
                Some(steps),
                "{m}.{key} ends at the budget"
            );
            assert!(
                c.iter().all(|p| p[1].as_f64().is_some_and(f64::is_finite)),
                "{m}.{key}: {c:?}"
            );
        }
        assert!(out.join(m).join("run/final/config.json").is_file());
        assert_eq!(s[m]["answers"].as_array().unwrap().len(), 2);
    }
    // The records went through the chat template; the held-out ones are not trained on.
    let lines = |f: &str| std::fs::read_to_string(out.join("data").join(f)).unwrap();
    let (train, held) = (lines("train.jsonl"), lines("held_out.jsonl"));
    let first: serde_json::Value = serde_json::from_str(held.lines().next().unwrap()).unwrap();
    let prompt = first["prompt"].as_str().unwrap();
    assert!(
        prompt.starts_with("<|im_start|>user\n") && prompt.ends_with("<|im_start|>assistant\n")
    );
    assert!(first["completion"]
        .as_str()
        .unwrap()
        .ends_with("<|im_end|>"));
    assert!(held.lines().all(|h| !train.contains(h)));
    for f in ["curves.svg", "perplexity.svg", "answers.md"] {
        assert!(out.join(f).is_file(), "{f}");
    }
}
