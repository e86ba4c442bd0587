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
