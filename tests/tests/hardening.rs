//! Hardening of the trainer against bad inputs, as processes see it: an absurd `config.json` is
//! refused before anything is allocated (under a memory cap, with a clean exit), over-long
//! records are skipped and counted (or truncated when asked), a run with nothing to learn from
//! fails before any teacher query, a corrupt newest checkpoint is passed over on resume, and
//! non-finite steps abort the run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use xdistill_testkit::models::{model, token_driven_teacher};
use xdistill_testkit::{data_file, get_body, teacher_binary, TeacherProcess};
use xdistill_tests::distill::{config, config_with};
use xdistill_trainer::train::distill::setup;
use xdistill_trainer::train::off_policy::train;

/// Runs `trainer ARGS` with its address space capped at `cap_mb` MiB (`ulimit -v`): an attempt to
/// allocate from an absurd config fails inside the cap instead of swapping the machine.
fn trainer_capped(cap_mb: u64, args: &[&std::ffi::OsStr]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {}; exec \"$0\" \"$@\"", cap_mb * 1024))
        .arg(xdistill_testkit::trainer_binary())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run trainer")
}

fn trainer(args: &[&std::ffi::OsStr]) -> Output {
    trainer_capped(8192, args)
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A copy of model directory `src` whose `config.json` has `key` set to `value`.
fn with_config_value(src: &Path, dst: &Path, key: &str, value: serde_json::Value) -> PathBuf {
    std::fs::create_dir_all(dst).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dst.join(f.file_name().unwrap())).unwrap();
    }
    let p = dst.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg[key] = value;
    std::fs::write(&p, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    dst.to_path_buf()
}

#[test]
fn absurd_config_json_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let good = model(dir.path(), "good", "qwen3", "llama2", 32, 2, 0.02, 1);
    let prompts = dir.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n").unwrap();
    let cases = [
        ("num_hidden_layers", serde_json::json!(1_000_000_000u64)),
        ("hidden_size", serde_json::json!(1u64 << 40)),
        ("vocab_size", serde_json::json!(1u64 << 50)),
        ("intermediate_size", serde_json::json!(1u64 << 45)),
        ("num_attention_heads", serde_json::json!(1u64 << 30)),
        ("max_position_embeddings", serde_json::json!(1u64 << 50)),
    ];
    for (i, (key, value)) in cases.into_iter().enumerate() {
        let bad = with_config_value(&good, &dir.path().join(format!("bad{i}")), key, value);
        // The training load (`Student::load`) and the inference load (`trainer eval`), each in a
        // 4 GiB address space: a clean error naming the key and the file, not an abort (134) or
        // a kill (137).
        for args in [
            vec![
                os("bench-step"),
                os("--model"),
                bad.as_os_str(),
                os("--steps"),
                os("1"),
            ],
            vec![
                os("eval"),
                os("--model"),
                bad.as_os_str(),
                os("--prompts"),
                prompts.as_os_str(),
            ],
        ] {
            let o = trainer_capped(4096, &args);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{key}: {args:?}: {err}");
            assert!(err.contains(&format!("`{key}`")), "{key}: {err}");
            assert!(err.contains(&format!("bad{i}/config.json")), "{key}: {err}");
        }
    }
    // The untouched model still loads (the check does not refuse good models), and bench-step's
    // check of a micro-batch against the CPU's f32 pass (what the GPU check runs on the new
    // path) agrees with bf16 compute on the CPU.
    let o = trainer(&[
        os("bench-step"),
        os("--model"),
        good.as_os_str(),
        os("--steps"),
        os("1"),
        os("--seq-len"),
        os("16"),
        os("--batch"),
        os("1"),
        os("--k"),
        os("4"),
        os("--dtype"),
        os("bf16"),
        os("--check-cpu"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let cosine: f64 = out
        .split("gradient cosine ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no check-cpu line: {out}"));
    assert!(
        out.contains("check-cpu (1 x 16 tokens") && cosine >= 0.99,
        "{out}"
    );

    // init-model refuses a model that cannot fit in memory, before allocating it.
    let tok = xdistill_testkit::tokenizer_json("llama2");
    let out = dir.path().join("huge");
    let o = trainer_capped(
        4096,
        &[
            os("init-model"),
            os("--arch"),
            os("qwen3"),
            os("--tokenizer"),
            tok.as_os_str(),
            os("--layers"),
            os("1000000000"),
            os("--hidden-size"),
            os("4096"),
            os("--out"),
            out.as_os_str(),
        ],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("parameters") && err.contains("--layers"),
        "{err}"
    );
    assert!(!out.exists());
}

/// The largest peak resident memory of this test's finished children, in MiB (getrusage
/// RUSAGE_CHILDREN; nextest runs each test in its own process, so only this test's children).
fn children_peak_rss_mib() -> u64 {
    // SAFETY: getrusage writes one plain struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) },
        0
    );
    ru.ru_maxrss as u64 / 1024
}

/// A GGUF copy of model directory `md` (its Qwen3 tokenizer as metadata) with the metadata
/// `key` set to `value`.
fn gguf_with(md: &Path, file: &Path, key: &str, value: candle_core::quantized::gguf_file::Value) {
    use xdistill_shared::gguf::write::{bpe_tokenizer_metadata, config_metadata, write_gguf};
    let md = xdistill_shared::hf::ModelDir::open(md).unwrap();
    let mut params = std::collections::HashMap::new();
    for w in &md.weights {
        params.extend(candle_core::safetensors::load(w, &candle_core::Device::Cpu).unwrap());
    }
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&md.tokenizer).unwrap()).unwrap();
    let mut meta = config_metadata("llama", &md.config);
    meta.extend(bpe_tokenizer_metadata(&tok, "qwen2").unwrap());
    meta.retain(|(k, _)| k != key);
    meta.push((key.into(), value));
    let ty = candle_core::quantized::GgmlDType::F32;
    write_gguf(file, "llama", &md.config, &params, ty, &meta).unwrap();
}

/// Model files whose sizes are absurd (2^31 layers in `config.json` or in a GGUF `block_count`,
/// a 2^27-token context) are refused by the teacher (`--check-args` and a real start) and by
/// `trainer prune`, with exit code 1 and one line naming the key and the file, before anything
/// is sized from them: no child's resident memory ever passes 300 MB.
#[test]
fn absurd_model_files_are_refused_in_bounded_memory() {
    use candle_core::quantized::gguf_file::Value;
    let dir = tempfile::tempdir().unwrap();
    let good = model(dir.path(), "good", "llama", "qwen3", 32, 2, 0.02, 1);
    let layers = with_config_value(
        &good,
        &dir.path().join("layers"),
        "num_hidden_layers",
        serde_json::json!(1u64 << 31),
    );
    let context = with_config_value(
        &good,
        &dir.path().join("context"),
        "max_position_embeddings",
        serde_json::json!(1u64 << 27),
    );
    let blocks = dir.path().join("blocks.gguf");
    gguf_with(&good, &blocks, "llama.block_count", Value::U64(1 << 31));
    let cases = [
        (&layers, "layers/config.json", "`num_hidden_layers`"),
        (&context, "context/config.json", "`max_position_embeddings`"),
        (&blocks, "blocks.gguf", "llama.block_count"),
    ];
    let teacher = teacher_binary();
    for (model, file, key) in cases {
        let out = dir.path().join("pruned");
        let runs: [(&Path, Vec<&std::ffi::OsStr>); 3] = [
            (
                &teacher,
                vec![os("--model"), model.as_os_str(), os("--check-args")],
            ),
            (
                &teacher,
                vec![os("--model"), model.as_os_str(), os("--port"), os("0")],
            ),
            (
                &xdistill_testkit::trainer_binary(),
                vec![
                    os("prune"),
                    os("--from"),
                    model.as_os_str(),
                    os("--layers"),
                    os("1"),
                    os("--out"),
                    out.as_os_str(),
                ],
            ),
        ];
        for (bin, args) in runs {
            let o = Command::new(bin)
                .args(&args)
                .env("RUST_LOG", "warn")
                .env_remove("XDISTILL_MODEL")
                .output()
                .unwrap();
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
            // One line says what and where.
            assert!(
                err.lines().any(|l| l.contains(key) && l.contains(file)),
                "{args:?}: {err}"
            );
            assert!(!err.contains("panicked"), "{args:?}: {err}");
        }
        assert!(!out.exists(), "prune wrote a copy of {file}");
    }
    // An empty file given as the model says what it is not (it said `…/config.json: Not a
    // directory`).
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let o = Command::new(&teacher)
        .args([os("--model"), empty.as_os_str(), os("--check-args")])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("empty.gguf: neither a GGUF file") && !err.contains("Not a directory"),
        "{err}"
    );
    let peak = children_peak_rss_mib();
    eprintln!("peak RSS of the refused loads: {peak} MiB");
    assert!(peak < 300, "a refused load peaked at {peak} MiB resident");
}

/// `/topk_logits` requests the teacher has answered, by its Prometheus counter.
fn topk_requests(t: &TeacherProcess) -> u64 {
    get_body(&t.url("/metrics"))
        .lines()
        .filter(|l| l.starts_with("xdistill_request_total{route=\"/topk_logits\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// A GSM8K-shaped record whose answer is `words` words long.
fn long_record(i: usize, words: usize) -> String {
    let answer = (0..words)
        .map(|w| format!("w{}", w % 7))
        .collect::<Vec<_>>()
        .join(" ");
    serde_json::json!({"question": format!("question {i}?"), "answer": answer}).to_string()
}

/// Config file path `xdistill_tests::distill::config_with` wrote for output directory `out`.
fn config_path(dir: &Path, out: &Path) -> PathBuf {
    dir.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ))
}

#[test]
fn over_long_records_are_skipped_or_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = token_driven_teacher(dir.path(), "llama", "llama2", 1);
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]).expect("starting the teacher");
    let loss = r#"kd = { type = "forward_kl" }"#;

    // 1. Every record too long: an error naming the cause, before any teacher query.
    let all_long = dir.path().join("all_long.jsonl");
    let lines: Vec<String> = (0..12).map(|i| long_record(i, 300)).collect();
    std::fs::write(&all_long, lines.join("\n")).unwrap();
    let out = dir.path().join("all_long_run");
    config_with(
        dir.path(),
        &student,
        &t.base,
        &out,
        4,
        loss,
        &all_long,
        "question",
        "answer",
        "",
    );
    let cfg_file = config_path(dir.path(), &out);
    let o = trainer(&[
        os("off-policy"),
        os("--config"),
        cfg_file.as_os_str(),
        os("--set"),
        os("data.truncate=false"),
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("nothing to train on") && err.contains("data.truncate"),
        "{err}"
    );
    assert_eq!(topk_requests(&t), 0, "the teacher was queried");
    assert!(!out.join("final").exists());
    // The same data with data.truncate = true trains.
    let o = trainer(&[
        os("off-policy"),
        os("--config"),
        cfg_file.as_os_str(),
        os("--set"),
        os("data.truncate=true"),
        os("--max-steps"),
        os("2"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("final").is_dir());

    // 2. Some too long: skipped and counted (train split only: no validation here).
    let mixed = dir.path().join("mixed.jsonl");
    let mut lines: Vec<String> = std::fs::read_to_string(data_file())
        .unwrap()
        .lines()
        .take(30)
        .map(|l| {
            // Short records: the question with a one-word answer.
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            serde_json::json!({"question": v["question"], "answer": "42"}).to_string()
        })
        .collect();
    for i in 0..5 {
        lines.insert(3 + 6 * i, long_record(i, 300));
    }
    std::fs::write(&mixed, lines.join("\n")).unwrap();
    let out = dir.path().join("mixed_run");
    let mut cfg = config_with(
        dir.path(),
        &student,
        &t.base,
        &out,
        3,
        loss,
        &mixed,
        "question",
        "answer",
        "",
    );
    cfg.data.truncate = false;
    cfg.data.val_count = None;
    cfg.distillation.val_at_start = false;
    cfg.distillation.val_at_end = false;
    cfg.policy.max_total_sequence_length = 256;
    let s = setup(cfg).unwrap();
    let summary = train(&s, false, None).unwrap();
    assert_eq!(summary.steps, 3);
    assert_eq!(summary.skipped_records, 5);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["skipped_records"], 5);
    // Every step trained on something.
    assert!(metrics.lines().all(|l| {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        v["loss_tokens"].as_u64().unwrap_or(1) > 0
    }));
}

#[test]
fn sft_with_every_record_too_long_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 1, 0.02, 2);
    let data = dir.path().join("long.jsonl");
    let lines: Vec<String> = (0..6).map(|i| long_record(i, 300)).collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let out = dir.path().join("sft_run");
    let cfg_file = dir.path().join("sft.toml");
    std::fs::write(
        &cfg_file,
        format!(
            "[policy]\nmodel_name = {:?}\nmax_total_sequence_length = 64\n\
             [data]\ntrain_path = {:?}\nprompt_field = \"question\"\n\
             completion_field = \"answer\"\n[distillation]\nnum_prompts_per_step = 2\n\
             max_num_steps = 3\n[checkpointing]\ncheckpoint_dir = {:?}\n\
             [logger]\nprogress_bar = false\n",
            student.display().to_string(),
            data.display().to_string(),
            out.display().to_string()
        ),
    )
    .unwrap();
    let o = trainer(&[os("sft"), os("--config"), cfg_file.as_os_str()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("nothing to train on"), "{err}");
    assert!(!out.join("final").exists());
}

#[test]
fn truncation_cuts_both_tokenizations_at_one_chunk_boundary() {
    use xdistill_trainer::align::AlignTokenizer;
    use xdistill_trainer::data::{Content, Record};
    use xdistill_trainer::train::pairing::{Item, Limits, Tokenization};
    use xdistill_trainer::train::prepare::prepare_record;
    let tok = Tokenization::Cross {
        student: AlignTokenizer::from_file(&xdistill_testkit::tokenizer_json("llama3")).unwrap(),
        teacher: AlignTokenizer::from_file(&xdistill_testkit::tokenizer_json("qwen3")).unwrap(),
    };
    let text: String = (0..200).map(|i| format!("Ünïcode wörd{i}, ")).collect();
    let r = Record {
        line: 1,
        content: Content::Pair {
            prompt: "Q: ".into(),
            completion: text,
        },
        completion_only_loss: true,
        teacher: None,
    };
    let lim = Limits {
        max_student_tokens: 50,
        max_teacher_tokens: 40,
        truncate: false,
    };
    // Skipped when not asked to truncate.
    assert!(tok.too_long(&r, lim));
    assert!(prepare_record(&r, &tok, lim).is_none());
    // Truncated when asked: both sides within their limits, ending at the same chunk boundary.
    let item = prepare_record(
        &r,
        &tok,
        Limits {
            truncate: true,
            ..lim
        },
    )
    .unwrap();
    let Item::Cross { pair, .. } = item else {
        panic!("expected a cross-tokenizer item")
    };
    assert!(pair.truncated);
    assert!(pair.student_ids.len() <= 50 && pair.teacher_ids.len() <= 40);
    assert!(
        pair.student_ids.len() >= 30 || pair.teacher_ids.len() >= 30,
        "cut far too early"
    );
    let last = pair.chunks.last().unwrap();
    assert_eq!(last.student.end, pair.student_ids.len());
    assert_eq!(last.teacher.end, pair.teacher_ids.len());
    assert_eq!(last.bytes.end, pair.text.len());
    assert!(pair.text.starts_with("Q: Ünïcode wörd0, "));
    // A short record is neither too long nor changed.
    let short = Record {
        line: 2,
        content: Content::Text {
            text: "short text".into(),
        },
        completion_only_loss: true,
        teacher: None,
    };
    assert!(!tok.too_long(&short, lim));
    assert!(prepare_record(&short, &tok, lim).is_some());
}

fn weights(dir: &Path) -> Vec<(String, Vec<u32>)> {
    let t =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let mut v: Vec<_> = t
        .into_iter()
        .map(|(k, t)| {
            let bits = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (k, bits.iter().map(|x| x.to_bits()).collect())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn corrupt_checkpoints_and_non_finite_steps() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = token_driven_teacher(dir.path(), "llama", "llama2", 1);
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let t = TeacherProcess::start(&teacher_binary(), &teacher, &[]).expect("starting the teacher");
    let loss = r#"kd = { type = "forward_kl" }"#;
    let quick = |c: &mut xdistill_trainer::config::Config| {
        c.distillation.val_at_start = false;
        c.distillation.val_at_end = false;
    };

    // 1. A flipped byte in the newest checkpoint: resume says so and continues from the
    //    previous checkpoint, ending exactly where an uninterrupted run ends.
    let straight = dir.path().join("straight");
    let mut c = config(dir.path(), &student, &t.base, &straight, 10, loss);
    quick(&mut c);
    train(&setup(c).unwrap(), false, None).unwrap();
    let cut = dir.path().join("cut");
    let mut c = config(dir.path(), &student, &t.base, &cut, 10, loss);
    quick(&mut c);
    let s = train(&setup(c).unwrap(), false, Some(9)).unwrap();
    assert_eq!(s.steps, 9);
    assert!(cut.join("step_4").is_dir() && cut.join("step_8").is_dir());
    let st = cut.join("step_8").join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let mid = bytes.len() - 100; // inside the tensor data, past the header
    bytes[mid] ^= 0x40;
    std::fs::write(&st, &bytes).unwrap();
    let cfg_file = config_path(dir.path(), &cut);
    let o = trainer(&[
        os("off-policy"),
        os("--config"),
        cfg_file.as_os_str(),
        os("--resume"),
        os("--set"),
        os("distillation.val_at_start=false"),
        os("--set"),
        os("distillation.val_at_end=false"),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("step_8/model.safetensors") && err.contains("SHA-256"),
        "{err}"
    );
    assert!(err.contains("falling back"), "{err}");
    assert!(cut.join("step_8.corrupt").is_dir());
    assert_eq!(
        weights(&straight.join("final")),
        weights(&cut.join("final"))
    );

    // 2. A NaN weight: every step is non-finite; the run aborts after max_nonfinite_steps,
    //    exits non-zero and writes no final model.
    let nan_student = dir.path().join("nan_student");
    with_config_value(
        &student,
        &nan_student,
        "model_type",
        serde_json::json!("qwen3"),
    );
    let path = nan_student.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
    let n = tensors["model.norm.weight"].elem_count();
    tensors.insert(
        "model.norm.weight".into(),
        candle_core::Tensor::from_vec(vec![f32::NAN; n], n, &candle_core::Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let out = dir.path().join("nan_run");
    config(dir.path(), &nan_student, &t.base, &out, 10, loss);
    let cfg_file = config_path(dir.path(), &out);
    let o = trainer(&[
        os("off-policy"),
        os("--config"),
        cfg_file.as_os_str(),
        os("--set"),
        os("policy.max_nonfinite_steps=3"),
        os("--set"),
        os("distillation.val_at_start=false"),
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("policy.max_nonfinite_steps = 3"), "{err}");
    assert!(!out.join("final").exists());
    assert!(!out.join("step_4").exists());
}

/// Two teacher URLs serving the same weights at other dtypes (one model fingerprint, other
/// numbers) are refused at start, before any teacher query, naming the start-up probe, both
/// URLs and both probe hashes.
#[test]
fn replicas_whose_probes_differ_are_refused_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    let teacher = model(dir.path(), "teacher", "llama", "llama2", 32, 2, 0.1, 5);
    let student = model(dir.path(), "student", "qwen3", "llama2", 32, 2, 0.02, 2);
    let start = |dtype: &str| {
        TeacherProcess::start(&teacher_binary(), &teacher, &["--dtype", dtype])
            .expect("starting the teacher")
    };
    let (f32_t, bf16_t) = (start("f32"), start("bf16"));
    let probe = |t: &TeacherProcess| {
        let body = get_body(&t.url("/v1/info"));
        let json = body
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_string();
        let v: serde_json::Value = serde_json::from_str(&json).expect("an info body");
        let hash = v["probe"]["hash"]
            .as_str()
            .expect("a probe hash")
            .to_string();
        (v["model_fingerprint"].clone(), hash)
    };
    let ((fp32, h32), (fp16, h16)) = (probe(&f32_t), probe(&bf16_t));
    assert_eq!(fp32, fp16, "one model fingerprint for both dtypes");
    let out = dir.path().join("probe_run");
    config(
        dir.path(),
        &student,
        &f32_t.base,
        &out,
        2,
        r#"kd = { type = "forward_kl" }"#,
    );
    let cfg_file = config_path(dir.path(), &out);
    let o = trainer(&[
        os("off-policy"),
        os("--config"),
        cfg_file.as_os_str(),
        os("--teacher-url"),
        os(&f32_t.base),
        os("--teacher-url"),
        os(&bf16_t.base),
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    for part in ["probe", &f32_t.base, &bf16_t.base, &h32, &h16] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert_eq!(topk_requests(&f32_t) + topk_requests(&bf16_t), 0);
    assert!(!out.join("final").exists());
}
