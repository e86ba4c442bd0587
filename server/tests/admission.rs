//! A shared teacher is bounded before it works (issue 33), as its process's memory shows:
//! - bodies are read by what arrives: connections that declare 64 MiB bodies and send one byte
//!   cost what arrived, and a declared length over `--max-body-bytes` is a 413 at once;
//! - the compatible routes count their inputs as they read them: a 60 MiB body of one-token
//!   prompts and a 16 MiB text are refused (413, naming the limit) with the high-water mark of
//!   the teacher's memory barely moving.
//!
//! Memory is read from `/proc/PID/status` (VmHWM, the peak resident set; VmRSS; VmSize).

use crate::common;

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A field of `/proc/PID/status` in bytes (`VmHWM`, `VmRSS`, `VmSize`).
fn vm(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key}"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("a number of kB");
    kb * 1024
}

fn addr(t: &common::Teacher) -> String {
    t.base.trim_start_matches("http://").to_string()
}

/// Status and JSON body of the answer on `s` (read to the end of the connection).
fn answer(s: &mut TcpStream) -> (u16, Value) {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |b| b.1);
    let v = serde_json::from_str(body).unwrap_or_else(|_| panic!("no JSON body: {text:?}"));
    (status, v)
}

async fn post(t: &common::Teacher, path: &str, body: Vec<u8>) -> (u16, Value) {
    let r = common::client()
        .post(t.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.expect("a JSON body"))
}

async fn served(t: &common::Teacher) {
    let (status, body) = post(
        t,
        "/v1/completions",
        serde_json::to_vec(&json!({"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 2}))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// 300 connections each declare a 64 MiB body and send one byte: the teacher's memory grows by
/// what arrived (before: a 64 MiB buffer each, 19 GB of address space for 300). A declared
/// length over the limit is refused before a byte of body is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_huge_bodies_cost_what_arrives() {
    let dir = common::tiny_model("admission-llama", "llama", "llama2", 1);
    let t = common::start_teacher(&dir, &["--min-body-rate", "0"]);
    served(&t).await;
    let (size0, rss0) = (vm(t.pid, "VmSize"), vm(t.pid, "VmRSS"));
    let head = format!(
        "POST /topk_logits HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{{",
        64 * MIB
    );
    let held: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = TcpStream::connect(addr(&t)).expect("connect");
            s.write_all(head.as_bytes()).expect("write");
            s
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    served(&t).await;
    let (size1, rss1) = (vm(t.pid, "VmSize"), vm(t.pid, "VmRSS"));
    eprintln!(
        "300 declared 64 MiB bodies: VmSize {} -> {} MiB, VmRSS {} -> {} MiB",
        size0 / MIB,
        size1 / MIB,
        rss0 / MIB,
        rss1 / MIB
    );
    assert!(size1 < size0 + 2048 * MIB, "VmSize {size0} -> {size1}");
    assert!(rss1 < rss0 + 200 * MIB, "VmRSS {rss0} -> {rss1}");
    drop(held);

    // Over --max-body-bytes (64 MiB by default): 413 before the body is sent.
    let mut s = TcpStream::connect(addr(&t)).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        64 * MIB + 1
    )
    .unwrap();
    let (status, body) = answer(&mut s);
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["type"], "payload_too_large", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&(64 * MIB).to_string()),
        "{body}"
    );
    served(&t).await;
}

/// The compatible routes refuse what cannot be admitted while reading it: a 60 MiB body of
/// one-token prompts (413 `too_many_sequences`, naming `prompt` and the limit) and 16 MiB texts
/// (413 `input_too_large`) leave the teacher's peak memory within a few body sizes (before:
/// 290 MB → 4.3 GB for 64 MiB of prompts, +1 GB and 8 s of CPU for a 16 MB text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_bodies_are_counted_before_work() {
    let dir = common::tiny_model("admission-llama", "llama", "llama2", 1);
    let t = common::start_teacher(&dir, &[]);
    served(&t).await;
    let hwm0 = vm(t.pid, "VmHWM");

    // 1. 60 MiB of one-token prompts (about 15.7 million of them).
    let n = (60 * MIB / 4) as usize;
    let mut body = String::with_capacity(60 * MIB as usize + 64);
    body.push_str("{\"max_tokens\": 1, \"prompt_logprobs\": 1, \"prompt\": [");
    for i in 0..n {
        body.push_str(if i == 0 { "[1]" } else { ",[1]" });
    }
    body.push_str("]}");
    let t0 = std::time::Instant::now();
    let (status, err) = post(&t, "/v1/completions", body.into_bytes()).await;
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["type"], "too_many_sequences", "{err}");
    assert_eq!(err["error"]["param"], "prompt", "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("{n} sequences exceed --max-sequences 16384")),
        "{msg}"
    );
    let hwm1 = vm(t.pid, "VmHWM");
    eprintln!(
        "60 MiB of one-token prompts: 413 in {secs:.2} s, VmHWM {} -> {} MiB",
        hwm0 / MIB,
        hwm1 / MIB
    );
    assert!(hwm1 < hwm0 + 400 * MIB, "VmHWM {hwm0} -> {hwm1}");

    // 2. A 16 MiB text on each text route: refused before tokenization.
    let text = "a".repeat(16 * MIB as usize);
    for (path, body, field) in [
        (
            "/v1/completions",
            json!({"prompt": text, "max_tokens": 1}),
            "prompt",
        ),
        ("/tokenize", json!({"prompt": text}), "prompt"),
        ("/generate", json!({"text": [text]}), "text[0]"),
    ] {
        let t0 = std::time::Instant::now();
        let (status, err) = post(&t, path, serde_json::to_vec(&body).unwrap()).await;
        assert_eq!(status, 413, "{path}: {err}");
        assert_eq!(err["error"]["type"], "input_too_large", "{path}: {err}");
        assert_eq!(err["error"]["param"], field, "{path}: {err}");
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(msg.contains("text of 16777216 bytes"), "{msg}");
        assert!(t0.elapsed() < Duration::from_secs(10), "{path}");
    }
    let hwm2 = vm(t.pid, "VmHWM");
    eprintln!(
        "16 MiB texts on three routes: VmHWM {} -> {} MiB",
        hwm1 / MIB,
        hwm2 / MIB
    );
    assert!(hwm2 < hwm0 + 400 * MIB, "VmHWM {hwm0} -> {hwm2}");

    // 3. /generate's ids are counted too; the server goes on serving.
    let ids: Vec<Vec<u32>> = vec![vec![1]; 20_000];
    let (status, err) = post(
        &t,
        "/generate",
        serde_json::to_vec(&json!({"input_ids": ids})).unwrap(),
    )
    .await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["param"], "input_ids", "{err}");
    // /detokenize: at most --max-queue-tokens ids (262,144 by default), so its text is bounded.
    let ids = vec![1u32; 300_000];
    let (status, err) = post(
        &t,
        "/detokenize",
        serde_json::to_vec(&json!({"tokens": ids})).unwrap(),
    )
    .await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["type"], "input_too_large", "{err}");
    assert_eq!(err["error"]["param"], "tokens", "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("300000 token ids exceed --max-queue-tokens 262144"));
    served(&t).await;
}

/// `--max-answer-bytes` counts the answer as the route sends it, estimated before scoring: a
/// vLLM or SGLang request whose scores fit but whose JSON would not is a 413 `answer_too_large`
/// naming the route's input field; the native route refuses in JSON what it sends in
/// MessagePack; and an admitted answer's real size is near its estimate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_counted_as_sent() {
    let dir = common::tiny_model("admission-llama", "llama", "llama2", 1);
    let t = common::start_teacher(
        &dir,
        &["--max-seq-len", "64", "--max-answer-bytes", "1000000"],
    );
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| common::ids(i, 60, 32_000)).collect();

    // vLLM: 4 × 59 positions × 201 entries: 380 kB of scores, about 3.4 MB of JSON.
    let big = json!({"prompt": prompts, "max_tokens": 0, "prompt_logprobs": 200});
    let (status, err) = post(&t, "/v1/completions", serde_json::to_vec(&big).unwrap()).await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["type"], "answer_too_large", "{err}");
    assert_eq!(err["error"]["param"], "prompt", "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("of JSON, over --max-answer-bytes 1000000"),
        "{msg}"
    );
    let estimate: u64 = msg
        .split_whitespace()
        .nth(4)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no estimate in {msg}"));

    // The same at prompt_logprobs 20: admitted; its real size is near the estimate's scale.
    let small = json!({"prompt": prompts, "max_tokens": 0, "prompt_logprobs": 20});
    let r = common::client()
        .post(t.url("/v1/completions"))
        .json(&small)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let sent = r.bytes().await.unwrap().len() as u64;
    let scaled = estimate * 21 / 201;
    eprintln!("vLLM JSON: estimate {scaled} bytes (from {estimate} at k=200), sent {sent}");
    assert!(sent <= 1_000_000, "{sent}");
    assert!(
        sent > scaled / 3 && sent < scaled * 2,
        "sent {sent}, estimate {scaled}"
    );

    // Native: k = 200 fits in MessagePack (380 kB of scores) but not in JSON (~1.5 MB).
    let native = json!({"sequences": prompts, "k": 200});
    let (status, err) = post(&t, "/topk_logits", serde_json::to_vec(&native).unwrap()).await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["param"], "sequences", "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("of JSON"));
    let r = common::client()
        .post(t.url("/topk_logits"))
        .header("accept", "application/msgpack")
        .json(&native)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // SGLang: 4 × 60 positions × 201 triples, about 1.7 MB of JSON; at 20 it is admitted.
    let sglang = |n: u32| {
        json!({"input_ids": prompts, "return_logprob": true, "logprob_start_len": 0,
               "top_logprobs_num": n})
    };
    let (status, err) = post(&t, "/generate", serde_json::to_vec(&sglang(200)).unwrap()).await;
    assert_eq!(status, 413, "{err}");
    assert_eq!(err["error"]["type"], "answer_too_large", "{err}");
    assert_eq!(err["error"]["param"], "input_ids", "{err}");
    let (status, body) = post(&t, "/generate", serde_json::to_vec(&sglang(20)).unwrap()).await;
    assert_eq!(status, 200, "{body}");
}
