//! How a failed run ends: one `Error:` line on stderr with each cause once (an I/O error's
//! reason appears once, not again as a "Caused by"), exit status 1, and the backtrace only when
//! asked for (`shared::report`).

use std::process::Output;

fn trainer(args: &[&str], backtrace: bool) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_trainer"));
    cmd.args(args)
        .env("RUST_LOG", "warn")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    if backtrace {
        cmd.env("RUST_LIB_BACKTRACE", "1");
    }
    cmd.output().expect("run trainer")
}

#[test]
fn a_failed_run_is_one_error_line_with_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let missing = missing.to_str().unwrap();
    let out = trainer(&["off-policy", "--config", missing], false);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with(&format!("Error: {missing}: ")),
        "{err}"
    );
    let reason = "No such file or directory";
    assert_eq!(err.matches(reason).count(), 1, "{err}");

    let out = trainer(&["off-policy", "--config", missing], true);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("Error: ") && err.contains("\nStack backtrace:\n"),
        "{err}"
    );
}
