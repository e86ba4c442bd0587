//! The start-up probe against real `teacher` processes: the same model gives the same probe hash
//! at every start, and the same weights at another `--dtype` (same model fingerprint) give
//! another; every scoring answer carries the replica's hash.

use crate::common::{client, info, request, start_teacher, tiny_model, Teacher};
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{ProbeInfo, HIDDEN_PATH, PROBE_HEADER, TOPK_PATH};

/// The llama2-vocabulary tiny model every test here serves.
fn model() -> std::path::PathBuf {
    tiny_model("probe-llama", "llama", "llama2", 1)
}

/// The teacher's published probe (the test fails when there is none).
async fn probe_of(c: &reqwest::Client, t: &Teacher) -> (String, ProbeInfo) {
    let i = info(c, t).await;
    let p = i.probe.expect("/v1/info publishes a probe");
    (i.model_fingerprint, p)
}

/// The [`PROBE_HEADER`] of a 200 answer to `POST route` with the JSON `body`.
async fn probe_header(c: &reqwest::Client, t: &Teacher, route: &str, body: Vec<u8>) -> String {
    let r = c
        .post(t.url(route))
        .header("content-type", codec::JSON)
        .body(body)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 200, "{route}");
    let h = r.headers().get(PROBE_HEADER).cloned();
    let h = h.unwrap_or_else(|| panic!("{route}: no {PROBE_HEADER} header"));
    h.to_str().expect("an ASCII header").to_string()
}

/// Two starts of one model publish the same probe (the documented shape: k 8, 31 positions,
/// finite log-probs), and both scoring routes send its hash.
#[tokio::test]
async fn the_probe_is_stable_across_starts_and_sent_with_answers() {
    let c = client();
    let dir = model();
    let (fp_a, a) = {
        let t = start_teacher(&dir, &["--dtype", "f32"]);
        let topk = codec::encode_request(Format::Json, &request(vec![vec![1, 2, 3, 4]], 4));
        let hash = probe_header(&c, &t, TOPK_PATH, topk.expect("encode")).await;
        let (fp, p) = probe_of(&c, &t).await;
        assert_eq!(hash, p.hash, "{TOPK_PATH} header");
        let hidden = br#"{"sequences": [[1, 2, 3]]}"#.to_vec();
        assert_eq!(probe_header(&c, &t, HIDDEN_PATH, hidden).await, p.hash);
        (fp, p)
    };
    assert_eq!((a.k, a.positions, a.target_logprobs.len()), (8, 31, 31));
    assert_eq!(a.hash.len(), 64);
    assert!(a.target_logprobs.iter().all(|x| x.is_finite() && *x <= 0.0));
    let t = start_teacher(&dir, &["--dtype", "f32"]);
    let (fp_b, b) = probe_of(&c, &t).await;
    assert_eq!(fp_a, fp_b);
    assert_eq!(
        a, b,
        "the same model at the same dtype must give the same probe"
    );
}

/// The same weights served in f32 and in bf16 have one model fingerprint (it hashes the files)
/// but other numbers: the probe hashes differ, over the same probe ids, by a measurable amount.
#[tokio::test]
async fn another_dtype_gives_another_probe_for_the_same_fingerprint() {
    let c = client();
    let dir = model();
    let f32_teacher = start_teacher(&dir, &["--dtype", "f32"]);
    let bf16_teacher = start_teacher(&dir, &["--dtype", "bf16"]);
    let (fp32, p32) = probe_of(&c, &f32_teacher).await;
    let (fp16, p16) = probe_of(&c, &bf16_teacher).await;
    assert_eq!(
        fp32, fp16,
        "the fingerprint hashes the weight files, not the dtype"
    );
    assert_eq!(
        p32.ids_hash, p16.ids_hash,
        "the probe ids depend on the vocabulary only"
    );
    assert_ne!(
        p32.hash, p16.hash,
        "f32 and bf16 scores must hash differently"
    );
    let diff = p32.max_abs_diff(&p16).expect("comparable probes");
    assert!(diff > 0.0, "bf16 and f32 log-probs differ: {diff}");
}
