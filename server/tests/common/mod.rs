//! The server tests' names for `xdistill_testkit` (a running `teacher`, tiny models, an HTTP
//! client, the f64 reference), plus what only they need: `/metrics` samples.
// Each test binary uses part of this facade.
#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use xdistill_testkit::http::{client, info, post, request, score};
pub use xdistill_testkit::reference::{ids, score_bits, Reference};
pub use xdistill_testkit::{
    compose_defaults, http_status as get_status, start_teacher, teacher_binary as teacher_bin,
    TeacherProcess as Teacher,
};

/// [`xdistill_testkit::tiny_teacher_model`] under this package's `CARGO_TARGET_TMPDIR`.
pub fn tiny_model(name: &str, arch: &str, tokenizer: &str, pad_to: usize) -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    xdistill_testkit::tiny_teacher_model(tmp, name, arch, tokenizer, pad_to)
}

/// The value of metric `name` in the teacher's `/metrics`.
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
