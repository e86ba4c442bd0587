//! Support for tests that need a real `teacher` process on loopback (used by this crate's and the
//! trainer's integration tests; not part of the serving path).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `teacher`. It runs under a small shell guard that stops it (SIGTERM) when our end
/// of the guard's stdin closes, so a teacher never outlives the test process, even one in a static.
pub struct TeacherProcess {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The teacher's own pid (not the guard's).
    pub pid: u32,
    guard: Child,
    stdin: Option<ChildStdin>,
}

impl TeacherProcess {
    /// Starts `bin --model MODEL --port 0 EXTRA...` and waits until `/health` answers 200.
    pub fn start(bin: &Path, model: &Path, extra: &[&str]) -> TeacherProcess {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(
                r#""$0" "$@" & pid=$!; echo "pid $pid"; read _ignored; kill -TERM $pid; wait $pid"#,
            )
            .arg(bin)
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut guard = cmd.spawn().expect("spawn teacher");
        let stdin = guard.stdin.take();
        let (pid, base) = read_startup(guard.stdout.take().expect("stdout"));
        let t = TeacherProcess {
            base,
            pid,
            guard,
            stdin,
        };
        t.wait_healthy();
        t
    }

    fn wait_healthy(&self) {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(120) {
            if get_status(&format!("{}/health", self.base)).ok() == Some(200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("teacher at {} never became healthy", self.base);
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for TeacherProcess {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.guard.wait();
    }
}

/// Reads `pid N` (from the guard) and `listening on ADDR` (from the teacher).
fn read_startup(stdout: std::process::ChildStdout) -> (u32, String) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut pid, mut base) = (None, None);
    while pid.is_none() || base.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("teacher did not print its address");
        if let Some(p) = line.strip_prefix("pid ") {
            pid = p.trim().parse().ok();
        } else if let Some(a) = line.strip_prefix("listening on ") {
            base = Some(format!("http://{}", a.trim()));
        }
    }
    (pid.unwrap_or(0), base.unwrap_or_default())
}

/// Minimal blocking GET returning the status code (std only).
pub fn get_status(url: &str) -> std::io::Result<u16> {
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    buf.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad HTTP status line"))
}

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
