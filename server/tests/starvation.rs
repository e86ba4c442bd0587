//! Starvation: connections that send nothing, half their headers or half their body cannot hold
//! the teacher, even at a low open-files limit (each test sets its own with `ulimit`). These run
//! the real `teacher` under `sh -c 'ulimit …; exec teacher …'` and talk to it over loopback.

use crate::common;

use crate::common::get_status;
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

/// `n` connections from this address that each start a 100 kB body and send one byte of it.
fn slow_bodies(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| {
            let mut s = TcpStream::connect(addr).ok()?;
            s.write_all(
                b"POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                  Content-Length: 100000\r\n\r\n{",
            )
            .ok()?;
            Some(s)
        })
        .collect()
}

/// How many of `n` normal requests from another client address (127.0.0.2) are answered 200
/// within `each` apiece.
async fn served_from_elsewhere(t: &Limited, n: usize, each: Duration) -> usize {
    let c = reqwest::Client::builder()
        .local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap())
        .timeout(each)
        .build()
        .unwrap();
    let mut ok = 0;
    for _ in 0..n {
        let r = c
            .post(t.url("/topk_logits"))
            .json(&serde_json::json!({"sequences": [[1, 2, 3]], "k": 2}))
            .send()
            .await;
        if r.is_ok_and(|r| r.status() == 200) {
            ok += 1;
        }
    }
    ok
}

/// Slow bodies cannot starve other clients: 100 connections from one address trickling their
/// bodies against a 64-connection teacher. Without a per-client cap or a minimum rate (the old
/// behaviour, `--max-connections-per-client 0 --min-body-rate 0`) they hold every slot for the
/// whole body timeout and no other client is served; with them, that client holds at most its
/// share (the rest get 503 `too_many_connections` and are closed), its slow bodies get 408
/// `body_too_slow` after the grace, and every normal request from another address is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_cannot_starve_other_clients() {
    let dir = common::tiny_model("starvation-llama", "llama", "llama2", 1);
    let common_flags = ["--max-connections", "64", "--body-timeout-secs", "60"];

    // Before: no per-client cap, no minimum rate.
    let mut flags = common_flags.to_vec();
    flags.extend(["--max-connections-per-client", "0", "--min-body-rate", "0"]);
    let t = Limited::start(&dir, "true", &flags);
    let held = slow_bodies(&t.addr, 100);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = served_from_elsewhere(&t, 5, Duration::from_secs(1)).await;
    drop(held);
    drop(t);

    // After: a share of 16 per client, bodies at least 1000 bytes/s after 1 s.
    let mut flags = common_flags.to_vec();
    flags.extend([
        "--max-connections-per-client",
        "16",
        "--min-body-rate",
        "1000",
        "--min-rate-grace-secs",
        "1",
    ]);
    let t = Limited::start(&dir, "true", &flags);
    let t0 = Instant::now();
    let mut held = slow_bodies(&t.addr, 100);
    let after = served_from_elsewhere(&t, 20, Duration::from_secs(5)).await;
    eprintln!(
        "100 slow bodies from one address, 64 slots: normal requests from another address \
         served: before {before}/5, after {after}/20 ({:.1} s)",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(before, 0, "the old behaviour should starve other clients");
    assert_eq!(after, 20);

    // The connections past the share were answered 503 and closed; the others 408 once the
    // grace had passed.
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    for s in held.iter_mut() {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out);
        let status = text.split_whitespace().nth(1).unwrap_or("none").to_string();
        if status == "503" {
            assert!(text.contains("too_many_connections"), "{text}");
        }
        if status == "408" {
            assert!(text.contains("body_too_slow"), "{text}");
        }
        *statuses.entry(status).or_default() += 1;
    }
    eprintln!(
        "slow connections answered: {statuses:?} in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(statuses.get("408"), Some(&16), "{statuses:?}");
    assert_eq!(statuses.get("503"), Some(&84), "{statuses:?}");
    assert!(t0.elapsed() < Duration::from_secs(30));
}

/// The listen backlog is sized to the connection cap (connections past the cap wait there), as
/// the kernel reports it for the listening socket (`ss -ltn`: Send-Q), up to `somaxconn`.
#[test]
fn listen_backlog_is_sized_to_the_connection_cap() {
    if Command::new("ss").arg("-V").output().is_err() {
        eprintln!("SKIPPED: ss (iproute2) is not installed");
        return;
    }
    let somaxconn: u64 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096);
    let dir = common::tiny_model("starvation-llama", "llama", "llama2", 1);
    let t = Limited::start(&dir, "true", &["--max-connections", "1000"]);
    let port = t.addr.rsplit(':').next().unwrap().to_string();
    let out = Command::new("ss")
        .args(["-ltnH", &format!("sport = :{port}")])
        .output()
        .expect("ss");
    let text = String::from_utf8_lossy(&out.stdout);
    let backlog: u64 = text
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no listening socket in {text:?}"));
    assert_eq!(backlog, 1000.min(somaxconn), "{text}");
}
