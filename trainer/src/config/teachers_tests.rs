use super::*;

const TWO: &str = r#"
        [policy]
        model_name = "student"
        [data]
        train_path = "data/train.jsonl"
        teacher_field = "domain"
        [[teachers]]
        name = "math"
        urls = ["http://127.0.0.1:8000"]
        k = 16
        [[teachers]]
        name = "code"
        urls = ["http://127.0.0.1:8001"]
        weight = 3.0
    "#;

fn load(text: &str) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    std::fs::write(&p, text).unwrap();
    Config::from_file(&p)
}

fn err(text: &str) -> (String, String) {
    match load(text) {
        Err(ConfigError::Invalid { key, message }) => (key, message),
        other => panic!("expected an Invalid error, got {other:?}"),
    }
}

#[test]
fn teachers_list_names_weights_and_the_shorthand() {
    let c = load(TWO).unwrap();
    let list = c.teacher_list();
    assert_eq!(list.len(), 2);
    assert_eq!((list[0].0.as_str(), list[0].1.k), ("math", 16));
    assert_eq!(
        (list[1].0.as_str(), list[1].1.k, list[1].1.weight),
        ("code", 64, 3.0)
    );
    assert_eq!(c.distillation.teachers, TeacherMode::Route);
    // `[teacher]` is one teacher named `teacher`, and its training hash is the one it had
    // before `[[teachers]]` existed (the new keys are not serialised when unset).
    let one = load(
            "[policy]\nmodel_name = \"s\"\n[teacher]\nurls = [\"http://a:1\"]\n[data]\ntrain_path = \"t.jsonl\"\n",
        )
        .unwrap();
    assert_eq!(one.teacher_list()[0].0, "teacher");
    let json = serde_json::to_string(&one.data).unwrap();
    assert!(
        !json.contains("teacher_field") && !json.contains("default_teacher"),
        "{json}"
    );
    assert_ne!(
        c.training_hash(),
        load(&TWO.replace("weight = 3.0", "weight = 2.0"))
            .unwrap()
            .training_hash()
    );
}

#[test]
fn bad_teacher_configs_name_the_key() {
    let cases: Vec<(String, &str, &str)> = vec![
        (
            TWO.replace("name = \"code\"", "name = \"math\""),
            "teachers[1].name",
            "duplicate",
        ),
        (
            TWO.replace("name = \"code\"\n", ""),
            "teachers[1].name",
            "needs a name",
        ),
        (
            TWO.replace("k = 16", "k = 0"),
            "teachers[0].k",
            "at least 1",
        ),
        (
            TWO.replace("weight = 3.0", "weight = -1.0"),
            "teachers[1].weight",
            "positive",
        ),
        (
            TWO.replace("[data]", "[teacher]\nurls = [\"http://x:1\"]\n[data]"),
            "teacher",
            "both [teacher] and [[teachers]]",
        ),
        (
            TWO.replace("teacher_field = \"domain\"", ""),
            "data.teacher_field",
            "needs the field",
        ),
        (
            TWO.replace("teacher_field = \"domain\"", "default_teacher = \"chem\""),
            "data.default_teacher",
            "no teacher is named \"chem\"",
        ),
        (
            format!("{TWO}\n[loss]\nkd = {{ type = \"forward_kl\" }}\ntemperature = 2.0\n"),
            "teachers[0].temperature",
            "differs from loss.temperature",
        ),
    ];
    for (text, key, msg) in cases {
        let (k, m) = err(&text);
        assert_eq!(k, key, "{m}");
        assert!(m.contains(msg), "{key}: {m}");
    }
    // An ensemble needs no routing field; a default alone routes everything.
    let ens = TWO.replace("teacher_field = \"domain\"", "")
        + "\n[distillation]\nteachers = \"ensemble\"\n";
    assert_eq!(
        load(&ens).unwrap().distillation.teachers,
        TeacherMode::Ensemble
    );
    load(&TWO.replace("teacher_field = \"domain\"", "default_teacher = \"code\"")).unwrap();
}

#[test]
fn teacher_url_flag_is_refused_with_several_teachers() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    std::fs::write(&p, TWO).unwrap();
    let args = DistillArgs {
        common: CommonArgs::with_config(p),
        teacher_url: vec!["http://a:1".into()],
    };
    match args.load_config(ObjectiveKind::OffPolicy) {
        Err(ConfigError::Invalid { key, message }) => {
            assert_eq!(key, "teachers");
            assert!(message.contains("--teacher-url"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

/// Each `[[teachers]]` entry is validated under its own key: the validator is told the prefix
/// it reports under.
#[test]
fn teacher_entries_report_under_their_own_prefix() {
    let cases: Vec<(String, &str)> = vec![
        (
            TWO.replace("http://127.0.0.1:8001", "ftp://x"),
            "teachers[1].urls[0]",
        ),
        (
            TWO.replace("urls = [\"http://127.0.0.1:8001\"]", "urls = []"),
            "teachers[1].urls",
        ),
        (
            TWO.replace("weight = 3.0", "weight = 3.0\ntimeout_s = 0"),
            "teachers[1].timeout_s",
        ),
        (
            TWO.replace("k = 16", "k = 16\nprefetch = 0"),
            "teachers[0].prefetch",
        ),
        // Past Duration's range (2^64 s), which panicked when the client was built.
        (
            TWO.replace("weight = 3.0", "weight = 3.0\ntimeout_s = 1e20"),
            "teachers[1].timeout_s",
        ),
        (
            TWO.replace("weight = 3.0", "weight = 3.0\nmax_wait_s = 1e20"),
            "teachers[1].max_wait_s",
        ),
    ];
    for (text, key) in cases {
        assert_eq!(err(&text).0, key);
    }
    let e = TeacherConfig::default()
        .validate_at("teachers[3]")
        .unwrap_err();
    match e {
        ConfigError::Invalid { key, .. } => assert_eq!(key, "teachers[3].urls"),
        other => panic!("{other:?}"),
    }
    let bad = TeacherConfig {
        urls: vec!["http://a:1".into(), "nope".into()],
        ..Default::default()
    };
    match bad.parsed_urls_at("teachers[2]") {
        Err(ConfigError::Invalid { key, .. }) => assert_eq!(key, "teachers[2].urls[1]"),
        other => panic!("{other:?}"),
    }
}
