//! Test support: tiny random models made by `init-model`, a running `teacher`, an HTTP client,
//! and the f64 reference the server's answers are checked against.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};
use std::time::Duration;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::hf::ModelDir;
use xdistill_shared::model::{Decoder, Ops};
use xdistill_shared::process::TeacherProcess;
use xdistill_shared::protocol::{TopkRequest, TopkResponse, ValuesKind};

/// A tiny random model (hidden 32, 2 layers) with a real tokenizer, made once per directory.
/// `pad_to` pads the LM head beyond the tokenizer's vocabulary (rows the server must mask).
pub fn tiny_model(name: &str, arch: &str, tokenizer: &str, pad_to: usize) -> PathBuf {
    // Tests of one binary run on threads of one process: make each model once, in turn.
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // A test executable run away from its build tree (the GPU check) says where to write.
    let tmp = std::env::var_os("XDISTILL_TEST_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let out = tmp.join("teacher-models").join(name);
    if out.join("config.json").is_file() {
        return out;
    }
    xdistill_shared::init::init_model_dir(&xdistill_shared::init::InitSpec {
        arch: arch.into(),
        tokenizer: xdistill_shared::paths::tokenizer_json(tokenizer),
        hidden_size: 32,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate_size: 64,
        head_dim: None,
        pad_vocab_to: pad_to,
        max_position_embeddings: 256,
        tie_embeddings: false,
        // Large enough that logits are spread (few near-ties among the top k).
        init_std: 0.1,
        seed: 7,
        out: out.clone(),
        features: Default::default(),
    })
    .expect("init-model");
    out
}

/// A running `teacher` (see `xdistill_shared::process`).
pub type Teacher = TeacherProcess;

/// The `teacher` of this build, or `$XDISTILL_TEACHER_BIN` (a test executable run away from its
/// build tree, as in the GPU check).
pub fn teacher_bin() -> PathBuf {
    std::env::var_os("XDISTILL_TEACHER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_teacher")))
}

/// Starts this crate's `teacher` binary on `model` (port 0) and waits until it is healthy.
pub fn start_teacher(model: &Path, extra: &[&str]) -> Teacher {
    TeacherProcess::start(&teacher_bin(), model, extra).expect("starting the teacher")
}

/// The status code of a blocking `GET url` (std only).
pub fn get_status(url: &str) -> std::io::Result<u16> {
    xdistill_shared::process::http_status(url)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// The teacher's `GET /v1/info`.
pub async fn info(c: &reqwest::Client, t: &Teacher) -> xdistill_shared::protocol::InfoResponse {
    c.get(t.url("/v1/info"))
        .send()
        .await
        .expect("GET /v1/info")
        .json()
        .await
        .expect("an info body")
}

pub fn request(sequences: Vec<Vec<u32>>, k: usize) -> TopkRequest {
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

/// POSTs `req` in JSON (or msgpack), asks for `format`, decodes the answer.
pub async fn score(
    c: &reqwest::Client,
    t: &Teacher,
    req: &TopkRequest,
    format: Format,
) -> TopkResponse {
    let (status, body) = post(c, t, req, format).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    codec::decode_response(format, &body).expect("decode response")
}

pub async fn post(
    c: &reqwest::Client,
    t: &Teacher,
    req: &TopkRequest,
    format: Format,
) -> (u16, Vec<u8>) {
    let body = codec::encode_request(format, req).expect("encode");
    let r = c
        .post(t.url("/topk_logits"))
        .header("content-type", format.content_type())
        .header("accept", format.content_type())
        .body(body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    (status, r.bytes().await.expect("body").to_vec())
}

pub async fn metric(c: &reqwest::Client, t: &Teacher, name: &str) -> f64 {
    let text = c
        .get(t.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    xdistill_server::metrics::sample(&text, name).unwrap_or_else(|| panic!("no metric {name}"))
}

/// Polls `/metrics` until `name` equals `value` (at most 10 s).
pub async fn wait_for_metric(c: &reqwest::Client, t: &Teacher, name: &str, value: f64) {
    for _ in 0..1000 {
        if metric(c, t, name).await == value {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{name} never reached {value}");
}

/// The independent reference: the model loaded here, one sequence at a time (no batching, no
/// padding), full logits [S, V], log-softmax over the tokenizer's vocabulary in f64.
pub struct Reference {
    decoder: Decoder,
    vocab: usize,
}

impl Reference {
    pub fn load(dir: &Path) -> Reference {
        let md = ModelDir::open(dir).expect("open model");
        let vocab = md
            .load_tokenizer()
            .expect("tokenizer")
            .get_vocab_size(true)
            .min(md.config.vocab_size);
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(&md.weights, DType::F32, &Device::Cpu).expect("vb")
        };
        Reference {
            decoder: Decoder::new(&md.config, vb, Ops::Fused).expect("decoder"),
            vocab,
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Rows `start..S-1` of `(logits / t)[..vocab]` and their log-softmax, in f64.
    pub fn rows(&self, ids: &[u32], start: usize, t: f64) -> Vec<(Vec<f64>, Vec<f64>)> {
        let x = Tensor::new(ids, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = self.decoder.forward(&x).unwrap().squeeze(0).unwrap();
        let logits: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        logits[start..ids.len() - 1]
            .iter()
            .map(|row| {
                let y: Vec<f64> = row[..self.vocab].iter().map(|&v| v as f64 / t).collect();
                let m = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + y.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                let lp = y.iter().map(|v| v - lse).collect();
                (y, lp)
            })
            .collect()
    }

    /// Checks one sequence's answer against the reference to `tol`: every returned id carries
    /// its reference value, values descend, no better id was left out (ties allowed), the
    /// target log-prob and the logsumexp agree.
    pub fn check(
        &self,
        got: &xdistill_shared::protocol::SequenceScores,
        ids: &[u32],
        start: usize,
        t: f64,
        values: ValuesKind,
        tol: f64,
    ) {
        let rows = self.rows(ids, start, t);
        assert_eq!(got.rows, rows.len(), "row count");
        for (r, (y, lp)) in rows.iter().enumerate() {
            let vals = if values == ValuesKind::Logits { y } else { lp };
            let mut sorted = vals.clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
            let (gi, gv) = (got.ids_row(r), got.values_row(r));
            for j in 0..got.k {
                let id = gi[j] as usize;
                assert!(id < self.vocab, "row {r}: id {id} >= vocab {}", self.vocab);
                assert!(
                    (gv[j] as f64 - vals[id]).abs() < tol,
                    "row {r} entry {j}: id {id} value {} vs reference {}",
                    gv[j],
                    vals[id]
                );
                assert!(
                    (gv[j] as f64 - sorted[j]).abs() < tol,
                    "row {r} entry {j}: value {} but the reference's {j}-th largest is {}",
                    gv[j],
                    sorted[j]
                );
                if j > 0 {
                    assert!(gv[j] <= gv[j - 1], "row {r}: values not descending");
                    assert!(!gi[..j].contains(&gi[j]), "row {r}: duplicate id");
                }
            }
            let target = ids[start + r + 1] as usize;
            assert!((got.target_logprobs[r] as f64 - lp[target]).abs() < tol);
            let lse = y[0] - lp[0];
            assert!((got.logsumexp[r] as f64 - lse).abs() < tol * lse.abs().max(1.0));
        }
    }
}

/// Every id and value of a sequence's scores as bits (see `SequenceScores::bits`).
pub fn score_bits(s: &xdistill_shared::protocol::SequenceScores) -> Vec<u32> {
    s.bits()
}

/// Deterministic pseudo-random ids below `vocab`.
pub fn ids(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
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

/// `${VAR:-default}` → `default`, `${VAR}` → empty: compose with no such variable set.
pub fn compose_defaults(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let Some(j) = rest[i..].find('}') else { break };
        let inner = &rest[i + 2..i + j];
        out.push_str(inner.split_once(":-").map(|(_, d)| d).unwrap_or(""));
        rest = &rest[i + j + 1..];
    }
    out.push_str(rest);
    out
}
