use super::args::apply_set;
use super::*;

const MINIMAL: &str = r#"
        [policy]
        model_name = "student"
        [teacher]
        urls = ["http://127.0.0.1:8000"]
        [data]
        train_path = "data/train.jsonl"
    "#;

fn write(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("c.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// `policy.data_parallel.virtual_shards`: `"auto"` by default (and absent from the serialised
/// config, so a config without the section keeps its hash), a number, or a clear error.
#[test]
fn virtual_shards_takes_auto_or_a_number() {
    let dir = tempfile::tempdir().unwrap();
    let c = Config::from_file(&write(dir.path(), MINIMAL)).unwrap();
    assert_eq!(c.policy.data_parallel.virtual_shards, VirtualShards::Auto);
    assert!(!c.to_toml_string().unwrap().contains("data_parallel"));
    for (v, want) in [
        ("\"auto\"", VirtualShards::Auto),
        ("0", VirtualShards::Fixed(0)),
        ("8", VirtualShards::Fixed(8)),
        ("4096", VirtualShards::Fixed(4096)),
    ] {
        let text = format!("{MINIMAL}\n[policy.data_parallel]\nvirtual_shards = {v}\n");
        let c = Config::from_file(&write(dir.path(), &text)).unwrap();
        assert_eq!(c.policy.data_parallel.virtual_shards, want, "{v}");
        // What a rank sends to the rendezvous reads back the same.
        let again: Config = toml::from_str(&c.to_toml_string().unwrap()).unwrap();
        assert_eq!(again.policy.data_parallel.virtual_shards, want, "{v}");
    }
    // 4097 and past: a million empty shards per step were a hang, not a run.
    for bad in ["\"eight\"", "-1", "true", "4097", "1000000"] {
        let text = format!("{MINIMAL}\n[policy.data_parallel]\nvirtual_shards = {bad}\n");
        let e = Config::from_file(&write(dir.path(), &text))
            .unwrap_err()
            .to_string();
        assert!(e.contains("virtual_shards"), "{bad}: {e}");
    }
}

#[test]
fn activation_checkpointing_takes_a_bool_selective_or_auto() {
    let dir = tempfile::tempdir().unwrap();
    let c = Config::from_file(&write(dir.path(), MINIMAL)).unwrap();
    assert_eq!(
        c.policy.activation_checkpointing,
        ActivationCheckpointing::Auto
    );
    for (v, want) in [
        ("true", ActivationCheckpointing::On),
        ("false", ActivationCheckpointing::Off),
        ("\"auto\"", ActivationCheckpointing::Auto),
        ("\"selective\"", ActivationCheckpointing::Selective),
    ] {
        let text = MINIMAL.replace(
            "[policy]\n",
            &format!("[policy]\nactivation_checkpointing = {v}\n"),
        );
        let c = Config::from_file(&write(dir.path(), &text)).unwrap();
        assert_eq!(c.policy.activation_checkpointing, want, "{v}");
    }
    // The command line's spelling (`trainer bench-step --activation-checkpointing`).
    for (v, want) in [
        ("on", ActivationCheckpointing::On),
        ("off", ActivationCheckpointing::Off),
        ("selective", ActivationCheckpointing::Selective),
        ("auto", ActivationCheckpointing::Auto),
    ] {
        assert_eq!(ActivationCheckpointing::parse(v), Ok(want), "{v}");
    }
    let e = ActivationCheckpointing::parse("sometimes").unwrap_err();
    assert!(
        e.contains("selective") && e.contains("\"sometimes\""),
        "{e}"
    );
    for bad in ["\"yes\"", "1"] {
        let text = MINIMAL.replace(
            "[policy]\n",
            &format!("[policy]\nactivation_checkpointing = {bad}\n"),
        );
        let e = Config::from_file(&write(dir.path(), &text))
            .unwrap_err()
            .to_string();
        assert!(e.contains("activation_checkpointing"), "{bad}: {e}");
    }
}

#[test]
fn defaults_fill_everything_else() {
    let dir = tempfile::tempdir().unwrap();
    let c = Config::from_file(&write(dir.path(), MINIMAL)).unwrap();
    assert_eq!(c.teacher.k, 64);
    assert_eq!(c.distillation, DistillationConfig::default());
    assert_eq!(c.policy.optimizer, OptimizerConfig::default());
    assert!(c.loss.is_none());
    // Relative paths resolve against the config's directory.
    assert_eq!(c.policy.model_name, dir.path().join("student"));
    assert_eq!(c.data.train_path, dir.path().join("data/train.jsonl"));
    assert_eq!(
        c.checkpointing.checkpoint_dir,
        dir.path().join("runs/off_policy")
    );
    assert_eq!(
        c.student_tokenizer(),
        dir.path().join("student/tokenizer.json")
    );
    assert_eq!(
        c.data.resolved_format(&c.data.train_path),
        DataFormat::Jsonl
    );
    assert_eq!(c.data.resolved_format(Path::new("a.txt")), DataFormat::Text);
}

#[test]
fn flags_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let args = DistillArgs {
        common: CommonArgs {
            config: write(dir.path(), MINIMAL),
            student: Some("cli_student".into()),
            data: Some("cli.txt".into()),
            output: Some("out".into()),
            max_steps: Some(7),
            resume: true,
            start_fresh: false,
            set: vec![
                "policy.optimizer.lr=3e-5".into(),
                "loss.kd.type=forward_kl".into(),
            ],
        },
        teacher_url: vec!["http://a:1".into(), "http://b:2/".into()],
    };
    let c = args.load_config(ObjectiveKind::OffPolicy).unwrap();
    assert_eq!(c.teacher.urls, ["http://a:1", "http://b:2/"]);
    assert_eq!(c.teacher.parsed_urls().unwrap().len(), 2);
    assert_eq!(c.policy.model_name, PathBuf::from("cli_student"));
    assert_eq!(c.data.train_path, PathBuf::from("cli.txt"));
    assert_eq!(c.checkpointing.checkpoint_dir, PathBuf::from("out"));
    assert_eq!(c.distillation.max_num_steps, 7);
    assert_eq!(c.policy.optimizer.lr, 3e-5);
    assert_eq!(
        c.loss.as_ref().map(|l| &l.kd),
        Some(&crate::loss::KdConfig::ForwardKl {})
    );
}

fn err_key(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    match Config::from_file(&write(dir.path(), text)) {
        Err(ConfigError::Invalid { key, .. }) => key,
        other => panic!("expected an Invalid error, got {other:?}"),
    }
}

#[test]
fn validation_errors_name_the_key() {
    let with = |extra: &str| format!("{MINIMAL}\n{extra}");
    assert_eq!(
        err_key(&with("[distillation]\nnum_prompts_per_step = 0")),
        "distillation.num_prompts_per_step"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("[teacher]", "[teacher]\nk = 0")),
        "teacher.k"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("http://127.0.0.1:8000", "ftp://x")),
        "teacher.urls[0]"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("urls = [\"http://127.0.0.1:8000\"]", "")),
        "teacher.urls"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("[policy]", "[policy]\ndevice = \"tpu\"")),
        "policy.device"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("[policy]", "[policy]\nprecision = \"f8\"")),
        "policy.precision"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("[data]", "[data]\nprompt_field = \"q\"")),
        "data.completion_field"
    );
    assert_eq!(
        err_key(&MINIMAL.replace("[data]", "[data]\nprompts_only = true")),
        "data.prompt_field"
    );
    // A prompt field alone is a prompts-only file.
    let ok = MINIMAL.replace(
        "[data]",
        "[data]\nprompt_field = \"q\"\nprompts_only = true",
    );
    let dir = tempfile::tempdir().unwrap();
    let c = Config::from_file(&write(dir.path(), &ok)).unwrap();
    assert!(c.data.prompts_only && c.data.completion_field.is_none());
    assert_eq!(
        err_key(&with("[distillation]\nval_period = 10")),
        "distillation.val_period"
    );
    assert_eq!(
        err_key(&with("[policy.optimizer]\nbetas = [0.9, 1.0]")),
        "policy.optimizer.betas"
    );
    assert_eq!(
        err_key(&with("[checkpointing]\nkeep_top_k = 0")),
        "checkpointing.keep_top_k"
    );
}

#[test]
fn unknown_keys_are_rejected_with_their_name() {
    let dir = tempfile::tempdir().unwrap();
    let text = MINIMAL.replace("[teacher]", "[teacher]\ntopk = 3");
    match Config::from_file(&write(dir.path(), &text)) {
        Err(ConfigError::Parse { message, .. }) => {
            assert!(message.contains("topk"), "{message}")
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn set_parses_toml_values_and_strings() {
    let mut t = toml::Table::new();
    apply_set(&mut t, "a.b=3").unwrap();
    apply_set(&mut t, "a.c=hello").unwrap();
    apply_set(&mut t, "a.d=[1, 2]").unwrap();
    assert_eq!(t["a"]["b"].as_integer(), Some(3));
    assert_eq!(t["a"]["c"].as_str(), Some("hello"));
    assert_eq!(t["a"]["d"].as_array().map(|a| a.len()), Some(2));
    assert!(apply_set(&mut t, "a.b.c=1").is_err());
    assert!(apply_set(&mut t, "novalue").is_err());
}

#[test]
fn temperatures_of_teacher_and_loss_must_agree() {
    let with = |extra: &str| format!("{MINIMAL}\n{extra}");
    assert_eq!(
        err_key(&with(
            "[loss]\nkd = { type = \"forward_kl\" }\ntemperature = 2.0"
        )),
        "teacher.temperature"
    );
    let dir = tempfile::tempdir().unwrap();
    let ok = MINIMAL.replace("[teacher]", "[teacher]\ntemperature = 2.0");
    Config::from_file(&write(
        dir.path(),
        &with_loss(&ok, "kd = { type = \"forward_kl\" }\ntemperature = 2"),
    ))
    .unwrap();
}

/// Temperatures agree exactly (the teacher's at its wire precision, f32), not within a
/// tolerance: 2.0000005 is another f32 than 2.0, and loss_cross must equal loss to the bit.
#[test]
fn temperatures_agree_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let near = MINIMAL.replace("[teacher]", "[teacher]\ntemperature = 2.0000005");
    assert_eq!(
        err_key(&with_loss(
            &near,
            "kd = { type = \"forward_kl\" }\ntemperature = 2.0"
        )),
        "teacher.temperature"
    );
    // 0.1 is not an f32: the teacher's 0.1 is the f32 nearest the loss's 0.1, the same one.
    let tenth = MINIMAL.replace("[teacher]", "[teacher]\ntemperature = 0.1");
    Config::from_file(&write(
        dir.path(),
        &with_loss(&tenth, "kd = { type = \"forward_kl\" }\ntemperature = 0.1"),
    ))
    .unwrap();
    let two = MINIMAL.replace("[teacher]", "[teacher]\ntemperature = 2.0");
    let cross = with_loss(&two, "kd = { type = \"forward_kl\" }\ntemperature = 2.0")
        + "[loss_cross]\nkd = { type = \"first_kl\" }\ntemperature = 2.0000005\n";
    assert_eq!(err_key(&cross), "loss_cross.temperature");
}

/// A temperature outside (0, ∞) in `[loss]` or `[loss_cross]` stops the file from loading, the
/// error naming the section and the key (`Temperature` is parsed, not checked later).
#[test]
fn a_bad_loss_temperature_fails_to_load_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let fwd = "kd = { type = \"forward_kl\" }";
    let cases = [
        (
            "loss",
            with_loss(MINIMAL, &format!("{fwd}\ntemperature = 0")),
            "0",
        ),
        (
            "loss",
            with_loss(MINIMAL, &format!("{fwd}\ntemperature = -1.5")),
            "-1.5",
        ),
        (
            "loss",
            with_loss(MINIMAL, &format!("{fwd}\ntemperature = nan")),
            "NaN",
        ),
        (
            "loss_cross",
            with_loss(MINIMAL, fwd)
                + "[loss_cross]\nkd = { type = \"first_kl\" }\ntemperature = 0.0\n",
            "0",
        ),
    ];
    for (section, text, shown) in cases {
        match Config::from_file(&write(dir.path(), &text)) {
            Err(ConfigError::Parse { message, .. }) => assert!(
                message.contains(&format!(
                    "[{section}]: temperature must be finite and > 0, got {shown}"
                )),
                "{message}"
            ),
            other => panic!("expected a parse error, got {other:?}"),
        }
    }
}

fn with_loss(text: &str, loss: &str) -> String {
    format!("{text}\n[loss]\n{loss}\n")
}

/// Every example in `configs/` parses, validates, and names a data file that exists.
#[test]
fn every_shipped_config_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let c = Config::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            c.data.train_path.is_file(),
            "{}: {}",
            path.display(),
            c.data.train_path.display()
        );
        assert!(c.loss.is_some(), "{}: no [loss]", path.display());
        // The [loss] table must be a valid loss config, not just TOML.
        let loss = c
            .loss()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        loss.validate()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        c.on_policy
            .generation
            .validate()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 3, "expected the example configs in {}", dir.display());
}

#[test]
fn training_hash_ignores_run_length_but_not_lr() {
    let mut a = Config::default();
    let h0 = a.training_hash();
    a.distillation.max_num_steps += 10;
    a.checkpointing.checkpoint_dir = "elsewhere".into();
    a.checkpointing.cache_dir = Some("shared".into());
    assert_eq!(a.training_hash(), h0);
    a.policy.optimizer.lr *= 2.0;
    assert_ne!(a.training_hash(), h0);
}

/// A config without any teacher section: enough for SFT, not for distillation.
const NO_TEACHER: &str = r#"
        [policy]
        model_name = "student"
        [data]
        train_path = "data/train.jsonl"
    "#;

#[test]
fn sft_needs_no_teacher_and_distillation_names_the_missing_key() {
    let dir = tempfile::tempdir().unwrap();
    let args = CommonArgs::with_config(write(dir.path(), NO_TEACHER));
    let c = Config::load(&args, &[], ObjectiveKind::Sft).unwrap();
    assert!(c.teacher.urls.is_empty());
    c.validate_for(ObjectiveKind::Sft).unwrap();
    for objective in [ObjectiveKind::OffPolicy, ObjectiveKind::OnPolicy] {
        match Config::load(&args, &[], objective) {
            Err(ConfigError::Invalid { key, message }) => {
                assert_eq!(key, "teacher.urls", "{objective:?}");
                assert!(message.contains("teacher URL"), "{objective:?}: {message}");
            }
            other => panic!("{objective:?}: expected an Invalid error, got {other:?}"),
        }
    }
    // The distillation commands take the URL from the flag instead.
    let distill = DistillArgs {
        common: args.clone(),
        teacher_url: vec!["http://127.0.0.1:8000".into()],
    };
    distill.load_config(ObjectiveKind::OffPolicy).unwrap();
    // SFT reads no teacher key: a [[teachers]] list without routing, or a teacher temperature
    // that is not the loss's, is no error for it.
    let routed = format!(
        "{NO_TEACHER}\n[[teachers]]\nname = \"a\"\nurls = [\"http://a:1\"]\n\
         [[teachers]]\nname = \"b\"\nurls = [\"http://b:1\"]\n"
    );
    let args = CommonArgs::with_config(write(dir.path(), &routed));
    Config::load(&args, &[], ObjectiveKind::Sft).unwrap();
    match Config::load(&args, &[], ObjectiveKind::OffPolicy) {
        Err(ConfigError::Invalid { key, .. }) => assert_eq!(key, "data.teacher_field"),
        other => panic!("expected an Invalid error, got {other:?}"),
    }
    let hot = with_loss(MINIMAL, "kd = { type = \"forward_kl\" }\ntemperature = 2.0");
    let args = CommonArgs::with_config(write(dir.path(), &hot));
    Config::load(&args, &[], ObjectiveKind::Sft).unwrap();
    assert_eq!(err_key(&hot), "teacher.temperature");
}

/// A config with a non-default value in every section, paths absolute.
fn everything_set(dir: &Path) -> Config {
    let mut c = Config::default();
    c.policy.model_name = dir.join("student");
    c.policy.tokenizer = Some(dir.join("student_tokenizer.json"));
    c.policy.max_total_sequence_length = 512;
    c.policy.precision = "bf16".into();
    c.policy.train_micro_batch_size = 2;
    c.policy.activation_checkpointing = ActivationCheckpointing::On;
    c.policy.optimizer.lr = 3e-5;
    c.policy.optimizer.schedule = LrSchedule::Linear;
    c.policy.optimizer.max_grad_norm = 0.0;
    c.policy.optimizer.betas = [0.8, 0.95];
    c.teacher.urls = vec![
        "http://127.0.0.1:8000".into(),
        "https://t.example/v1/".into(),
    ];
    c.teacher.k = 16;
    c.teacher.temperature = 2.0;
    c.teacher.max_attempts = Some(5);
    c.teacher.api_key_env = Some("TEACHER_KEY".into());
    c.teacher.tokenizer = Some(dir.join("teacher_tokenizer.json"));
    c.loss = Some(
        toml::from_str(
            "kd = { type = \"jsd\", beta = 0.25 }\ntemperature = 2.0\nkd_weight = 0.5\n\
             ce = { type = \"weight\", weight = 0.1 }",
        )
        .unwrap(),
    );
    c.data.train_path = dir.join("train.jsonl");
    c.data.val_path = Some(dir.join("val.jsonl"));
    c.data.format = DataFormat::Jsonl;
    c.data.prompt_field = Some("q".into());
    c.data.completion_field = Some("a".into());
    c.data.separator = "\n".into();
    c.data.val_count = Some(5);
    c.data.truncate = true;
    c.distillation.num_prompts_per_step = 3;
    c.distillation.max_num_steps = 50;
    c.distillation.seed = 7;
    c.distillation.val_period = 10;
    c.distillation.max_val_samples = Some(20);
    c.checkpointing.checkpoint_dir = dir.join("out");
    c.checkpointing.keep_top_k = None;
    c.checkpointing.metric_name = Some("val_kl".into());
    c.checkpointing.cache_dir = Some(dir.join("cache"));
    c.logger.log_every = 3;
    c.logger.progress_bar = false;
    c.on_policy.lambda = 0.5;
    c.on_policy.include_prompt = true;
    c.on_policy.generation.temperature = 0.8;
    c.on_policy.generation.eos_ids = Some(vec![2]);
    c
}

/// What `Config` serialises to, `Config::load` reads back to an equal value (so configs can be
/// written from `Config` values rather than by formatting TOML text).
#[test]
fn a_serialised_config_loads_back_equal() {
    let dir = tempfile::tempdir().unwrap();
    let one = everything_set(dir.path());
    let mut several = everything_set(dir.path());
    several.teachers = vec![
        TeacherConfig {
            name: Some("math".into()),
            temperature: 2.0,
            ..std::mem::take(&mut several.teacher)
        },
        TeacherConfig {
            name: Some("code".into()),
            urls: vec!["http://127.0.0.1:8001".into()],
            weight: 3.0,
            temperature: 2.0,
            ..Default::default()
        },
    ];
    several.data.teacher_field = Some("domain".into());
    several.data.default_teacher = Some("code".into());
    several.distillation.teachers = TeacherMode::Ensemble;
    several.loss_cross =
        Some(toml::from_str("kd = { type = \"pkl\" }\ntemperature = 2.0").unwrap());
    for (i, c) in [one, several].into_iter().enumerate() {
        c.validate().unwrap();
        let text = c.to_toml_string().unwrap();
        let path = dir.path().join(format!("c{i}.toml"));
        std::fs::write(&path, &text).unwrap();
        let back = Config::load(
            &CommonArgs::with_config(&path),
            &[],
            ObjectiveKind::OffPolicy,
        )
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(back, c, "{text}");
        assert_eq!(Config::from_toml_str(&text, &path).unwrap(), c);
    }
    // The defaults too (not a valid run: no student, no data).
    let text = Config::default().to_toml_string().unwrap();
    assert_eq!(
        Config::from_toml_str(&text, Path::new("d.toml")).unwrap(),
        Config::default()
    );
}

/// `keep_top_k`'s `None` (keep every checkpoint) is `"all"` in TOML, since an absent key is
/// the default (3).
#[test]
fn keep_top_k_takes_a_count_or_all() {
    let dir = tempfile::tempdir().unwrap();
    let load = |v: &str| {
        let text = format!("{MINIMAL}\n[checkpointing]\nkeep_top_k = {v}\n");
        Config::from_file(&write(dir.path(), &text))
    };
    assert_eq!(load("2").unwrap().checkpointing.keep_top_k, Some(2));
    assert_eq!(load("\"all\"").unwrap().checkpointing.keep_top_k, None);
    let c = Config::from_file(&write(dir.path(), MINIMAL)).unwrap();
    assert_eq!(c.checkpointing.keep_top_k, Some(3));
    for bad in ["\"some\"", "-1", "1.5"] {
        let e = load(bad).unwrap_err().to_string();
        assert!(e.contains("keep_top_k"), "{bad}: {e}");
    }
}

/// `checkpointing.cache_dir` moves the teachers' tokenizers, projection maps and heads out of
/// the run's directory (where they are without it); an empty one is refused by name.
#[test]
fn cache_dir_defaults_to_the_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let load = |extra: &str| {
        let text = format!("{MINIMAL}\n[checkpointing]\ncheckpoint_dir = \"runs/a\"\n{extra}");
        Config::from_file(&write(dir.path(), &text))
    };
    // Relative paths are the config file's, as checkpoint_dir's.
    let c = load("").unwrap();
    let base = dir.path();
    assert_eq!(c.teacher_head_cache(), base.join("runs/a/teacher_head"));
    assert_eq!(
        c.teacher_tokenizer_cache(),
        base.join("runs/a/teacher_tokenizer")
    );
    let c = load("cache_dir = \"shared\"").unwrap();
    assert_eq!(c.teacher_head_cache(), base.join("shared/teacher_head"));
    assert_eq!(
        c.teacher_tokenizer_cache(),
        base.join("shared/teacher_tokenizer")
    );
    assert_eq!(
        err_key(&format!("{MINIMAL}\n[checkpointing]\ncache_dir = \"\"")),
        "checkpointing.cache_dir"
    );
}

/// `auto` on the CPU: the budget is a share of the machine's (or its cgroup's) memory less the
/// run's own state; a tiny student keeps every activation at a short length, keeps all but the
/// attention core where the scores alone would pass the budget, and checkpoints past that.
#[test]
fn auto_activations_follow_the_machines_memory() {
    use xdistill_shared::model::{ActivationBytes, Activations};
    let (model, _) = crate::train::testutil::tiny(false, candle_core::DType::F32, 5);
    let budget = super::policy::activation_budget(&model);
    let total = xdistill_shared::device::memory_info(model.device())
        .unwrap()
        .total as f64;
    assert!(0.0 < budget && budget < total / 2.0, "{budget} of {total}");
    let auto = |b, t| ActivationCheckpointing::Auto.resolve(&model, b, t);
    assert_eq!(auto(4, 64), Activations::Keep);
    // The shortest power of two whose kept scores pass the budget.
    let t = (6..40)
        .map(|p| 1usize << p)
        .find(|&t| ActivationBytes::of(&model, 1, t).keep > budget)
        .unwrap();
    let need = ActivationBytes::of(&model, 1, t);
    assert!(need.selective < budget, "{need:?} vs {budget}");
    assert_eq!(auto(1, t), Activations::Selective);
    let rows = (budget / need.selective) as usize + 1;
    assert!(ActivationBytes::of(&model, rows, t).checkpoint < budget);
    assert_eq!(auto(rows, t), Activations::Checkpoint);
}
