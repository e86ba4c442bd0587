//! Teacher replicas behind a real load balancer: three `teacher` processes on loopback behind
//! HAProxy running the repository's `docker/haproxy.cfg` (only its addresses changed), driven by
//! the trainer's own client. Cache affinity (a repeated request is answered by one replica's
//! cache), failover (`kill -9` of the replica that owns a request), and the restarted replica
//! receiving its requests again. Needs `haproxy` (scripts/install-haproxy.sh, which
//! scripts/test.sh runs); without it each test is skipped with one line, except under `CI=true`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use xdistill_shared::protocol::{TopkRequest, TopkResponse, ValuesKind};
use xdistill_testkit::free_port;
use xdistill_testkit::http_status as get_status;
use xdistill_trainer::client::{ClientOptions, TeacherClient};

/// A child process killed (SIGKILL) on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn teacher_on(model: &Path, port: u16) -> Proc {
    let child = Command::new(xdistill_testkit::teacher_binary())
        .arg("--model")
        .arg(model)
        .args(["--port", &port.to_string()])
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn teacher");
    let p = Proc(child);
    let url = format!("http://127.0.0.1:{port}/health");
    wait_for("teacher healthy", Duration::from_secs(60), || {
        get_status(&url).ok() == Some(200)
    });
    p
}

/// `docker/haproxy.cfg` with its front port and its upstreams moved to loopback.
fn haproxy_config(front: u16, replicas: &[u16], stats: &Path) -> String {
    let path = xdistill_testkit::repo_root().join("docker/haproxy.cfg");
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains("bind :8000") && text.contains("server-template teacher"));
    assert!(text.lines().any(|l| l == "global"));
    text.lines()
        .map(|l| {
            let t = l.trim_start();
            if l == "global" {
                // A stats socket, so that the test can wait for the health checks' verdicts.
                format!(
                    "global\n    stats socket {} mode 600 level user",
                    stats.display()
                )
            } else if t == "bind :8000" {
                format!("    bind 127.0.0.1:{front}")
            } else if t.starts_with("server-template teacher") {
                replicas
                    .iter()
                    .enumerate()
                    .map(|(i, p)| format!("    server teacher{i} 127.0.0.1:{p} check"))
                    .collect::<Vec<_>>()
                    .join("\n")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn haproxy() -> PathBuf {
    which("haproxy")
        .expect("haproxy is not installed: run scripts/install-haproxy.sh (scripts/test.sh does)")
}

/// Whether HAProxy is here to run `test`. Without it the test is skipped with one line — except
/// under `CI=true`, where a missing HAProxy fails the run (CI's scripts install it).
fn haproxy_present(test: &str) -> bool {
    if which("haproxy").is_some() {
        return true;
    }
    let why = "haproxy is not installed (scripts/install-haproxy.sh installs it as root, or \
               `apt-get install haproxy`)";
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: {why}; CI=true requires it");
    }
    // Straight to the stream, past the test harness's capture: the skip shows in every run.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    false
}

/// `name` on `PATH`, or in the sbin folders a non-root user's `PATH` often lacks (Debian's
/// haproxy is `/usr/sbin/haproxy`).
fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"])
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found
}

/// `haproxy -c`: the configuration is valid.
fn check_config(file: &Path) {
    let out = Command::new(haproxy())
        .arg("-c")
        .arg("-f")
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// HAProxy running `docker/haproxy.cfg` (moved to loopback) in front of `replicas`, checked by
/// `haproxy -c` and started; returns it and its base URL once its health checks have marked
/// every replica up (a rise of 2 checks, 1 s apart) and it answers `/health`.
fn start_balancer(work: &Path, replicas: &[u16]) -> (Proc, String) {
    let front = free_port();
    let cfg = work.join("haproxy.cfg");
    let stats = work.join("haproxy.sock");
    std::fs::write(&cfg, haproxy_config(front, replicas, &stats)).unwrap();
    check_config(&cfg);
    let lb = Proc(
        Command::new(haproxy())
            .arg("-db")
            .arg("-f")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn haproxy"),
    );
    let base = format!("http://127.0.0.1:{front}");
    wait_for("every replica marked up", Duration::from_secs(30), || {
        replicas_up(&stats) == replicas.len()
    });
    assert_eq!(get_status(&format!("{base}/health")).ok(), Some(200));
    (lb, base)
}

/// Replicas of the `teachers` backend that HAProxy's health checks mark UP, from `show stat`
/// on its stats socket (CSV; 0 while the socket is not there yet).
fn replicas_up(stats: &Path) -> usize {
    use std::io::{Read, Write};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(stats) else {
        return 0;
    };
    let mut csv = String::new();
    if s.write_all(b"show stat\n").is_err() || s.read_to_string(&mut csv).is_err() {
        return 0;
    }
    let mut lines = csv.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .trim_start_matches("# ")
        .split(',')
        .collect();
    let col = |name: &str| header.iter().position(|&h| h == name);
    let (Some(px), Some(sv), Some(status)) = (col("pxname"), col("svname"), col("status")) else {
        return 0;
    };
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| {
            f.get(px) == Some(&"teachers")
                && f.get(sv).is_some_and(|s| s.starts_with("teacher"))
                && f.get(status) == Some(&"UP")
        })
        .count()
}

/// (cache hits, cache misses) of one replica.
fn cache_counts(port: u16) -> (f64, f64) {
    let text = plain_http::metrics(port);
    let get = |n: &str| xdistill_server::metrics::sample(&text, n).unwrap_or(0.0);
    (
        get("xdistill_cache_hits_total"),
        get("xdistill_cache_misses_total"),
    )
}

/// A tiny blocking GET of `/metrics` (std only; the test's async client is busy elsewhere).
mod plain_http {
    use std::io::{Read, Write};
    pub fn metrics(port: u16) -> String {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        buf.split_once("\r\n\r\n")
            .map(|x| x.1.to_string())
            .unwrap_or_default()
    }
}

fn same_bits(a: &TopkResponse, b: &TopkResponse) -> bool {
    a.results.len() == b.results.len()
        && a.results
            .iter()
            .zip(&b.results)
            .all(|(x, y)| x.bits() == y.bits())
}

fn request(sequences: Vec<Vec<u32>>, k: usize) -> TopkRequest {
    TopkRequest {
        sequences,
        k,
        temperature: 1.0,
        start: 0,
        starts: None,
        values: ValuesKind::Logprobs,
        ids: None,
    }
}

/// Deterministic pseudo-random ids below `vocab`.
fn ids(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15).wrapping_add(1);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_behind_haproxy_affinity_failover_restart() {
    if !haproxy_present("replicas_behind_haproxy_affinity_failover_restart") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    // A tiny random model (hidden 32, 2 layers) with a real tokenizer; spread logits (std 0.1).
    let dir =
        xdistill_testkit::models::model(work.path(), "llama", "llama", "llama2", 32, 2, 0.1, 7);
    // 1. The repository's config is valid as shipped, and with loopback addresses.
    check_config(&xdistill_testkit::repo_root().join("docker/haproxy.cfg"));
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut replicas: Vec<Option<Proc>> =
        ports.iter().map(|&p| Some(teacher_on(&dir, p))).collect();
    let (_lb, base) = start_balancer(work.path(), &ports);
    let client = TeacherClient::new(
        vec![base.parse().unwrap()],
        ClientOptions {
            max_wait: Duration::from_secs(60),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            ..ClientOptions::default()
        },
    )
    .unwrap();

    // 2. Affinity: 6 different requests, each sent 3 times. Each is computed once (one miss),
    // its repeats answered by the same replica's cache.
    let v = 32_000;
    let reqs: Vec<_> = (0..6)
        .map(|i| request(vec![ids(40 + i, 12, v), ids(90 + i, 7, v)], 4))
        .collect();
    let mut first = Vec::new();
    for r in &reqs {
        let a = client.topk(r).await.expect("through the balancer");
        for _ in 0..2 {
            let b = client.topk(r).await.unwrap();
            assert!(same_bits(&a, &b));
        }
        first.push(a);
    }
    let counts: Vec<(f64, f64)> = ports.iter().map(|&p| cache_counts(p)).collect();
    let (hits, misses) = counts
        .iter()
        .fold((0.0, 0.0), |(h, m), &(a, b)| (h + a, m + b));
    // Two sequences per request: 12 misses and 24 hits when every repeat met its cache.
    assert_eq!((misses, hits), (12.0, 24.0), "per replica: {counts:?}");

    // 3. Failover: the replica that owns request 0 is killed; the request is answered by
    // another replica, bit-identical (scores are batch-invariant and deterministic).
    let owner = |counts_before: &[(f64, f64)]| -> usize {
        ports
            .iter()
            .enumerate()
            .find(|&(i, &p)| cache_counts(p).0 > counts_before[i].0)
            .map(|(i, _)| i)
            .expect("some replica answered")
    };
    let before: Vec<(f64, f64)> = ports.iter().map(|&p| cache_counts(p)).collect();
    client.topk(&reqs[0]).await.unwrap();
    let victim = owner(&before);
    drop(replicas[victim].take()); // SIGKILL
    let again = client.topk(&reqs[0]).await.expect("failover");
    assert!(
        same_bits(&first[0], &again),
        "another replica answered differently"
    );
    let survivors: f64 = ports
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != victim)
        .map(|(_, &p)| cache_counts(p).1)
        .sum();
    assert!(
        survivors
            > counts
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != victim)
                .map(|(_, c)| c.1)
                .sum::<f64>()
    );

    // 4. Restart: the replica comes back on its port; once the health checks see it, consistent
    // hashing sends request 0 back to it (a miss there: its cache is new).
    replicas[victim] = Some(teacher_on(&dir, ports[victim]));
    let t0 = Instant::now();
    loop {
        let r = client.topk(&reqs[0]).await.unwrap();
        assert!(same_bits(&first[0], &r));
        if cache_counts(ports[victim]).1 > 0.0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the restarted replica never got its requests back"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `metrics.jsonl`'s training steps, in the order they were logged.
fn logged_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["split"] == "train")
        .filter_map(|v| v["step"].as_u64())
        .collect()
}

/// `trainer off-policy --config CONFIG` as a child process, without the held-out measurements
/// (nothing here reads them; they would only delay the first step and the end).
fn trainer_run(config: &Path) -> Child {
    Command::new(xdistill_testkit::trainer_binary())
        .args(["off-policy", "--config"])
        .arg(config)
        .args(["--set", "distillation.val_at_start=false"])
        .args(["--set", "distillation.val_at_end=false"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn trainer")
}

/// Two trainers — one on the teacher's tokenizer, one on another (projected KL) — train through
/// HAProxy in front of three replicas; one replica is killed (`kill -9`) in the middle of both
/// runs. Both finish, every step is logged exactly once, and the final weights are bit-identical
/// to runs against a single teacher where nothing died (the answers are deterministic wherever
/// they are computed, and the client retries what the dead replica dropped).
#[test]
fn two_trainers_finish_through_a_replica_kill_with_identical_weights() {
    if !haproxy_present("two_trainers_finish_through_a_replica_kill_with_identical_weights") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let teacher = xdistill_testkit::models::token_driven_teacher(w, "llama", "llama2", 11);
    let same = xdistill_testkit::models::model(w, "same", "qwen3", "llama2", 32, 2, 0.02, 12);
    let cross = xdistill_testkit::models::model(w, "cross", "llama", "qwen3", 32, 2, 0.02, 13);
    // Steps per run: the cross-tokenizer run's steps cost several of the other's (Qwen3's
    // vocabulary, the projection). It starts first; the kill comes when both have logged 2
    // steps, which finds the other 4–7 steps in on 2 cores: both mid-run.
    let runs = [
        (&same, r#"kd = { type = "forward_kl" }"#, 16u64),
        (&cross, r#"kd = { type = "pkl" }"#, 8u64),
    ];
    // Config files (written by `config`) for a teacher URL and an output directory.
    let configs = |url: &str, tag: &str| -> Vec<(PathBuf, PathBuf)> {
        runs.iter()
            .enumerate()
            .map(|(i, (student, loss, steps))| {
                let out = w.join(format!("{tag}-{i}"));
                xdistill_tests::distill::config(w, student, url, &out, *steps, loss);
                (w.join(format!("{tag}-{i}.toml")), out)
            })
            .collect()
    };

    // 1. The reference: one teacher, nothing dies.
    let reference = {
        let port = free_port();
        let _t = teacher_on(&teacher, port);
        let cfgs = configs(&format!("http://127.0.0.1:{port}"), "reference");
        let mut children: Vec<Child> = cfgs.iter().map(|(c, _)| trainer_run(c)).collect();
        for (child, (_, out)) in children.iter_mut().zip(&cfgs) {
            let status = child.wait().unwrap();
            assert!(status.success(), "reference run {}", out.display());
        }
        cfgs
    };

    // 2. Three replicas behind HAProxy; both trainers through it; one replica killed mid-run.
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut replicas: Vec<Option<Proc>> = ports
        .iter()
        .map(|&p| Some(teacher_on(&teacher, p)))
        .collect();
    let (_lb, base) = start_balancer(w, &ports);
    let cfgs = configs(&base, "balanced");
    // The cross-tokenizer run sets up longer (the teacher's tokenizer, the projection): start it
    // first, the other once it is stepping, so the kill finds both in the middle of their runs.
    let mut children = vec![trainer_run(&cfgs[1].0)];
    wait_for(
        "the cross-tokenizer run under way",
        Duration::from_secs(120),
        || !logged_steps(&cfgs[1].1).is_empty(),
    );
    children.insert(0, trainer_run(&cfgs[0].0));
    // Kill the replica that has computed the most once both runs are a few steps in.
    wait_for("both runs under way", Duration::from_secs(120), || {
        cfgs.iter().all(|(_, out)| logged_steps(out).len() >= 2)
    });
    let busiest = (0..ports.len())
        .max_by(|&a, &b| {
            cache_counts(ports[a])
                .1
                .total_cmp(&cache_counts(ports[b]).1)
        })
        .unwrap();
    drop(replicas[busiest].take()); // SIGKILL
    let at_kill: Vec<usize> = cfgs
        .iter()
        .map(|(_, out)| logged_steps(out).len())
        .collect();
    let steps: Vec<u64> = runs.iter().map(|r| r.2).collect();
    eprintln!("replica {busiest} killed with the runs at steps {at_kill:?} of {steps:?}");
    assert!(
        at_kill.iter().zip(&steps).all(|(&n, &of)| n < of as usize),
        "a run ended before the kill: {at_kill:?} of {steps:?}"
    );
    for (child, (_, out)) in children.iter_mut().zip(&cfgs) {
        let status = child.wait().unwrap();
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        assert!(status.success(), "{}: {err}", out.display());
    }

    // 3. Every step once, and the weights of the runs where nothing died.
    for (((_, out), (_, ref_out)), &steps) in cfgs.iter().zip(&reference).zip(&steps) {
        assert_eq!(
            logged_steps(out),
            (1..=steps).collect::<Vec<u64>>(),
            "{}",
            out.display()
        );
        let got = std::fs::read(out.join("final/model.safetensors")).unwrap();
        let want = std::fs::read(ref_out.join("final/model.safetensors")).unwrap();
        assert!(
            got == want,
            "{}: weights differ from the reference run",
            out.display()
        );
    }
    // The survivors took over the dead replica's share.
    let survivors: f64 = (0..ports.len())
        .filter(|&i| i != busiest)
        .map(|i| cache_counts(ports[i]).1)
        .sum();
    assert!(survivors > 0.0);
}
