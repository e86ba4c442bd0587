//! Support for tests that need a real `teacher` process on loopback (used by this crate's and the
//! trainer's integration tests; not part of the serving path). The process itself is
//! [`xdistill_shared::process::TeacherProcess`], which the demo runs too.

use std::path::{Path, PathBuf};
use std::process::Command;

pub use xdistill_shared::process::{http_status as get_status, TeacherProcess};

/// The `teacher` binary of the current build (beside the calling test's `deps/` folder), built
/// first if it is missing or stale — another crate's tests cannot name it with `CARGO_BIN_EXE_`.
/// `$XDISTILL_TEACHER_BIN` names one instead (test executables run away from their build tree,
/// where no cargo is, as on the GPU check's machine).
pub fn teacher_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(bin) = std::env::var_os("XDISTILL_TEACHER_BIN") {
                return PathBuf::from(bin);
            }
            let exe = std::env::current_exe().expect("current exe");
            // target/PROFILE/deps/test-HASH -> target/PROFILE
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target dir")
                .to_path_buf();
            let bin = profile_dir.join(format!("teacher{}", std::env::consts::EXE_SUFFIX));
            let release = profile_dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let root = Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("workspace root");
            let mut cmd = Command::new(cargo);
            cmd.current_dir(root).args([
                "build",
                "-q",
                "-p",
                "xdistill-server",
                "--bin",
                "teacher",
            ]);
            if release {
                cmd.arg("--release");
            }
            if let Some(target) = profile_dir.parent() {
                cmd.arg("--target-dir").arg(target);
            }
            let status = cmd.status().expect("running cargo build for the teacher");
            assert!(status.success(), "building the teacher binary failed");
            assert!(bin.is_file(), "no teacher binary at {}", bin.display());
            bin
        })
        .clone()
}

/// Every id and value of a sequence's scores as bits, in a fixed order: equal vectors mean a
/// bit-identical answer (f32 equality would hide -0.0 vs 0.0 and NaN).
pub fn score_bits(s: &xdistill_shared::protocol::SequenceScores) -> Vec<u32> {
    let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    [
        s.topk_ids.clone(),
        f(&s.topk_values),
        f(&s.target_logprobs),
        f(&s.logsumexp),
        f(&s.ids_logprobs),
    ]
    .concat()
}
