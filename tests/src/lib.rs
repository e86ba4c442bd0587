//! Harness of the cross-process tests: the `teacher` and `trainer` binaries of this build, a
//! running teacher ([`TeacherProcess`]), and (in [`distill`]) tiny models and short-run configs.
//!
//! The binaries are found beside the test executable (`target/PROFILE/deps/TEST-HASH` →
//! `target/PROFILE/`), where `cargo test --workspace` builds them before running any test.
//! `cargo test -p xdistill-tests` alone does not build them: run `cargo build --workspace` first
//! (with `--release` for a release test build). `$XDISTILL_TEACHER_BIN` and
//! `$XDISTILL_TRAINER_BIN` name other ones (test executables run away from their build tree).

pub mod distill;

use std::path::{Path, PathBuf};

pub use xdistill_shared::process::{http_status, TeacherProcess};

/// The `teacher` binary of this build, or `$XDISTILL_TEACHER_BIN`.
pub fn teacher_binary() -> PathBuf {
    binary("teacher", "XDISTILL_TEACHER_BIN")
}

/// The `trainer` binary of this build, or `$XDISTILL_TRAINER_BIN`.
pub fn trainer_binary() -> PathBuf {
    binary("trainer", "XDISTILL_TRAINER_BIN")
}

/// Starts this build's `teacher` on `model` (port 0, `extra` flags) and waits until it is
/// healthy; it is stopped when dropped.
pub fn start_teacher(model: &Path, extra: &[&str]) -> TeacherProcess {
    let bin = teacher_binary();
    TeacherProcess::start(&bin, model, extra)
        .unwrap_or_else(|e| panic!("starting the teacher {}: {e}", bin.display()))
}

/// The response (status line, headers and body) of `GET url` on an `http://` URL (std only).
pub fn get_body(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host).expect("connecting");
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .expect("writing");
    let mut buf = String::new();
    s.read_to_string(&mut buf).expect("reading");
    buf
}

/// `$env`, or `name` in the calling test executable's profile directory; panics with what to
/// build when it is not there.
fn binary(name: &str, env: &str) -> PathBuf {
    if let Some(bin) = std::env::var_os(env) {
        let bin = PathBuf::from(bin);
        assert!(bin.is_file(), "${env} = {}: no such file", bin.display());
        return bin;
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/PROFILE/deps/TEST-HASH -> target/PROFILE
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| panic!("{} is not in target/PROFILE/deps/", exe.display()));
    let bin = profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "no `{name}` binary at {}: these tests run the workspace's binaries, which \
         `cargo test --workspace` builds but `cargo test -p xdistill-tests` does not; run \
         `cargo build --workspace` first (add --release for a release test build), or set ${env}",
        bin.display()
    );
    bin
}
