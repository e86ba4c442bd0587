//! Where the `teacher` and `trainer` binaries of this build are.
//!
//! They are found beside the test executable (`target/PROFILE/deps/TEST-HASH` →
//! `target/PROFILE/`). Cargo builds a package's own binaries before its integration tests, and
//! `cargo test --workspace` builds all of them; `cargo test -p xdistill-tests` alone does not:
//! run `cargo build --workspace` first (with `--release` for a release test build).
//! `$XDISTILL_TEACHER_BIN` and `$XDISTILL_TRAINER_BIN` name other ones (test executables run
//! away from their build tree, as in the GPU check).

use std::path::{Path, PathBuf};

/// The `teacher` binary of this build, or `$XDISTILL_TEACHER_BIN`.
pub fn teacher_binary() -> PathBuf {
    binary("teacher", "XDISTILL_TEACHER_BIN")
}

/// The `trainer` binary of this build, or `$XDISTILL_TRAINER_BIN`.
pub fn trainer_binary() -> PathBuf {
    binary("trainer", "XDISTILL_TRAINER_BIN")
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
