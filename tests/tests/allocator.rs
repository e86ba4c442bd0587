//! The binaries' allocator options (`xdistill_shared::alloc`): the trainer keeps the pages it
//! frees for its next step (a CPU step frees gigabytes of `[N, V]` temporaries, which the kernel
//! would otherwise zero again on the next touch), the teacher, a long-lived server, returns
//! them. Read from jemalloc's own report of the options it runs with (`stats_print`, printed at
//! exit), so a binary installing the wrong options, or none, fails here.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// The `opt.*` values jemalloc reports for `binary --help`.
fn options(binary: &Path) -> HashMap<String, String> {
    let out = Command::new(binary)
        .arg("--help")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("the binary runs");
    assert!(out.status.success(), "{} --help failed", binary.display());
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    let found: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("opt."))
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.split(' ').next().unwrap_or("").to_string()))
        .collect();
    assert!(
        found.contains_key("dirty_decay_ms"),
        "{} printed no jemalloc options: is jemalloc its allocator?\n{text}",
        binary.display()
    );
    found
}

#[test]
#[cfg(not(target_env = "msvc"))]
fn the_trainer_keeps_freed_memory_and_the_teacher_returns_it() {
    let trainer = options(&xdistill_testkit::trainer_binary());
    for (key, want) in [
        ("thp", "\"always\""),
        ("dirty_decay_ms", "-1"),
        ("muzzy_decay_ms", "-1"),
        ("oversize_threshold", "0"),
        ("lg_extent_max_active_fit", "30"),
    ] {
        assert_eq!(trainer[key], want, "trainer: opt.{key}");
    }
    let teacher = options(&xdistill_testkit::teacher_binary());
    assert_eq!(teacher["thp"], "\"always\"", "teacher: opt.thp");
    let decay: i64 = teacher["dirty_decay_ms"].parse().unwrap();
    assert!(
        decay > 0,
        "the teacher returns freed pages: dirty_decay_ms {decay}"
    );
    assert_ne!(
        teacher["oversize_threshold"], "0",
        "teacher: opt.oversize_threshold"
    );
}

/// The trainer's kept memory does not grow with its steps: `trainer bench-step` (the training
/// loop's step) on a Llama-2-vocabulary student of hidden 192 and 2 layers, its resident memory
/// after the warm-up step against after 6 more. With jemalloc's default
/// `lg_extent_max_active_fit` (6) it grew by about 28 MiB a step there (570 MiB held after 2
/// steps, 1.1 GB after 20; release build, 2 cores; +176 MiB over 6 steps in a test build),
/// with the shipped options not at all. About 5 s in a test build (10 steps in all, with the
/// warm-up and bench-step's phased steps): the smallest student found that shows the growth.
#[test]
#[cfg(all(target_os = "linux", not(target_env = "msvc")))]
fn the_trainers_memory_does_not_grow_with_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("student");
    // `trainer init-model`'s defaults, in process.
    xdistill_shared::init::init_model_dir(&xdistill_shared::init::InitSpec {
        arch: "llama".into(),
        tokenizer: xdistill_testkit::tokenizer_json("llama2"),
        hidden_size: 192,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 512,
        head_dim: None,
        pad_vocab_to: 1,
        max_position_embeddings: 2048,
        tie_embeddings: false,
        init_std: 0.02,
        seed: 0,
        out: model.clone(),
        features: Default::default(),
    })
    .unwrap();
    let out = Command::new(xdistill_testkit::trainer_binary())
        .args(["bench-step", "--model"])
        .arg(&model)
        .args([
            "--device",
            "cpu",
            "--batch",
            "4",
            "--seq-len",
            "128",
            "--k",
            "64",
        ])
        .args(["--steps", "6", "--rounds", "1", "--seed", "1"])
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("the trainer runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "trainer bench-step: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "  host resident: A MiB after the warm-up step, B MiB after the 6 timed steps ..."
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("host resident: "))
        .unwrap_or_else(|| panic!("no host resident line:\n{text}"));
    let mib: Vec<f64> = line
        .split(" MiB")
        .filter_map(|p| p.rsplit(' ').next()?.parse().ok())
        .collect();
    let [warm, end] = mib[..] else {
        panic!("{line}")
    };
    eprintln!("resident {warm} MiB after the warm-up step, {end} MiB after 6 more");
    assert!(
        end < warm + 64.0,
        "the trainer's memory grew with its steps: {warm} -> {end} MiB"
    );
}
