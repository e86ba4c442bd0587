//! A `teacher` server as a child process on loopback: what the demo runs and what the tests
//! start (through `xdistill_testkit`). It runs under a small shell guard that stops it (SIGTERM)
//! when our end of the guard's stdin closes, so a teacher never outlives the process that
//! started it.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a starting teacher may take to print its address, and then to answer `/health`.
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// A running `teacher`, stopped when dropped.
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
    pub fn start(bin: &Path, model: &Path, extra: &[&str]) -> std::io::Result<TeacherProcess> {
        let mut guard = Command::new("sh")
            .arg("-c")
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
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = guard.stdin.take();
        let stdout = guard.stdout.take();
        let mut t = TeacherProcess {
            base: String::new(),
            pid: 0,
            guard,
            stdin,
        };
        let stdout = stdout.ok_or_else(|| std::io::Error::other("no stdout pipe"))?;
        let (pid, base) = read_startup(stdout).map_err(|e| {
            let status = t.guard.try_wait().ok().flatten();
            std::io::Error::other(format!(
                "{e} (guard exit status: {status:?}); run {} --model {} to see why",
                bin.display(),
                model.display()
            ))
        })?;
        (t.pid, t.base) = (pid, base);
        t.wait_healthy()?;
        Ok(t)
    }

    fn wait_healthy(&self) -> std::io::Result<()> {
        let t0 = Instant::now();
        while t0.elapsed() < START_TIMEOUT {
            if http_status(&self.url("/health")).ok() == Some(200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(std::io::Error::other(format!(
            "the teacher at {} never became healthy",
            self.base
        )))
    }

    /// `base` + `path`.
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
fn read_startup(stdout: std::process::ChildStdout) -> Result<(u32, String), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut pid, mut base) = (None, None);
    let t0 = Instant::now();
    while pid.is_none() || base.is_none() {
        let left = START_TIMEOUT.saturating_sub(t0.elapsed());
        let line = rx
            .recv_timeout(left)
            .map_err(|_| "the teacher server did not report its address".to_string())?;
        if let Some(p) = line.strip_prefix("pid ") {
            pid = p.trim().parse().ok();
        } else if let Some(a) = line.trim().strip_prefix("listening on ") {
            base = Some(format!("http://{}", a.trim()));
        }
    }
    Ok((pid.unwrap_or(0), base.unwrap_or_default()))
}

/// Minimal blocking `GET` returning the status code (std only; `http://` URLs).
pub fn http_status(url: &str) -> std::io::Result<u16> {
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

/// A memory figure of a process from `/proc/PID/status` in MiB (`key`: `VmRSS`, `VmHWM` (the
/// high-water mark), `VmSize`); `pid` is a number or `self`. Linux only: an error elsewhere.
pub fn status_mib(pid: &str, key: &str) -> std::io::Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let missing = || std::io::Error::other(format!("{key} not in /proc/{pid}/status"));
    let kb: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(missing)?;
    Ok(kb / 1024.0)
}
