//! `teacher.transport = "hidden"`: before any step, the teacher's head is checked (every replica
//! serves the same one, its dtype converts exactly to f32, it fits the memory budget), fetched
//! once (cached by fingerprint), decoded and put on the student's device; the client then asks
//! for hidden states that go with exactly that head.

use crate::client::{HiddenSpec, TeacherClient, TeacherPool};
use crate::config::TeacherConfig;
use crate::loss::full_vocab::TeacherHead;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use std::path::Path;
use xdistill_shared::codec::decode_head;
use xdistill_shared::protocol::{FullVocabInfo, WireDtype};

/// Bytes in a GB as `head_memory_gb` counts them.
const GB: f64 = 1e9;

/// The default `head_memory_gb` on a GPU (whose free memory the trainer does not query).
const GPU_DEFAULT_GB: f64 = 8.0;

/// The head a student holds in f32: `[head_rows, H]` (+ `[head_rows]` bias).
pub fn head_f32_bytes(fv: &FullVocabInfo) -> u64 {
    let rows = fv.head_rows as u64;
    // Saturating: the sizes are the peer's (a head over u64 is over every budget).
    let bias = if fv.bias { rows.saturating_mul(4) } else { 0 };
    rows.saturating_mul(fv.hidden_size as u64)
        .saturating_mul(4)
        .saturating_add(bias)
}

/// The memory budget for the head on `device`: `head_memory_gb`, else a quarter of the
/// machine's memory on the CPU and `GPU_DEFAULT_GB` on a GPU.
pub fn head_budget_bytes(tc: &TeacherConfig, device: &Device) -> u64 {
    if let Some(gb) = tc.head_memory_gb {
        return (gb * GB) as u64;
    }
    match device {
        Device::Cpu => total_memory_bytes().map_or((GPU_DEFAULT_GB * GB) as u64, |m| m / 4),
        _ => (GPU_DEFAULT_GB * GB) as u64,
    }
}

/// `bytes` in GB (10^9) or, below one, in MB.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= GB {
        format!("{:.2} GB", b / GB)
    } else {
        format!("{:.2} MB", b / 1e6)
    }
}

/// `MemTotal` of `/proc/meminfo` (None where there is none).
fn total_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Checks what `/v1/info` says about the head against the run, before anything is fetched:
/// the routes exist, the head's dtype widens exactly to f32, the vocabulary fits the student's
/// (`student_vocab`: same tokenizer only), and the head fits `budget` bytes.
pub fn check_head_info(
    fv: Option<&FullVocabInfo>,
    student_vocab: Option<usize>,
    budget: u64,
) -> Result<&FullVocabInfo> {
    let Some(fv) = fv else {
        bail!(
            "teacher.transport = \"hidden\", but the teacher does not serve its hidden states and \
             head (/v1/info has no full_vocab: an older server, or a model whose head cannot be \
             served, e.g. a quantized GGUF); use transport = \"topk\""
        );
    };
    if WireDtype::parse(&fv.dtype).is_none() {
        bail!(
            "the teacher's head is {:?}, which the student cannot hold exactly in f32 (f32, bf16 \
             and f16 can); run the teacher with --dtype bf16 or f32, or use transport = \"topk\"",
            fv.dtype
        );
    }
    if fv.vocab_size == 0 || fv.vocab_size > fv.head_rows || fv.hidden_size == 0 {
        bail!(
            "the teacher's head is malformed: vocab_size {}, head_rows {}, hidden_size {}",
            fv.vocab_size,
            fv.head_rows,
            fv.hidden_size
        );
    }
    if let Some(student_vocab) = student_vocab.filter(|&v| v < fv.vocab_size) {
        bail!(
            "the student's LM head has {student_vocab} rows, fewer than the teacher's \
             {} tokens: exact full-vocabulary distillation needs every teacher token in the \
             student's vocabulary",
            fv.vocab_size
        );
    }
    let need = head_f32_bytes(fv);
    if need > budget {
        bail!(
            "the teacher's head needs {} on the student's device ([{}, {}] in f32{}), more than \
             the budget of {}: raise teacher.head_memory_gb if the device has room, or use \
             transport = \"topk\"",
            size(need),
            fv.head_rows,
            fv.hidden_size,
            if fv.bias { " + bias" } else { "" },
            size(budget)
        );
    }
    Ok(fv)
}

/// Every replica's `full_vocab`, which must name one head (a mixed fleet would train on two
/// teachers' distributions under one name).
pub fn agreed_head(infos: &[(String, Option<FullVocabInfo>)]) -> Result<Option<FullVocabInfo>> {
    let Some((u0, first)) = infos.first() else {
        bail!("no replica answered /v1/info");
    };
    for (u, fv) in &infos[1..] {
        let fp = |f: &Option<FullVocabInfo>| {
            f.as_ref()
                .map_or("none".to_string(), |f| f.head_fingerprint.clone())
        };
        if fp(fv) != fp(first) {
            bail!(
                "teacher replicas serve different heads: {u0} has {}, {u} has {}",
                fp(first),
                fp(fv)
            );
        }
    }
    Ok(first.clone())
}

/// Fetches (or finds in `cache`), decodes and places the teacher's head on `device`, then
/// switches `client` to the hidden transport. Everything is refused before any step.
pub fn load(
    tc: &TeacherConfig,
    (client, pool): (&TeacherClient, &TeacherPool),
    student_vocab: Option<usize>,
    device: &Device,
    cache: &Path,
) -> Result<TeacherHead> {
    let mut infos = vec![];
    for (u, r) in pool.block_on(client.full_vocab_all()) {
        match r {
            Ok(fv) => infos.push((u.to_string(), fv)),
            Err(e) => tracing::warn!("{u}: /v1/info failed: {e}"),
        }
    }
    let fv = agreed_head(&infos)?;
    let budget = head_budget_bytes(tc, device);
    let fv = check_head_info(fv.as_ref(), student_vocab, budget)?;
    let path = pool.block_on(client.fetch_head(fv, cache))?;
    let head = read_head(&path, fv, device)?;
    client.use_hidden(HiddenSpec {
        head_fingerprint: fv.head_fingerprint.clone(),
        hidden_size: fv.hidden_size,
    })?;
    tracing::info!(
        "teacher head: [{}, {}] {} ({} tokens{}{}), {} in f32 on the student's device",
        fv.head_rows,
        fv.hidden_size,
        fv.dtype,
        fv.vocab_size,
        if fv.tied { ", tied" } else { "" },
        if fv.bias { ", bias" } else { "" },
        size(head_f32_bytes(fv))
    );
    Ok(head)
}

/// Decodes a fetched head file and checks it against `/v1/info`'s description.
fn read_head(path: &Path, fv: &FullVocabInfo, device: &Device) -> Result<TeacherHead> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = decode_head(&bytes).with_context(|| format!("decoding {}", path.display()))?;
    drop(bytes);
    let m = &file.meta;
    if (m.head_rows, m.hidden_size, m.vocab_size, m.bias)
        != (fv.head_rows, fv.hidden_size, fv.vocab_size, fv.bias)
        || m.logit_scale != fv.logit_scale
        || m.logit_softcap != fv.logit_softcap
    {
        bail!(
            "{}: the head file ([{}, {}], vocab {}, bias {}, scale {}, softcap {:?}) does not \
             match /v1/info ([{}, {}], vocab {}, bias {}, scale {}, softcap {:?})",
            path.display(),
            m.head_rows,
            m.hidden_size,
            m.vocab_size,
            m.bias,
            m.logit_scale,
            m.logit_softcap,
            fv.head_rows,
            fv.hidden_size,
            fv.vocab_size,
            fv.bias,
            fv.logit_scale,
            fv.logit_softcap
        );
    }
    let weight = Tensor::from_vec(file.weight, (m.head_rows, m.hidden_size), device)?;
    let bias = match file.bias {
        Some(b) => Some(Tensor::from_vec(b, m.head_rows, device)?),
        None => None,
    };
    Ok(TeacherHead::new(
        weight,
        bias,
        m.logit_scale,
        m.logit_softcap,
        m.vocab_size,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(fp: &str, rows: usize, h: usize) -> FullVocabInfo {
        FullVocabInfo {
            hidden_route: "/hidden_states".into(),
            head_route: "/v1/head".into(),
            dtype: "bf16".into(),
            hidden_size: h,
            head_rows: rows,
            vocab_size: rows - 2,
            tied: true,
            bias: false,
            logit_scale: 1.0,
            logit_softcap: None,
            head_fingerprint: fp.into(),
            head_bytes: 0,
        }
    }

    #[test]
    fn the_budget_refuses_a_head_too_large_for_the_device() {
        let fv = info("a", 151_936, 4096);
        // 151,936 · 4096 · 4 bytes = 2.49 GB.
        assert_eq!(head_f32_bytes(&fv), 151_936 * 4096 * 4);
        let err = check_head_info(Some(&fv), Some(151_936), 2_000_000_000)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2.49 GB") && err.contains("2.00 GB"), "{err}");
        // Exactly the head's bytes fit.
        assert!(check_head_info(Some(&fv), Some(151_936), 151_936 * 4096 * 4).is_ok());
        assert!(err.contains("head_memory_gb"), "{err}");
        assert!(check_head_info(Some(&fv), Some(151_936), 2_500_000_000).is_ok());
        // A peer's sizes past u64 are over every budget, not a wrapped small number.
        let mut huge = info("a", 1 << 32, 1 << 32);
        huge.bias = true;
        assert_eq!(head_f32_bytes(&huge), u64::MAX);
        assert!(check_head_info(Some(&huge), None, u64::MAX - 1).is_err());
    }

    #[test]
    fn dtypes_without_an_exact_f32_form_and_missing_routes_are_refused() {
        let mut fv = info("a", 10, 4);
        fv.dtype = "q4_k".into();
        let err = check_head_info(Some(&fv), Some(10), u64::MAX)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"q4_k\"") && err.contains("cannot hold"),
            "{err}"
        );
        let err = check_head_info(None, Some(10), u64::MAX)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no full_vocab"), "{err}");
        let fv = info("a", 10, 4);
        let err = check_head_info(Some(&fv), Some(7), u64::MAX)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fewer than the teacher's 8 tokens"), "{err}");
    }

    #[test]
    fn replicas_must_serve_one_head() {
        let a = info("aa", 10, 4);
        let b = info("bb", 10, 4);
        let ok = agreed_head(&[
            ("u1".into(), Some(a.clone())),
            ("u2".into(), Some(a.clone())),
        ]);
        assert_eq!(ok.unwrap(), Some(a.clone()));
        let err = agreed_head(&[("u1".into(), Some(a.clone())), ("u2".into(), Some(b))])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("u1 has aa") && err.contains("u2 has bb"),
            "{err}"
        );
        let err = agreed_head(&[("u1".into(), Some(a)), ("u2".into(), None)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("u2 has none"), "{err}");
    }
}
