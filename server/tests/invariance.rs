//! Scores are reproducible under sharing and never NaN: a sequence gets the same bytes alone or
//! batched with other clients' sequences (the default `--batch-invariant true`), and a
//! temperature that overflows the scaled logits is an error naming it, never cached.

use crate::common;

use crate::common::{client, ids, metric, post, request, Teacher};
use std::sync::OnceLock;
use xdistill_shared::codec::Format;
use xdistill_shared::protocol::{ErrorBody, SequenceScores, TopkRequest};

const VOCAB: usize = 32_000;
/// Inputs over this many tokens run in chunks over a KV cache.
const BATCH_TOKENS: usize = 128;

fn model() -> std::path::PathBuf {
    common::tiny_model("invariance-qwen3", "qwen3", "llama2", 64)
}

/// A teacher with no cache (it would hide a difference) and a long wait window so that
/// concurrent requests share batches, started with `extra` flags too.
fn sharing_teacher(extra: &[&str]) -> Teacher {
    let batch = BATCH_TOKENS.to_string();
    let mut args = vec![
        "--cache-bytes",
        "0",
        "--max-wait-ms",
        "300",
        "--max-batch-tokens",
        &batch,
    ];
    args.extend_from_slice(extra);
    common::start_teacher(&model(), &args)
}

fn shared_teacher() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| sharing_teacher(&[]))
}

/// The default cache, to check that failures are not stored.
fn cached_teacher() -> &'static Teacher {
    static T: OnceLock<Teacher> = OnceLock::new();
    T.get_or_init(|| common::start_teacher(&model(), &[]))
}

use crate::common::score_bits as bits;

fn req(sequences: Vec<Vec<u32>>) -> TopkRequest {
    TopkRequest {
        temperature: 0.8,
        ..request(sequences, 8)
    }
}

/// Raw MessagePack answer bytes and the decoded results.
async fn answer(
    c: &reqwest::Client,
    t: &Teacher,
    r: &TopkRequest,
) -> (Vec<u8>, Vec<SequenceScores>) {
    let (status, body) = post(c, t, r, Format::Msgpack).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let decoded = xdistill_shared::codec::decode_response(Format::Msgpack, &body).expect("decode");
    (body, decoded.results)
}

async fn batch_stats(c: &reqwest::Client, t: &Teacher) -> (f64, f64) {
    (
        metric(c, t, "xdistill_batch_sequences_count").await,
        metric(c, t, "xdistill_batch_sequences_sum").await,
    )
}

/// Concurrent clients with different mixes get, for the same sequence, the bits it gets when
/// one client sends it alone: a short sequence batched with neighbours of other lengths (padded
/// to the longest in a padded forward), and one longer than `--max-batch-tokens` (the KV-cache
/// path) sent with neighbours.
#[tokio::test]
async fn a_sequence_gets_the_same_bytes_alone_or_shared() {
    same_bytes_alone_or_shared(shared_teacher()).await;
}

/// The same with the packed forward (`--packed-forward on`, matmuls in blocks of 32 rows: the
/// GPU's default way, here on the CPU): the batch's short sequences share one forward.
#[tokio::test]
async fn a_sequence_gets_the_same_bytes_alone_or_shared_when_packed() {
    static T: OnceLock<Teacher> = OnceLock::new();
    let t = T.get_or_init(|| sharing_teacher(&["--packed-forward", "on", "--packed-rows", "32"]));
    same_bytes_alone_or_shared(t).await;
}

async fn same_bytes_alone_or_shared(t: &Teacher) {
    let c = client();
    let x = ids(1, 12, VOCAB); // 11 input tokens
    let (n0, n1, n2) = (ids(2, 26, VOCAB), ids(3, 5, VOCAB), ids(4, 17, VOCAB));
    // 199 input tokens > 128: chunks over a KV cache.
    let long = ids(5, 200, VOCAB);
    // 1. One client, one sequence at a time.
    let (alone_raw, alone) = answer(&c, t, &req(vec![x.clone()])).await;
    let (_, alone_long) = answer(&c, t, &req(vec![long.clone()])).await;
    assert_eq!((alone[0].rows, alone_long[0].rows), (11, 199));
    // 2. Two clients at once: x alone, and x among three neighbours. Together 5 × 25 = 125
    //    padded tokens: one batch, when both arrive within the wait window.
    let ra = req(vec![x.clone()]);
    let rb = req(vec![n0.clone(), x.clone(), n1.clone(), n2.clone()]);
    let mut met = false;
    for round in 0..5 {
        let before = batch_stats(&c, t).await;
        let (a, b) = tokio::join!(answer(&c, t, &ra), answer(&c, t, &rb));
        let after = batch_stats(&c, t).await;
        if (after.0 - before.0, after.1 - before.1) != (1.0, 5.0) {
            eprintln!("round {round}: {before:?} -> {after:?}, the requests did not meet; again");
            continue;
        }
        met = true;
        // The same answer bytes for the same request; the same bits for x in another.
        assert_eq!(
            a.0, alone_raw,
            "x alone in its request, batched with others"
        );
        assert_eq!(bits(&b.1[1]), bits(&alone[0]), "x among neighbours");
        break;
    }
    assert!(met, "the concurrent requests never shared a batch");
    // 3. The long sequence among neighbours while another client sends short ones, and one of
    //    40 inputs (packed, it would fill more than a block of 32 rows: it runs alone).
    let mid = ids(6, 41, VOCAB);
    let (_, alone_mid) = answer(&c, t, &req(vec![mid.clone()])).await;
    let rl = req(vec![n1.clone(), long.clone(), n0.clone()]);
    let rc = req(vec![n2.clone(), x.clone(), mid.clone()]);
    let (l, s) = tokio::join!(answer(&c, t, &rl), answer(&c, t, &rc));
    assert_eq!(bits(&l.1[1]), bits(&alone_long[0]), "long among neighbours");
    assert_eq!(bits(&s.1[1]), bits(&alone[0]), "x after n2");
    assert_eq!(bits(&s.1[2]), bits(&alone_mid[0]), "mid after x");
}

fn error_of(body: &[u8]) -> ErrorBody {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
}

/// `temperature: 1e-45` is finite and > 0 but overflows the scaled logits: a non-200 naming
/// the temperature (no NaN answer), not cached (asked again, it misses again), on the native
/// and the vLLM route; a normal request still works.
#[tokio::test]
async fn an_overflowing_temperature_is_an_error_and_not_cached() {
    let t = cached_teacher();
    let c = client();
    let seq = ids(9, 10, VOCAB);
    let bad = TopkRequest {
        temperature: 1e-45,
        ..request(vec![seq.clone()], 4)
    };
    for format in [Format::Json, Format::Msgpack, Format::Json] {
        let hits = metric(&c, t, "xdistill_cache_hits_total").await;
        let misses = metric(&c, t, "xdistill_cache_misses_total").await;
        let (status, body) = post(&c, t, &bad, format).await;
        assert_ne!(status, 200, "{}", String::from_utf8_lossy(&body));
        let e = error_of(&body);
        assert!(
            e.error.message.contains("temperature"),
            "{}",
            e.error.message
        );
        assert_eq!(metric(&c, t, "xdistill_cache_hits_total").await, hits);
        // Refused before the cache (a validation error) or looked up and missed.
        assert!(metric(&c, t, "xdistill_cache_misses_total").await - misses <= 1.0);
    }
    // The vLLM route scores with the same engine.
    let body = serde_json::json!({"prompt": seq, "max_tokens": 0, "prompt_logprobs": 2,
                                  "temperature": 1e-45});
    let r = c
        .post(t.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    let body = r.bytes().await.expect("body");
    assert_ne!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(error_of(&body).error.message.contains("temperature"));
    // A normal request: every value finite, and cached.
    let good = request(vec![seq], 4);
    let (status, body) = post(&c, t, &good, Format::Json).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let hits = metric(&c, t, "xdistill_cache_hits_total").await;
    let (_, again) = post(&c, t, &good, Format::Json).await;
    assert_eq!(again, body);
    assert_eq!(metric(&c, t, "xdistill_cache_hits_total").await, hits + 1.0);
    let r = xdistill_shared::codec::decode_response(Format::Json, &body).unwrap();
    let s = &r.results[0];
    assert!(s
        .topk_values
        .iter()
        .chain(&s.target_logprobs)
        .chain(&s.logsumexp)
        .all(|v| v.is_finite()));
}

/// A temperature that passes validation (`1 / τ` is finite) but whose scaled logits overflow for
/// this model is the client's fault, found only after scoring: `422 temperature_overflow` naming
/// the field, counted under its own label, not cached; the server keeps serving.
#[tokio::test]
async fn a_temperature_overflowing_after_scoring_is_a_client_error() {
    // The tiny model's logits stay within ±5; one initialised 10× louder reaches |z| > 10.
    static T: OnceLock<Teacher> = OnceLock::new();
    let t = T.get_or_init(|| common::start_teacher(&loud_model(), &[]));
    let c = client();
    let seq = ids(11, 12, VOCAB);
    // Just above the validation floor (1 / f32::MAX): z / τ overflows once |z| ≳ 10.
    let bad = TopkRequest {
        temperature: 3e-38,
        ..request(vec![seq.clone()], 4)
    };
    let (status, body) = post(&c, t, &bad, Format::Json).await;
    let text = String::from_utf8_lossy(&body).to_string();
    assert_eq!(status, 422, "{text}");
    let e = error_of(&body);
    assert_eq!(e.error.kind, "temperature_overflow", "{text}");
    assert_eq!(e.error.field.as_deref(), Some("temperature"));
    assert_eq!(e.error.code, Some(422));
    assert!(
        e.error.message.contains("overflows the scaled logits"),
        "{text}"
    );
    // Not cached (only answers are): asked again, it is refused again.
    let (again, _) = post(&c, t, &bad, Format::Json).await;
    assert_eq!(again, 422);
    let metrics = c
        .get(t.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("outcome=\"temperature_overflow\""),
        "{metrics}"
    );
    let (status, _) = post(&c, t, &request(vec![seq], 4), Format::Json).await;
    assert_eq!(status, 200);
}

/// [`model`]'s shape with weights of standard deviation 1 (instead of 0.1): logits beyond ±10.
fn loud_model() -> std::path::PathBuf {
    let tmp = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let out = tmp.join("teacher-models").join("invariance-loud-qwen3");
    xdistill_testkit::models::made_once(&out, |out| {
        xdistill_shared::init::init_model_dir(&xdistill_shared::init::InitSpec {
            arch: "qwen3".into(),
            tokenizer: xdistill_testkit::tokenizer_json("llama2"),
            hidden_size: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate_size: 64,
            head_dim: None,
            pad_vocab_to: 64,
            max_position_embeddings: 256,
            tie_embeddings: false,
            init_std: 1.0,
            seed: 7,
            out: out.to_path_buf(),
            features: Default::default(),
        })
        .expect("init-model");
    })
}
