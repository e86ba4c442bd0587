//! Load benchmark of a running `teacher` (prints figures; not a test).
//!
//! ```text
//! cargo run --release -p xdistill-server --example teacher-bench -- --url http://127.0.0.1:8000
//! ```
//!
//! Reports scored positions per second and latency percentiles with N concurrent clients, the
//! wire size per position in JSON and MessagePack, the share of wall time the worker spends
//! outside the model forward (from the server's `/metrics`), and cache hit vs miss latency.
//!
//! With `--routes 8,20,64` it instead compares the vLLM-compatible `/v1/completions`
//! (`prompt_logprobs: k`, JSON) with the native `/topk_logits` (MessagePack) on the same
//! requests, one at a time: server time per position (from the server's request-duration
//! histogram), where it goes (forward, LM head, top-k, device-to-host copy, encoding, the rest:
//! HTTP and JSON parsing) and bytes per
//! position. Run the teacher with `--cache-bytes 0` for it, so both routes compute every answer.

use anyhow::{bail, Context, Result};
use clap::Parser;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};
use xdistill_server::metrics::sample;
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{InfoResponse, TopkRequest, ValuesKind};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Base URL of the teacher.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Requests per client.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Sequences per request.
    #[arg(long, default_value_t = 4)]
    sequences: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    #[arg(long, default_value_t = 64)]
    k: usize,
    #[arg(long)]
    api_key: Option<String>,
    /// Seed of the random sequences (default: from the clock, so a rerun misses the cache).
    #[arg(long)]
    seed: Option<u64>,
    /// Compare the routes at these k instead (e.g. `8,20,64`): `--requests` requests per
    /// round, `--rounds` rounds alternating which route goes first.
    #[arg(long, value_delimiter = ',')]
    routes: Option<Vec<usize>>,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

struct Bench {
    args: Args,
    http: reqwest::Client,
    vocab: usize,
}

impl Bench {
    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.get(format!("{}{path}", self.args.url));
        match &self.args.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    fn random_request(&self, rng: &mut impl Rng) -> TopkRequest {
        let sequences = (0..self.args.sequences)
            .map(|_| {
                (0..self.args.seq_len)
                    .map(|_| rng.random_range(0..self.vocab as u32))
                    .collect()
            })
            .collect();
        TopkRequest {
            sequences,
            k: self.args.k,
            temperature: 1.0,
            start: 0,
            starts: None,
            values: ValuesKind::Logprobs,
            ids: None,
        }
    }

    /// Sends `req`, returns (latency, response bytes, scored rows).
    async fn send(&self, req: &TopkRequest, format: Format) -> Result<(Duration, usize, usize)> {
        let body = codec::encode_request(Format::Msgpack, req)?;
        let t0 = Instant::now();
        let mut r = self
            .http
            .post(format!("{}/topk_logits", self.args.url))
            .header("content-type", codec::MSGPACK)
            .header("accept", format.content_type())
            .body(body);
        if let Some(k) = &self.args.api_key {
            r = r.bearer_auth(k);
        }
        let resp = r.send().await?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        let dt = t0.elapsed();
        if !status.is_success() {
            bail!("{status}: {}", String::from_utf8_lossy(&bytes));
        }
        let decoded = codec::decode_response(format, &bytes)?;
        let rows = decoded.results.iter().map(|s| s.rows).sum();
        Ok((dt, bytes.len(), rows))
    }

    async fn metrics(&self) -> Result<String> {
        Ok(self.get("/metrics").send().await?.text().await?)
    }

    /// Sends `req` to `/v1/completions` as vLLM's clients do (token-id prompts,
    /// `prompt_logprobs: k`, `max_tokens: 0`); returns the response bytes.
    async fn send_completions(&self, req: &TopkRequest) -> Result<usize> {
        let body = serde_json::json!({
            "prompt": req.sequences,
            "max_tokens": 0,
            "prompt_logprobs": req.k,
            "temperature": req.temperature,
        });
        let mut r = self
            .http
            .post(format!("{}/v1/completions", self.args.url))
            .json(&body);
        if let Some(k) = &self.args.api_key {
            r = r.bearer_auth(k);
        }
        let resp = r.send().await?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        if !status.is_success() {
            bail!("{status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(bytes.len())
    }
}

/// The server's time by phase between two reads of `/metrics` (seconds; each phase ended by a
/// device synchronisation on a GPU, so a GPU's figures are where the time went).
#[derive(Default, Clone, Copy)]
struct Phases {
    /// Decoder layers.
    forward: f64,
    /// LM-head matmul.
    head: f64,
    /// Top-k and log-softmax statistics.
    topk: f64,
    /// Device to host.
    copy: f64,
    /// Answers to wire bytes.
    encode: f64,
}

impl Phases {
    fn between(before: &str, after: &str) -> Phases {
        let delta = |name: &str| -> f64 {
            sample(after, name).unwrap_or(0.0) - sample(before, name).unwrap_or(0.0)
        };
        Phases {
            forward: delta("xdistill_batch_forward_duration_seconds_sum"),
            head: delta("xdistill_batch_head_duration_seconds_sum"),
            topk: delta("xdistill_batch_topk_duration_seconds_sum"),
            copy: delta("xdistill_batch_copy_duration_seconds_sum"),
            encode: delta("xdistill_response_encode_duration_seconds_sum"),
        }
    }

    fn add(&mut self, o: Phases) {
        self.forward += o.forward;
        self.head += o.head;
        self.topk += o.topk;
        self.copy += o.copy;
        self.encode += o.encode;
    }

    /// Every phase, in a request's order.
    fn all(&self) -> [f64; 5] {
        [self.forward, self.head, self.topk, self.copy, self.encode]
    }

    fn total(&self) -> f64 {
        self.all().iter().sum()
    }
}

/// Totals of one route over a set of requests.
#[derive(Default)]
struct RouteTotals {
    /// Server seconds: request durations.
    server: f64,
    /// Where they went.
    phases: Phases,
    wall: f64,
    positions: usize,
    bytes: usize,
}

impl RouteTotals {
    fn per_position_ms(&self, x: f64) -> f64 {
        x * 1e3 / self.positions.max(1) as f64
    }
}

/// The route comparison (`--routes`): the same requests through both routes, one at a time.
async fn compare_routes(b: &Bench, ks: &[usize], rng: &mut impl Rng) -> Result<()> {
    println!("| k | route | server ms / position | forward / head / top-k / copy / encode / rest (ms / position) | positions/s | bytes / position |");
    println!("|---|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for &k in ks {
        let mut reqs: Vec<TopkRequest> = (0..b.args.requests)
            .map(|_| b.random_request(rng))
            .collect();
        for r in &mut reqs {
            r.k = k;
        }
        // [native, compatible]
        let mut totals = [RouteTotals::default(), RouteTotals::default()];
        for round in 0..b.args.rounds.max(1) {
            for which in [round % 2, 1 - round % 2] {
                let before = b.metrics().await?;
                let t0 = Instant::now();
                let t = &mut totals[which];
                for req in &reqs {
                    t.bytes += if which == 0 {
                        b.send(req, Format::Msgpack).await?.1
                    } else {
                        b.send_completions(req).await?
                    };
                    t.positions += req.sequences.iter().map(|s| s.len() - 1).sum::<usize>();
                }
                t.wall += t0.elapsed().as_secs_f64();
                let after = b.metrics().await?;
                let delta = |name: &str| -> f64 {
                    sample(&after, name).unwrap_or(0.0) - sample(&before, name).unwrap_or(0.0)
                };
                if delta("xdistill_cache_hits_total") > 0.0 {
                    bail!("the teacher answered from its cache: run it with --cache-bytes 0");
                }
                t.server += delta("xdistill_request_duration_seconds_sum");
                t.phases.add(Phases::between(&before, &after));
            }
        }
        for (t, name) in totals
            .iter()
            .zip(["/topk_logits (msgpack)", "/v1/completions (JSON)"])
        {
            println!(
                "| {k} | {name} | {:.3} | {} / {:.3} | {:.0} | {:.1} |",
                t.per_position_ms(t.server),
                t.phases
                    .all()
                    .map(|x| format!("{:.3}", t.per_position_ms(x)))
                    .join(" / "),
                t.per_position_ms(t.server - t.phases.total()),
                t.positions as f64 / t.wall,
                t.bytes as f64 / t.positions.max(1) as f64
            );
        }
        ratios.push((k, totals[1].server / totals[0].server));
    }
    println!();
    for (k, r) in ratios {
        println!(
            "k = {k}: /v1/completions costs {r:.2}x the native route's server time per position"
        );
    }
    Ok(())
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    args.seed = Some(seed);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    let mut b = Bench {
        args: args.clone(),
        http,
        vocab: 0,
    };
    let info: InfoResponse = b
        .get("/v1/info")
        .send()
        .await
        .context("GET /v1/info (is the teacher running?)")?
        .error_for_status()?
        .json()
        .await?;
    b.vocab = info.vocab_size;
    let b = std::sync::Arc::new(b);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    println!(
        "teacher: {} vocab {} (LM head {}), {} on {}; k = {}, {} clients x {} requests x {} sequences x {} tokens, seed {seed}",
        info.architecture,
        info.vocab_size,
        info.logits_size,
        info.dtype,
        info.device,
        args.k,
        args.clients,
        args.requests,
        args.sequences,
        args.seq_len
    );

    // 1. Warm-up.
    b.send(&b.random_request(&mut rng), Format::Msgpack).await?;
    if let Some(ks) = &args.routes {
        return compare_routes(&b, ks, &mut rng).await;
    }

    // 2. Throughput and latency with N concurrent clients (fresh sequences: no cache hits).
    let before = b.metrics().await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let b = b.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(1 + c as u64));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for _ in 0..b.args.requests {
                let req = b.random_request(&mut rng);
                out.push(b.send(&req, Format::Msgpack).await?);
            }
            anyhow::Ok(out)
        }));
    }
    let mut lat = Vec::new();
    let mut rows = 0;
    for t in tasks {
        for (d, _, r) in t.await?? {
            lat.push(d);
            rows += r;
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let after = b.metrics().await?;
    lat.sort();
    let delta = |name: &str| -> f64 {
        sample(&after, name).unwrap_or(0.0) - sample(&before, name).unwrap_or(0.0)
    };
    let phases = Phases::between(&before, &after);
    let busy = delta("xdistill_batch_duration_seconds_sum");
    let batches = delta("xdistill_batch_forward_total");
    let seqs_per_batch = delta("xdistill_batch_sequences_sum") / batches.max(1.0);

    // 3. Wire size of one answer in each format.
    let req = b.random_request(&mut rng);
    let (_, json_bytes, r1) = b.send(&req, Format::Json).await?;
    let req = b.random_request(&mut rng);
    let (_, pack_bytes, r2) = b.send(&req, Format::Msgpack).await?;

    // 4. Cache: fresh requests (misses) vs repeats of one of them (hits).
    let mut misses = Vec::new();
    let mut hits = Vec::new();
    for _ in 0..5 {
        let req = b.random_request(&mut rng);
        misses.push(b.send(&req, Format::Msgpack).await?.0);
        for _ in 0..4 {
            hits.push(b.send(&req, Format::Msgpack).await?.0);
        }
    }
    misses.sort();
    hits.sort();
    let (miss, hit) = (percentile(&misses, 0.5), percentile(&hits, 0.5));

    println!();
    println!("| figure | value |");
    println!("|---|---|");
    println!("| requests | {} in {:.2} s |", lat.len(), wall);
    println!("| scored positions/s | {:.0} |", rows as f64 / wall);
    println!(
        "| latency p50 / p99 | {:.1} ms / {:.1} ms |",
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.99))
    );
    println!("| batches | {batches:.0} ({seqs_per_batch:.1} sequences each) |");
    let worker = phases.forward + phases.head + phases.topk + phases.copy;
    println!(
        "| worker: forward / head / top-k / copy / other | {} / {:.1}% of wall time |",
        [phases.forward, phases.head, phases.topk, phases.copy]
            .map(|x| format!("{:.1}%", 100.0 * x / wall))
            .join(" / "),
        100.0 * (busy - worker) / wall
    );
    println!(
        "| encoding answers | {:.1}% of wall time (summed over encoder threads) |",
        100.0 * phases.encode / wall
    );
    println!(
        "| share of server time outside the model (forward + head) | {:.1}% |",
        100.0 * (1.0 - (phases.forward + phases.head) / wall)
    );
    println!(
        "| JSON bytes per position | {:.1} ({:.2} per entry) |",
        json_bytes as f64 / r1 as f64,
        json_bytes as f64 / (r1 * args.k) as f64
    );
    println!(
        "| msgpack bytes per position | {:.1} ({:.2} per entry) |",
        pack_bytes as f64 / r2 as f64,
        pack_bytes as f64 / (r2 * args.k) as f64
    );
    println!(
        "| cache miss / hit p50 | {:.2} ms / {:.3} ms ({:.0}x) |",
        ms(miss),
        ms(hit),
        miss.as_secs_f64() / hit.as_secs_f64().max(1e-9)
    );
    Ok(())
}
