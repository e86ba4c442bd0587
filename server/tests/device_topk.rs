//! The device scoring path (`--topk device`: LM head in position chunks, top-k / log-softmax /
//! target log-prob / logsumexp as tensor ops on the model's device, only `[N, k]` copied back)
//! through the real server, against the f64 reference and against the host path.
//!
//! On the CPU this checks the GPU code path without a GPU. `XDISTILL_TEST_DEVICE=cuda` (with a
//! CUDA build, see scripts/gpu-check.sh) runs the device-path teacher on the GPU instead: that is
//! the CPU vs GPU parity check.

use crate::common;

use crate::common::{client, ids, request, score, Reference, Teacher};
use std::sync::OnceLock;
use xdistill_shared::codec::Format;
use xdistill_shared::protocol::ValuesKind;

fn device() -> String {
    std::env::var("XDISTILL_TEST_DEVICE").unwrap_or_else(|_| "cpu".into())
}

/// f64 agreement: tight on the CPU; on a GPU the f32 matmuls sum in another order. (The device
/// teacher is asked for f32: a GPU's default is bf16, whose rounding this tolerance is not for.)
fn tol() -> f64 {
    if device() == "cpu" {
        1e-5
    } else {
        2e-3
    }
}

/// Qwen3 vocabulary (151,669 ids, LM head padded to 151,680 rows: the device sort reduces
/// 19 chunks of 8192 columns), served twice: the device path on `device()` with a batch budget
/// small enough that long inputs go through the KV-cache chunks, and the host path on the CPU.
fn teachers() -> &'static (Teacher, Teacher, Reference) {
    static S: OnceLock<(Teacher, Teacher, Reference)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = common::tiny_model("device-qwen3", "qwen3", "qwen3", 64);
        let dev = device();
        let on_device = common::start_teacher(
            &dir,
            &[
                "--topk",
                "device",
                "--device",
                &dev,
                "--dtype",
                "f32",
                "--cache-bytes",
                "0",
                "--max-batch-tokens",
                "24",
            ],
        );
        let host = common::start_teacher(&dir, &["--topk", "host", "--cache-bytes", "0"]);
        (on_device, host, Reference::load(&dir))
    })
}

#[tokio::test]
async fn device_path_equals_f64_reference_and_host_path() {
    let (dev, host, reference) = teachers();
    let c = client();
    let v = reference.vocab();
    // Length 28 exceeds the 24-token batch budget (KV-cache chunks).
    let seqs = vec![ids(11, 9, v), ids(12, 28, v), ids(13, 5, v)];
    for (temperature, values, start, k) in [
        (1.0f32, ValuesKind::Logprobs, 0usize, 64usize),
        (0.6, ValuesKind::Logits, 3, 1),
    ] {
        let mut req = request(seqs.clone(), k);
        req.temperature = temperature;
        req.values = values;
        req.start = start;
        let d = score(&c, dev, &req, Format::Msgpack).await;
        let h = score(&c, host, &req, Format::Msgpack).await;
        assert_eq!(d.results.len(), seqs.len());
        for ((s, got), want) in seqs.iter().zip(&d.results).zip(&h.results) {
            reference.check(got, s, start, temperature as f64, values, tol());
            // Same rows as the host path; ids equal wherever values are not tied.
            assert_eq!(got.rows, want.rows);
            for r in 0..got.rows {
                let (gi, wi) = (got.ids_row(r), want.ids_row(r));
                let (gv, wv) = (got.values_row(r), want.values_row(r));
                for j in 0..k {
                    assert!((gv[j] - wv[j]).abs() as f64 <= tol(), "row {r} rank {j}");
                    let tied = (j > 0 && (wv[j - 1] - wv[j]).abs() as f64 <= tol())
                        || (j + 1 < k && (wv[j] - wv[j + 1]).abs() as f64 <= tol());
                    assert!(
                        gi[j] == wi[j] || tied,
                        "row {r} rank {j}: {} vs {}",
                        gi[j],
                        wi[j]
                    );
                }
            }
        }
    }
}

#[tokio::test]
async fn info_reports_the_device() {
    let (dev, _, _) = teachers();
    let info = common::info(&client(), dev).await;
    let want = if device() == "cuda" {
        "cuda:0".to_string()
    } else {
        device()
    };
    assert_eq!(info.device, want);
}
