//! The teacher's answers against an independent f64 reference, on tiny random Qwen3 and Llama
//! models with real tokenizers: correctness, batch invariance, cache, concurrency, formats.

use crate::common;

use crate::common::{client, ids, metric, request, score, Reference, Teacher};
use std::sync::OnceLock;
use xdistill_shared::codec::Format;
use xdistill_shared::protocol::ValuesKind;

const TOL: f64 = 1e-5;

/// Qwen3 vocabulary (151,669 ids) with the LM head padded to a multiple of 64 (151,680 rows).
fn qwen3() -> &'static (Teacher, Reference) {
    static S: OnceLock<(Teacher, Reference)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = common::tiny_model("scores-qwen3", "qwen3", "qwen3", 64);
        (common::start_teacher(&dir, &[]), Reference::load(&dir))
    })
}

/// Llama 2 vocabulary, no cache (so every answer is a fresh forward), a small batch budget so
/// long sequences are split, and a short wait window.
fn llama() -> &'static (Teacher, Reference) {
    static S: OnceLock<(Teacher, Reference)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = common::tiny_model("scores-llama", "llama", "llama2", 1);
        let t = common::start_teacher(
            &dir,
            &[
                "--cache-bytes",
                "0",
                "--max-batch-tokens",
                "64",
                "--max-wait-ms",
                "20",
            ],
        );
        (t, Reference::load(&dir))
    })
}

/// The fused LM head (the default: logits a vocabulary tile at a time, folded into the scores;
/// on an AVX-512 CPU by the server's own kernel) agrees with `--lm-head full` (the whole logits
/// from candle's matmul, then scored) and with the f64 reference through the real server, on
/// the Qwen3 vocabulary with a padded head: several tiles, the padding tile, long sequences in
/// KV-cache chunks, candidate ids, k = 0, temperature and both value kinds. The two paths sum
/// each dot product in a different order, so they agree to f32 rounding, not bit for bit.
#[tokio::test]
async fn fused_lm_head_agrees_with_full_logits_and_the_f64_reference() {
    let (_, reference) = qwen3();
    let dir = common::tiny_model("scores-qwen3", "qwen3", "qwen3", 64);
    // Both uncached, with a batch budget that sends the 40-token sequence through KV-cache chunks.
    let start = |lm_head| {
        let flags = [
            "--cache-bytes",
            "0",
            "--max-batch-tokens",
            "16",
            "--lm-head",
            lm_head,
        ];
        common::start_teacher(&dir, &flags)
    };
    let (fused, full) = (&start("fused"), &start("full"));
    let c = client();
    for (t, want) in [(fused, "fused"), (full, "full")] {
        let info = common::info(&c, t).await;
        assert_eq!(info.lm_head, want);
    }
    let v = reference.vocab();
    let seqs = vec![ids(31, 40, v), ids(32, 6, v), ids(33, 17, v)];
    for (k, temperature, values, with_ids) in [
        (64usize, 1.0f32, ValuesKind::Logprobs, true),
        (0, 0.7, ValuesKind::Logprobs, true),
        (5, 1.3, ValuesKind::Logits, false),
    ] {
        let mut req = request(seqs.clone(), k);
        req.temperature = temperature;
        req.values = values;
        // Candidates spread over every tile, the last valid id included.
        req.ids = with_ids.then(|| {
            seqs.iter()
                .map(|s| {
                    (1..s.len())
                        .map(|p| vec![(p * 7919 % v) as u32, (v - 1) as u32, 2048])
                        .collect()
                })
                .collect()
        });
        let a = score(&c, fused, &req, Format::Msgpack).await;
        let b = score(&c, full, &req, Format::Msgpack).await;
        for (s, (x, y)) in seqs.iter().zip(a.results.iter().zip(&b.results)) {
            let what = format!("k {k} t {temperature}");
            reference.check(x, s, 0, temperature as f64, values, TOL);
            reference.check(y, s, 0, temperature as f64, values, TOL);
            // Rank by rank (a near-tie may swap two ids), and every per-row figure.
            let close = |a: &[f32], b: &[f32]| {
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .all(|(p, q)| (p - q).abs() <= 2e-6 * p.abs().max(1.0))
            };
            assert!(close(&x.topk_values, &y.topk_values), "{what}");
            assert!(close(&x.target_logprobs, &y.target_logprobs), "{what}");
            assert!(close(&x.logsumexp, &y.logsumexp), "{what}");
            assert!(close(&x.ids_logprobs, &y.ids_logprobs), "{what}");
        }
    }
}

#[tokio::test]
async fn qwen3_topk_equals_f64_reference() {
    let (t, reference) = qwen3();
    let c = client();
    let v = reference.vocab();
    let seqs = vec![ids(1, 12, v), ids(2, 5, v), ids(3, 20, v)];
    for (temperature, values, start) in [
        (1.0f32, ValuesKind::Logprobs, 0usize),
        (0.7, ValuesKind::Logprobs, 2),
        (1.5, ValuesKind::Logits, 1),
    ] {
        let mut req = request(seqs.clone(), 16);
        req.temperature = temperature;
        req.values = values;
        req.start = start;
        let resp = score(&c, t, &req, Format::Json).await;
        assert_eq!(resp.results.len(), seqs.len());
        for (s, got) in seqs.iter().zip(&resp.results) {
            reference.check(got, s, start, temperature as f64, values, TOL);
        }
    }
}

#[tokio::test]
async fn llama_topk_equals_f64_reference_with_per_sequence_starts() {
    let (t, reference) = llama();
    let c = client();
    let v = reference.vocab();
    let seqs = vec![ids(4, 9, v), ids(5, 17, v), ids(6, 2, v), ids(7, 1, v)];
    let mut req = request(seqs.clone(), 8);
    req.starts = Some(vec![3, 0, 0, 0]);
    let resp = score(&c, t, &req, Format::Msgpack).await;
    // The S-1 convention: rows = S - 1 - start.
    let rows: Vec<usize> = resp.results.iter().map(|r| r.rows).collect();
    assert_eq!(rows, vec![5, 16, 1, 0]);
    for ((s, got), start) in seqs.iter().zip(&resp.results).zip([3, 0, 0, 0]) {
        reference.check(got, s, start, 1.0, ValuesKind::Logprobs, TOL);
    }
}

/// A sequence longer than --max-batch-tokens (64) is scored in chunks and still exact.
#[tokio::test]
async fn long_sequence_is_split_and_exact() {
    let (t, reference) = llama();
    let c = client();
    let s = ids(8, 150, reference.vocab());
    let resp = score(&c, t, &request(vec![s.clone()], 4), Format::Json).await;
    reference.check(&resp.results[0], &s, 0, 1.0, ValuesKind::Logprobs, TOL);
}

/// A sequence's answer does not depend on what it is batched with (cache disabled).
#[tokio::test]
async fn results_are_batch_invariant() {
    let (t, reference) = llama();
    let c = client();
    let v = reference.vocab();
    let probe = ids(9, 11, v);
    let alone = score(&c, t, &request(vec![probe.clone()], 8), Format::Json).await;
    let others: Vec<Vec<u32>> = (0..6)
        .map(|i| ids(100 + i, 3 + 5 * i as usize, v))
        .collect();
    let mut mixed = others.clone();
    mixed.insert(3, probe.clone());
    let together = score(&c, t, &request(mixed, 8), Format::Json).await;
    let (a, b) = (&alone.results[0], &together.results[3]);
    assert_eq!(a.topk_ids, b.topk_ids);
    for (x, y) in a
        .topk_values
        .iter()
        .chain(&a.target_logprobs)
        .chain(&a.logsumexp)
        .zip(
            b.topk_values
                .iter()
                .chain(&b.target_logprobs)
                .chain(&b.logsumexp),
        )
    {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
}

/// 32 concurrent clients, each with its own sequences; all answers correct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_clients() {
    let (t, reference) = llama();
    let v = reference.vocab();
    let forwards_before = metric(&client(), t, "xdistill_batch_forward_total").await;
    let tasks: Vec<_> = (0..32u64)
        .map(|i| {
            let seqs = vec![ids(1000 + i, 4 + (i as usize % 7), v)];
            tokio::spawn(async move {
                let (t, _) = llama();
                let resp = score(&client(), t, &request(seqs.clone(), 5), Format::Msgpack).await;
                (seqs, resp)
            })
        })
        .collect();
    for task in tasks {
        let (seqs, resp) = task.await.expect("client task");
        reference.check(
            &resp.results[0],
            &seqs[0],
            0,
            1.0,
            ValuesKind::Logprobs,
            TOL,
        );
    }
    // Coalescing happened: fewer forward passes than requests.
    let forwards = metric(&client(), t, "xdistill_batch_forward_total").await - forwards_before;
    assert!(forwards < 32.0, "{forwards} forwards for 32 requests");
}

#[tokio::test]
async fn cache_hit_answers_without_a_forward_pass() {
    let (t, reference) = qwen3();
    let c = client();
    let req = request(vec![ids(11, 14, reference.vocab())], 8);
    let first = score(&c, t, &req, Format::Json).await;
    let forwards = metric(&c, t, "xdistill_batch_forward_total").await;
    let hits = metric(&c, t, "xdistill_cache_hits_total").await;
    let second = score(&c, t, &req, Format::Json).await;
    assert_eq!(first, second);
    assert_eq!(
        metric(&c, t, "xdistill_batch_forward_total").await,
        forwards
    );
    assert_eq!(metric(&c, t, "xdistill_cache_hits_total").await, hits + 1.0);
    // A different k is a different entry.
    let mut other = req.clone();
    other.k = 9;
    score(&c, t, &other, Format::Json).await;
    assert!(metric(&c, t, "xdistill_batch_forward_total").await > forwards);
}

/// Where a batch's time goes: each phase the worker times (the forward, the LM head, top-k,
/// the copy to the host) is recorded once per batch and the encoding once per answer, the
/// model's phases took time, and together the worker's phases lie within the batches' wall
/// time (no phase counted twice, none outside its batch).
#[tokio::test]
async fn phase_timers_account_for_each_batch_and_answer() {
    let (t, reference) = qwen3();
    let c = client();
    let v = reference.vocab();
    let text = || async {
        let r = c.get(t.url("/metrics")).send().await.expect("metrics");
        r.text().await.expect("text")
    };
    let before = text().await;
    // Fresh sequences (no cache hits), one request per format.
    for (seed, format) in [(61u64, Format::Json), (62, Format::Msgpack)] {
        score(&c, t, &request(vec![ids(seed, 24, v)], 8), format).await;
    }
    // A batch's wall time is recorded after its answers are sent (it includes the replies):
    // wait until every batch counted has recorded it.
    let batches_done =
        xdistill_server::metrics::sample(&text().await, "xdistill_batch_forward_total");
    common::wait_for_metric(
        &c,
        t,
        "xdistill_batch_duration_seconds_count",
        batches_done.expect("xdistill_batch_forward_total"),
    )
    .await;
    let after = text().await;
    let d = |name: &str| {
        let at = |text: &str| xdistill_server::metrics::sample(text, name).unwrap_or(0.0);
        at(&after) - at(&before)
    };
    let batches = d("xdistill_batch_forward_total");
    assert!(batches >= 1.0, "{batches} batches");
    let mut phases = 0.0;
    for phase in ["forward", "head", "topk", "copy"] {
        let name = format!("xdistill_batch_{phase}_duration_seconds");
        assert_eq!(d(&format!("{name}_count")), batches, "{name}");
        let seconds = d(&format!("{name}_sum"));
        if phase != "copy" {
            assert!(seconds > 0.0, "{name}: {seconds} s");
        }
        phases += seconds;
    }
    let busy = d("xdistill_batch_duration_seconds_sum");
    assert!(
        phases <= busy + 1e-6,
        "phases {phases} s > batches {busy} s"
    );
    assert_eq!(d("xdistill_response_encode_duration_seconds_count"), 2.0);
    assert!(d("xdistill_response_encode_duration_seconds_sum") > 0.0);
}

#[tokio::test]
async fn msgpack_and_json_answers_agree() {
    let (t, reference) = qwen3();
    let c = client();
    let v = reference.vocab();
    let req = request(vec![ids(21, 10, v), ids(22, 6, v)], 32);
    let j = score(&c, t, &req, Format::Json).await;
    let m = score(&c, t, &req, Format::Msgpack).await;
    assert_eq!(j, m);
    // msgpack: 8 bytes per (position, k) entry plus small per-row and per-sequence overhead.
    let (_, body) = common::post(&c, t, &req, Format::Msgpack).await;
    let entries = (9 + 5) * 32;
    assert!(body.len() < entries * 9, "{} bytes", body.len());
}

#[tokio::test]
async fn info_health_tokenizer_and_metrics() {
    let (t, reference) = qwen3();
    let c = client();
    assert_eq!(c.get(t.url("/health")).send().await.unwrap().status(), 200);
    let info = common::info(&c, t).await;
    assert_eq!(info.architecture, "Qwen3ForCausalLM");
    assert_eq!(info.vocab_size, reference.vocab());
    assert_eq!(info.vocab_size, 151_669);
    assert_eq!(info.logits_size, 151_680);
    assert_eq!(info.max_seq_len, 256);
    assert_eq!(info.dtype, "f32");
    assert_eq!(info.device, "cpu");
    assert_eq!(info.protocol_version, 2);
    assert!(info.batch_invariant, "--batch-invariant is on by default");
    // init-model's Qwen3 base, no scaling.
    assert_eq!(
        (info.rope_theta, info.rope_scaling.as_str()),
        (1e6, "default")
    );
    assert_eq!(info.limits.max_sequences, 16_384);
    // The scoring pass runs with the widest instruction set this CPU has (capped by
    // $XDISTILL_SIMD, which the teacher inherits from this test), through the fused
    // LM head (the default on the CPU).
    assert_eq!(
        info.host_simd,
        xdistill_cpu_kernels::simd::Simd::current().name()
    );
    assert_eq!(info.lm_head, "fused");
    let tok = c.get(t.url("/tokenizer.json")).send().await.unwrap();
    assert_eq!(tok.status(), 200);
    let bytes = tok.bytes().await.unwrap();
    let expected = std::fs::read(xdistill_testkit::tokenizer_json("qwen3")).unwrap();
    assert_eq!(bytes.as_ref(), expected.as_slice());
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes));
    assert_eq!(sha, info.tokenizer_sha256);
    let text = c
        .get(t.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "xdistill_request_total",
        "xdistill_request_duration_seconds",
        "xdistill_request_tokens_scored_total",
        "xdistill_batch_sequences",
        "xdistill_queue_tokens",
        "xdistill_cache_hits_total",
        "xdistill_cache_misses_total",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
    }
}
