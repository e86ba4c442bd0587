//! `trainer demo --fast`: the whole pipeline (task, teacher SFT, teacher server, cross-tokenizer
//! student, SFT / off-policy / on-policy runs, evaluation, summary) through the real binaries,
//! on tiny models; checks the summary's shape and the sanity of its values.

use std::process::Command;

#[test]
fn fast_demo_end_to_end() {
    let trainer = xdistill_tests::trainer_binary();
    let teacher = xdistill_tests::teacher_binary();
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
            .args(["demo", "--fast", "--output"])
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
    for name in ["teacher", "student_init", "sft", "off_policy", "on_policy"] {
        assert!(stdout.contains(name), "table lacks {name}:\n{stdout}");
    }
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let steps = summary["settings"]["student_training"]["steps"]
        .as_u64()
        .unwrap();
    for name in ["teacher", "student_init", "sft", "off_policy", "on_policy"] {
        let row = &summary[name];
        for key in ["accuracy", "kl", "steps", "seconds"] {
            assert!(row[key].is_number(), "{name}.{key} missing: {row}");
        }
        let acc = row["accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc), "{name}: accuracy {acc}");
        assert!(row["kl"].as_f64().unwrap().is_finite(), "{name}: kl");
        assert!(row["seconds"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(summary["teacher"]["kl"].as_f64(), Some(0.0));
    // The common starting point is the random student after the warm-up SFT.
    assert_eq!(
        summary["student_init"]["steps"].as_u64(),
        summary["settings"]["student_warmup"]["steps"].as_u64()
    );
    assert!(
        summary["settings"]["student_warmup"]["steps"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(out.join("student_warmup/run/final/config.json").is_file());
    for name in ["sft", "off_policy", "on_policy"] {
        let row = &summary[name];
        assert_eq!(row["steps"].as_u64(), Some(steps), "{name}: same budget");
        assert!(row["seconds"].as_f64().unwrap() > 0.0, "{name}: seconds");
        // The curve starts at the initial student and ends at the final model.
        let curve = row["curve"].as_array().unwrap();
        assert!(curve.len() >= 2, "{name}: curve {curve:?}");
        assert_eq!(curve[0][0].as_u64(), Some(0));
        assert_eq!(curve[0][1], summary["student_init"]["accuracy"]);
        assert_eq!(curve.last().unwrap()[0].as_u64(), Some(steps));
        assert_eq!(curve.last().unwrap()[1], row["accuracy"]);
    }
    assert!(out.join("curves.json").is_file());
    let svg = std::fs::read_to_string(out.join("curves.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"));
    assert_eq!(summary["teacher_cached"].as_bool(), Some(false));

    // A second run reuses the cached teacher.
    run();
    let again: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(again["teacher_cached"].as_bool(), Some(true));
    assert_eq!(again["teacher"]["accuracy"], summary["teacher"]["accuracy"]);
}
