//! Off-policy distillation end to end on loopback: a real `teacher` process on a tiny random
//! model, a smaller student trained by `trainer off-policy`'s loop.

use crate::full_vocab::first_kd;
use xdistill_testkit::models::{model, model_weights as weights, token_driven_teacher};
use xdistill_testkit::{teacher_binary, TeacherProcess};
use xdistill_tests::distill::config;
use xdistill_trainer::config::Config;
use xdistill_trainer::train::distill::{setup, Summary};
use xdistill_trainer::train::off_policy::train;

fn run(cfg: Config, resume: bool, stop_after: Option<u64>) -> Summary {
    let s = setup(cfg).expect("setup");
    train(&s, resume, stop_after).expect("train")
}

#[test]
fn same_tokenizer_kl_halves_and_resume_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    // A peaked, token-driven teacher and a smaller, near-uniform student on the same tokenizer.
    let teacher = token_driven_teacher(dir.path(), "llama", "llama2", 1);
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]).expect("starting the teacher");
    let loss = r#"kd = { type = "forward_kl" }
tail = "bucket""#;

    // 1. Distillation lowers held-out KL to at most half its start value.
    let out = dir.path().join("run");
    let s = run(
        config(dir.path(), &student, &t.base, &out, 40, loss),
        false,
        None,
    );
    let (kl0, kl1) = (s.val_kl_start.unwrap(), s.val_kl_end.unwrap());
    eprintln!(
        "same tokenizer: held-out KL {kl0:.4} -> {kl1:.4} in {} steps ({:.1}s)",
        s.steps, s.seconds
    );
    assert_eq!(s.steps, 40);
    assert!(kl1 <= 0.5 * kl0, "held-out KL {kl0} -> {kl1}");
    // metrics.jsonl has a line per step plus validation lines.
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        lines
            .lines()
            .filter(|l| l.contains("\"split\":\"train\""))
            .count(),
        40
    );

    // 2. Interrupted after step 6 (checkpoint at 4), resumed: the same weights as a straight run.
    let straight = dir.path().join("straight");
    run(
        config(dir.path(), &student, &t.base, &straight, 10, loss),
        false,
        None,
    );
    let resumed = dir.path().join("resumed");
    let cut = run(
        config(dir.path(), &student, &t.base, &resumed, 10, loss),
        false,
        Some(6),
    );
    assert_eq!(cut.steps, 6);
    assert!(!resumed.join("final").exists());
    let done = run(
        config(dir.path(), &student, &t.base, &resumed, 10, loss),
        true,
        None,
    );
    assert_eq!(done.steps, 10);
    let (a, b) = (
        weights(&straight.join("final")),
        weights(&resumed.join("final")),
    );
    assert_eq!(a.len(), b.len());
    for ((na, va), (nb, vb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(va == vb, "{na} differs after resume");
    }
    // The checkpoint directory is a model the teacher can serve.
    xdistill_shared::hf::ModelDir::open(resumed.join("step_4")).unwrap();
}

#[test]
fn cross_tokenizer_kl_falls() {
    let dir = tempfile::tempdir().unwrap();
    // Teacher on the Qwen3 tokenizer, student on Llama 2's: aligned chunks + projected KL.
    let teacher = token_driven_teacher(dir.path(), "qwen3", "qwen3", 4);
    let student = model(dir.path(), "student", "llama", "llama2", 32, 2, 0.02, 5);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]).expect("starting the teacher");
    let out = dir.path().join("xrun");
    let cfg = config(
        dir.path(),
        &student,
        &t.base,
        &out,
        30,
        r#"kd = { type = "pkl" }"#,
    );
    let s = run(cfg, false, None);
    let (kl0, kl1) = (s.val_kl_start.unwrap(), s.val_kl_end.unwrap());
    eprintln!(
        "cross tokenizer: held-out P-KL {kl0:.4} -> {kl1:.4} in {} steps ({:.1}s)",
        s.steps, s.seconds
    );
    assert!(kl1 < 0.8 * kl0, "held-out P-KL {kl0} -> {kl1}");

    // The teacher's tokenizer given as a local file (`teacher.tokenizer`) rather than fetched
    // from the teacher: the same first step, to the bit. One that does not parse is refused,
    // named, even where it would not be needed.
    let local = dir.path().join("local-tokenizer");
    let mut cfg = config(
        dir.path(),
        &student,
        &t.base,
        &local,
        1,
        r#"kd = { type = "pkl" }"#,
    );
    cfg.teacher.tokenizer = Some(teacher.join("tokenizer.json"));
    cfg.distillation.val_at_start = false;
    cfg.distillation.val_at_end = false;
    run(cfg, false, None);
    assert_eq!(first_kd(&local), first_kd(&out));
    let bad = dir.path().join("bad-teacher-tokenizer.json");
    std::fs::write(&bad, b"{\"model\": 1}").unwrap();
    for s in [&student, &teacher] {
        let mut cfg = config(
            dir.path(),
            s,
            &t.base,
            &dir.path().join("bad"),
            1,
            r#"kd = { type = "pkl" }"#,
        );
        cfg.teacher.tokenizer = Some(bad.clone());
        let err = format!(
            "{:#}",
            setup(cfg)
                .err()
                .expect("a garbage teacher tokenizer was accepted")
        );
        assert!(err.contains("bad-teacher-tokenizer.json"), "{err}");
    }

    // Losses that cannot run here are refused with a message naming what to use instead.
    for (loss, want) in [
        (
            r#"kd = { type = "forward_kl" }"#,
            "use a cross-tokenizer loss",
        ),
        (r#"kd = { type = "sampled_kl" }"#, "run `trainer on-policy`"),
    ] {
        let cfg = config(
            dir.path(),
            &student,
            &t.base,
            &dir.path().join("bad"),
            1,
            loss,
        );
        let err = setup(cfg).and_then(|s| train(&s, false, None)).unwrap_err();
        assert!(format!("{err:#}").contains(want), "{loss}: {err:#}");
    }

    // A student tokenizer.json that does not parse is named as such (it used to be taken for a
    // different tokenizer: "student and teacher tokenizers differ").
    let garbage = dir.path().join("garbage-student");
    std::fs::create_dir_all(&garbage).unwrap();
    for f in std::fs::read_dir(&student).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, garbage.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(garbage.join("tokenizer.json"), b"{\"not\": \"a tokenizer\"").unwrap();
    let cfg = config(
        dir.path(),
        &garbage,
        &t.base,
        &dir.path().join("garbage-run"),
        1,
        r#"kd = { type = "forward_kl" }"#,
    );
    let err = format!(
        "{:#}",
        setup(cfg).err().expect("a garbage tokenizer was accepted")
    );
    assert!(err.contains("tokenizer.json"), "{err}");
    assert!(!err.contains("differ"), "{err}");
}
