//! Starvation: connections that send nothing, half their headers or half their body cannot hold
//! the teacher, even at a low open-files limit (each test sets its own with `ulimit`). These run
//! the real `teacher` under `sh -c 'ulimit …; exec teacher …'` and talk to it over loopback.

mod common;

use common::get_status;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `teacher` started under a shell that first runs `limits` (e.g. `ulimit -n 128`); killed on
/// drop.
struct Limited {
    child: Child,
    addr: String,
}

impl Limited {
    fn start(model: &Path, limits: &str, extra: &[&str]) -> Limited {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!(r#"{limits} && exec "$0" "$@""#))
            .arg(common::teacher_bin())
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn teacher");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let addr = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("teacher printed no address");
            if let Some(a) = line.strip_prefix("listening on ") {
                break a.trim().to_string();
            }
        };
        let t = Limited { child, addr };
        let t0 = Instant::now();
        while get_status(&t.url("/health")).ok() != Some(200) {
            assert!(t0.elapsed() < Duration::from_secs(60), "never healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
        t
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Limited {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` connections: even ones send nothing, odd ones half of a request's headers.
fn loiter(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| {
            let mut s = TcpStream::connect(addr).expect("connect");
            if i % 2 == 1 {
                s.write_all(b"POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Le")
                    .expect("write");
            }
            s
        })
        .collect()
}

/// A normal request, answered within `within`.
async fn served(t: &Limited, within: Duration) {
    let t0 = Instant::now();
    let r = common::client()
        .post(t.url("/topk_logits"))
        .json(&serde_json::json!({"sequences": [[1, 2, 3]], "k": 2}))
        .send()
        .await
        .expect("the normal request got no answer");
    assert_eq!(r.status(), 200);
    assert!(t0.elapsed() < within, "answered after {:?}", t0.elapsed());
}

/// The server closed the connection: a read gives end-of-file (or a reset).
fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // e.g. an error answer before the close
            Err(e) => {
                return matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                )
            }
        }
    }
}

/// 300 loitering connections against a 128-descriptor teacher (more than it can hold): the
/// header timeout closes them, accepting goes on after EMFILE, and a normal request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loitering_connections_beyond_the_fd_limit_do_not_starve_requests() {
    let dir = common::tiny_model("starvation-llama", "llama", "llama2", 1);
    let t = Limited::start(&dir, "ulimit -n 128", &["--header-timeout-secs", "1"]);
    let mut idle = loiter(&t.addr, 300);
    served(&t, Duration::from_secs(30)).await;
    for s in idle.iter_mut().step_by(37) {
        assert!(closed_by_server(s), "a loitering connection was kept open");
    }
    served(&t, Duration::from_secs(10)).await;
}

/// The connection cap: with `--max-connections 8`, 40 loitering connections wait their turn
/// and time out, and a normal request still gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cap_queues_new_connections() {
    let dir = common::tiny_model("starvation-llama", "llama", "llama2", 1);
    let t = Limited::start(
        &dir,
        "true",
        &["--max-connections", "8", "--header-timeout-secs", "1"],
    );
    let _idle = loiter(&t.addr, 40);
    served(&t, Duration::from_secs(30)).await;
}

/// The soft open-files limit is raised to the hard one at start.
#[test]
fn soft_fd_limit_is_raised_to_the_hard_one() {
    let dir = common::tiny_model("starvation-llama", "llama", "llama2", 1);
    let t = Limited::start(&dir, "ulimit -Sn 64 && ulimit -Hn 2048", &[]);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", t.child.id())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("no open-files line");
    let nums: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(nums, ["2048", "2048"], "{line}");
}

/// A body that stops half-way gets 408 after `--body-timeout-secs`, and the server goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_body_times_out_with_408() {
    let dir = common::tiny_model("starvation-llama", "llama", "llama2", 1);
    let t = Limited::start(&dir, "true", &["--body-timeout-secs", "1"]);
    let mut s = TcpStream::connect(&t.addr).unwrap();
    s.write_all(
        b"POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"sequences\": ",
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t0 = Instant::now();
    let mut head = [0u8; 64];
    let n = s.read(&mut head).unwrap();
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    served(&t, Duration::from_secs(10)).await;
}
