//! Prometheus text exposition (format 0.0.4) of the server's counters, gauges and histograms.
//!
//! Names follow `xdistill_{request,batch,queue,cache}_*`; durations are `_duration_seconds`
//! histograms, counters end in `_total`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

const SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const SEQUENCES: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
const TOKENS: &[f64] = &[
    16.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
];

/// A cumulative histogram with fixed bucket bounds.
pub struct Histogram {
    bounds: &'static [f64],
    /// (per-bucket counts incl. +Inf, sum, count)
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            state: Mutex::new((vec![0; bounds.len() + 1], 0.0, 0)),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        if let Ok(mut s) = self.state.lock() {
            s.0[i] += 1;
            s.1 += v;
            s.2 += 1;
        }
    }

    /// (sum, count) of all observations.
    pub fn totals(&self) -> (f64, u64) {
        self.state.lock().map(|s| (s.1, s.2)).unwrap_or((0.0, 0))
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let Ok(s) = self.state.lock() else { return };
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += s.0[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += s.0[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", s.1, s.2);
    }
}

/// The routes whose durations `xdistill_request_duration_seconds` observes: every route that
/// scores (native and compatible), so that benchmarks can compare them phase by phase.
pub const SCORING_ROUTES: &[&str] = &[
    xdistill_shared::protocol::TOPK_PATH,
    xdistill_shared::protocol::HIDDEN_PATH,
    "/v1/completions",
    "/generate",
];

/// Every metric the server exports.
pub struct Metrics {
    /// Finished requests by route and outcome label (`ok` or an error label).
    requests: Mutex<BTreeMap<(String, String), u64>>,
    pub request_duration: Histogram,
    /// Encoding answers (scores to wire bytes), per answer.
    pub response_encode_duration: Histogram,
    pub request_sequences: AtomicU64,
    /// Result rows returned (scored positions), cache hits included.
    pub tokens_scored: AtomicU64,
    pub batch_forwards: AtomicU64,
    pub batch_sequences: Histogram,
    pub batch_padded_tokens: Histogram,
    pub batch_forward_duration: Histogram,
    pub batch_head_duration: Histogram,
    pub batch_topk_duration: Histogram,
    pub batch_copy_duration: Histogram,
    pub batch_duration: Histogram,
    pub batch_cancelled: AtomicU64,
    pub queue_tokens: AtomicI64,
    pub queue_sequences: AtomicI64,
    pub queue_rejected: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub model_loaded: AtomicI64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            request_duration: Histogram::new(SECONDS),
            response_encode_duration: Histogram::new(SECONDS),
            request_sequences: AtomicU64::new(0),
            tokens_scored: AtomicU64::new(0),
            batch_forwards: AtomicU64::new(0),
            batch_sequences: Histogram::new(SEQUENCES),
            batch_padded_tokens: Histogram::new(TOKENS),
            batch_forward_duration: Histogram::new(SECONDS),
            batch_head_duration: Histogram::new(SECONDS),
            batch_topk_duration: Histogram::new(SECONDS),
            batch_copy_duration: Histogram::new(SECONDS),
            batch_duration: Histogram::new(SECONDS),
            batch_cancelled: AtomicU64::new(0),
            queue_tokens: AtomicI64::new(0),
            queue_sequences: AtomicI64::new(0),
            queue_rejected: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            model_loaded: AtomicI64::new(0),
        }
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: i64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

impl Metrics {
    pub fn record_request(&self, route: &str, outcome: &str, seconds: f64) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route.to_string(), outcome.to_string()))
                .or_default() += 1;
        }
        if SCORING_ROUTES.contains(&route) {
            self.request_duration.observe(seconds);
        }
    }

    /// The exposition text; `cache` is (entries, bytes).
    pub fn render(&self, cache: (u64, u64)) -> String {
        let mut o = String::with_capacity(8192);
        let _ = writeln!(
            o,
            "# HELP xdistill_request_total Finished HTTP requests by route and outcome.\n# TYPE xdistill_request_total counter"
        );
        if let Ok(m) = self.requests.lock() {
            for ((route, outcome), n) in m.iter() {
                let _ = writeln!(
                    o,
                    "xdistill_request_total{{route=\"{route}\",outcome=\"{outcome}\"}} {n}"
                );
            }
        }
        self.request_duration.render(
            &mut o,
            "xdistill_request_duration_seconds",
            "Wall time of /topk_logits requests, from body read to encoded answer, in seconds.",
        );
        self.response_encode_duration.render(
            &mut o,
            "xdistill_response_encode_duration_seconds",
            "Encoding time per scoring answer (JSON or MessagePack), in seconds.",
        );
        counter(
            &mut o,
            "xdistill_request_sequences_total",
            "Sequences received in valid /topk_logits requests.",
            self.request_sequences.load(Relaxed),
        );
        counter(
            &mut o,
            "xdistill_request_tokens_scored_total",
            "Positions (result rows) returned, cache hits included.",
            self.tokens_scored.load(Relaxed),
        );
        counter(
            &mut o,
            "xdistill_batch_forward_total",
            "Model forward passes (batches) run.",
            self.batch_forwards.load(Relaxed),
        );
        self.batch_sequences.render(
            &mut o,
            "xdistill_batch_sequences",
            "Sequences per forward batch.",
        );
        self.batch_padded_tokens.render(
            &mut o,
            "xdistill_batch_padded_tokens",
            "Padded tokens (batch size x longest input) per forward batch.",
        );
        // The batch's phases, on a GPU the kernels' own time between events (scoring::Timing).
        self.batch_forward_duration.render(
            &mut o,
            "xdistill_batch_forward_duration_seconds",
            "Decoder forward time per batch (ids to final hidden states), in seconds.",
        );
        self.batch_head_duration.render(
            &mut o,
            "xdistill_batch_head_duration_seconds",
            "LM-head matmul time per batch (hidden states to logits), in seconds.",
        );
        self.batch_topk_duration.render(
            &mut o,
            "xdistill_batch_topk_duration_seconds",
            "Top-k / log-softmax time per batch, in seconds.",
        );
        self.batch_copy_duration.render(
            &mut o,
            "xdistill_batch_copy_duration_seconds",
            "Device-to-host copy (and cast to f32) time per batch, in seconds.",
        );
        self.batch_duration.render(
            &mut o,
            "xdistill_batch_duration_seconds",
            "Worker time per batch (padding, forward, top-k, replies), in seconds.",
        );
        counter(
            &mut o,
            "xdistill_batch_cancelled_total",
            "Sequences dropped before computing because their caller went away.",
            self.batch_cancelled.load(Relaxed),
        );
        gauge(
            &mut o,
            "xdistill_queue_tokens",
            "Input tokens admitted and not yet answered.",
            self.queue_tokens.load(Relaxed),
        );
        gauge(
            &mut o,
            "xdistill_queue_sequences",
            "Sequences admitted and not yet answered.",
            self.queue_sequences.load(Relaxed),
        );
        counter(
            &mut o,
            "xdistill_queue_rejected_total",
            "Requests refused with 503 because the queue was full.",
            self.queue_rejected.load(Relaxed),
        );
        counter(
            &mut o,
            "xdistill_cache_hits_total",
            "Sequences answered from the cache.",
            self.cache_hits.load(Relaxed),
        );
        counter(
            &mut o,
            "xdistill_cache_misses_total",
            "Sequences not found in the cache.",
            self.cache_misses.load(Relaxed),
        );
        gauge(
            &mut o,
            "xdistill_cache_entries",
            "Entries in the result cache.",
            cache.0 as i64,
        );
        gauge(
            &mut o,
            "xdistill_cache_bytes",
            "Weighted size of the result cache in bytes.",
            cache.1 as i64,
        );
        gauge(
            &mut o,
            "xdistill_model_loaded",
            "1 once the model is loaded and serving.",
            self.model_loaded.load(Relaxed),
        );
        o
    }
}

/// Reads the value of an unlabelled sample `name` from exposition text (for tests and the bench).
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_parseable_text() {
        let m = Metrics::default();
        m.batch_forwards.fetch_add(3, Relaxed);
        m.batch_forward_duration.observe(0.003);
        m.batch_forward_duration.observe(7.0);
        m.record_request("/topk_logits", "ok", 0.01);
        let t = m.render((2, 100));
        assert_eq!(sample(&t, "xdistill_batch_forward_total"), Some(3.0));
        assert_eq!(
            sample(&t, "xdistill_batch_forward_duration_seconds_count"),
            Some(2.0)
        );
        assert_eq!(
            sample(
                &t,
                "xdistill_batch_forward_duration_seconds_bucket{le=\"0.005\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(
                &t,
                "xdistill_batch_forward_duration_seconds_bucket{le=\"+Inf\"}"
            ),
            Some(2.0)
        );
        assert_eq!(sample(&t, "xdistill_cache_bytes"), Some(100.0));
        assert!(t.contains("xdistill_request_total{route=\"/topk_logits\",outcome=\"ok\"} 1"));
        assert!(t.contains("# TYPE xdistill_request_duration_seconds histogram"));
    }
}
