//! The wire contract seen from the client: endpoint paths, checking an answer against its
//! request and the replicas against each other, and reading the server's error bodies.

use reqwest::{StatusCode, Url};
use xdistill_shared::codec::Format;
use xdistill_shared::model_check::{MAX_VOCAB, MAX_WIDTH};
use xdistill_shared::protocol::{
    ErrorBody, FullVocabInfo, InfoResponse, ProbeInfo, TopkRequest, TopkResponse, WireDtype,
};

/// `GET`: the teacher's model, tokenizer hash and limits.
pub const INFO_PATH: &str = "/v1/info";
/// `GET`: the teacher's `tokenizer.json`.
pub const TOKENIZER_PATH: &str = "/tokenizer.json";
/// `GET`: 2xx once the teacher serves.
pub const HEALTH_PATH: &str = "/health";

/// Bytes a head file may hold besides its tensors: its length prefix and JSON header (a few
/// hundred bytes as the server writes them).
const HEAD_HEADER_BYTES: u64 = 1 << 20;

/// Checks the sizes `/v1/info` states before the trainer sizes anything by them: a vocabulary
/// within the limit every model file is held to (`model_check`). A peer's `vocab_size` of
/// 2^64 - 1 would otherwise size the cross-tokenizer projection's tables.
pub fn check_info(info: &InfoResponse) -> Result<(), String> {
    if info.vocab_size == 0 || info.vocab_size > MAX_VOCAB {
        return Err(format!(
            "/v1/info's vocab_size {} is not between 1 and {MAX_VOCAB}",
            info.vocab_size
        ));
    }
    Ok(())
}

/// [`check_info`] for `/v1/info`'s `full_vocab`: the head's rows and width within the model
/// files' limits, and its file's length (which bounds the download and the read after it)
/// within what its shape needs.
pub fn check_full_vocab(fv: &FullVocabInfo) -> Result<(), String> {
    if fv.head_rows > MAX_VOCAB || fv.hidden_size > MAX_WIDTH {
        return Err(format!(
            "/v1/info's head [{}, {}] exceeds [{MAX_VOCAB}, {MAX_WIDTH}]",
            fv.head_rows, fv.hidden_size
        ));
    }
    // Both bounded above: the products fit in u64. An unknown dtype is refused later by name.
    let elem = WireDtype::parse(&fv.dtype).map_or(4, |d| d.size()) as u64;
    let rows = fv.head_rows as u64;
    let tensors = rows * fv.hidden_size as u64 * elem + if fv.bias { rows * elem } else { 0 };
    if fv.head_bytes > tensors + HEAD_HEADER_BYTES {
        return Err(format!(
            "/v1/info's head_bytes {} exceed the {tensors} bytes of a [{}, {}] {} head{} by \
             more than a header",
            fv.head_bytes,
            fv.head_rows,
            fv.hidden_size,
            fv.dtype,
            if fv.bias { " with bias" } else { "" }
        ));
    }
    Ok(())
}

/// Checks that every replica serves the same model (fingerprint) with the same tokenizer and
/// that their start-up probes agree (see `check_probes`); returns the common info, with the
/// first published probe. Replicas that disagree would silently mix two teachers.
pub fn check_replicas(infos: &[(Url, InfoResponse)]) -> Result<InfoResponse, String> {
    let Some((u0, first)) = infos.first() else {
        return Err("no replica answered /v1/info".into());
    };
    for (u, i) in &infos[1..] {
        if i.model_fingerprint != first.model_fingerprint
            || i.tokenizer_sha256 != first.tokenizer_sha256
        {
            return Err(format!(
                "replicas disagree: {u0} serves model {} (tokenizer {}), {u} serves model {} \
                 (tokenizer {})",
                first.model_fingerprint,
                first.tokenizer_sha256,
                i.model_fingerprint,
                i.tokenizer_sha256
            ));
        }
    }
    let probe = check_probes(infos)?;
    Ok(InfoResponse {
        probe,
        ..first.clone()
    })
}

/// Checks that every replica that publishes a start-up probe publishes the same hash (same
/// weights at another dtype or on another device give other numbers, and another hash); returns
/// that probe. A replica without a probe (an older server) is accepted with a warning.
pub fn check_probes(infos: &[(Url, InfoResponse)]) -> Result<Option<ProbeInfo>, String> {
    let mut seen: Option<(&Url, &ProbeInfo)> = None;
    for (u, i) in infos {
        let Some(p) = &i.probe else {
            tracing::warn!(
                "{u} publishes no start-up probe (an older teacher): its numbers cannot be \
                 checked against the other replicas'"
            );
            continue;
        };
        match seen {
            None => seen = Some((u, p)),
            Some((u0, p0)) if p0.hash != p.hash => return Err(probe_mismatch((u0, p0), (u, p))),
            Some(_) => {}
        }
    }
    Ok(seen.map(|(_, p)| p.clone()))
}

/// The error of two replicas whose probes differ: both URLs, both hashes and how far apart.
fn probe_mismatch((u0, p0): (&Url, &ProbeInfo), (u, p): (&Url, &ProbeInfo)) -> String {
    let how_far = match p0.max_abs_diff(p) {
        Some(d) => format!("their probe target log-probs differ by up to {d:e}"),
        None => "they scored different probe ids".to_string(),
    };
    format!(
        "replicas disagree on the start-up probe: {u0} has probe {}, {u} has probe {} ({how_far}); \
         same model, other numbers (another --dtype, device or scoring path?): refusing to mix \
         them",
        p0.hash, p.hash
    )
}

/// `base` with `route` appended to its path (keeps a path prefix such as `/teacher/`).
pub fn endpoint(base: &Url, route: &str) -> Url {
    let mut u = base.clone();
    let path = format!("{}{route}", base.path().trim_end_matches('/'));
    u.set_path(&path);
    u.set_query(None);
    u
}

/// Checks that a response answers `req`: one result per sequence, `S - 1 - start` rows each,
/// consistent buffers, and `k` not above the request's (a server may cap k at its vocabulary).
pub fn check_response(req: &TopkRequest, resp: &TopkResponse) -> Result<(), String> {
    if resp.results.len() != req.sequences.len() {
        return Err(format!(
            "{} results for {} sequences",
            resp.results.len(),
            req.sequences.len()
        ));
    }
    if resp.k > req.k {
        return Err(format!("k = {} where {} was asked", resp.k, req.k));
    }
    for (i, (seq, s)) in req.sequences.iter().zip(&resp.results).enumerate() {
        let rows = seq.len().saturating_sub(1 + req.start_of(i));
        if s.rows != rows {
            return Err(format!(
                "results[{i}]: {} rows where {rows} were expected",
                s.rows
            ));
        }
        if s.k != resp.k {
            return Err(format!(
                "results[{i}]: k = {} where the response says {}",
                s.k, resp.k
            ));
        }
        s.check_shapes().map_err(|m| format!("results[{i}]: {m}"))?;
        // Candidate ids: one log-prob per asked id of every row.
        let asked = req
            .ids
            .as_ref()
            .and_then(|ids| ids.get(i))
            .and_then(|rows| rows.first());
        if let Some(m) = asked.map(Vec::len) {
            if s.m != m {
                return Err(format!(
                    "results[{i}]: {} candidate log-probs per row where {m} ids were asked",
                    s.m
                ));
            }
        }
    }
    Ok(())
}

/// (type, message, field) of an error answer: the server's `ErrorBody` (JSON or MessagePack),
/// else the start of the body as text.
pub(super) fn error_body(
    ct: Option<&str>,
    body: &[u8],
    status: StatusCode,
) -> (String, String, Option<String>) {
    let parsed: Option<ErrorBody> = match Format::from_content_type(ct) {
        Format::Msgpack => rmp_serde::from_slice(body).ok(),
        Format::Json => serde_json::from_slice(body).ok(),
    };
    match parsed {
        Some(b) => (b.error.kind, b.error.message, b.error.field),
        None => {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)])
                .trim()
                .to_string();
            let msg = if text.is_empty() {
                status.canonical_reason().unwrap_or("error").to_string()
            } else {
                text
            };
            (status.as_str().to_string(), msg, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdistill_shared::protocol::TOPK_PATH;
    use xdistill_shared::protocol::{SequenceScores, ValuesKind};

    #[test]
    fn endpoints_keep_path_prefixes() {
        let u = |s: &str| Url::parse(s).unwrap();
        assert_eq!(
            endpoint(&u("http://h:1"), TOPK_PATH).as_str(),
            "http://h:1/topk_logits"
        );
        assert_eq!(
            endpoint(&u("http://h:1/"), INFO_PATH).as_str(),
            "http://h:1/v1/info"
        );
        assert_eq!(
            endpoint(&u("https://h/teacher/?x=1"), HEALTH_PATH).as_str(),
            "https://h/teacher/health"
        );
    }

    #[test]
    fn responses_are_checked_against_the_request() {
        let req = TopkRequest {
            sequences: vec![vec![1, 2, 3, 4], vec![5, 6]],
            k: 2,
            temperature: 1.0,
            start: 0,
            starts: Some(vec![1, 0]),
            values: ValuesKind::Logprobs,
            ids: None,
        };
        let seq = |rows: usize| SequenceScores {
            rows,
            k: 2,
            topk_ids: vec![0; rows * 2],
            topk_values: vec![0.0; rows * 2],
            target_logprobs: vec![0.0; rows],
            logsumexp: vec![0.0; rows],
            ..Default::default()
        };
        let mut resp = TopkResponse {
            k: 2,
            values: ValuesKind::Logprobs,
            temperature: 1.0,
            model: "m".into(),
            with_ids: false,
            // 4 tokens from 1: rows 2 (predicting tokens 2 and 3); 2 tokens from 0: 1 row.
            results: vec![seq(2), seq(1)],
        };
        check_response(&req, &resp).unwrap();
        resp.results[0] = seq(3);
        assert!(check_response(&req, &resp)
            .unwrap_err()
            .contains("results[0]"));
        resp.results.pop();
        assert!(check_response(&req, &resp).is_err());
        // Candidate ids: every row answers as many ids as were asked.
        let req = TopkRequest {
            ids: Some(vec![vec![vec![5, 6, 7]; 2], vec![vec![5, 6, 7]; 1]]),
            ..req
        };
        let with_m = |rows: usize, m: usize| SequenceScores {
            m,
            ids_logprobs: vec![-1.0; rows * m],
            ..seq(rows)
        };
        resp.results = vec![with_m(2, 3), with_m(1, 3)];
        check_response(&req, &resp).unwrap();
        resp.results[1] = with_m(1, 2);
        let err = check_response(&req, &resp).unwrap_err();
        assert!(err.contains("results[1]") && err.contains("3 ids"), "{err}");
    }

    /// An info as a replica of model "m" with `probe` would publish it.
    fn replica(probe: Option<ProbeInfo>) -> InfoResponse {
        let limits = xdistill_shared::protocol::Limits {
            max_k: 8,
            max_seq_len: 64,
            max_batch_tokens: 64,
            max_queue_tokens: 64,
            max_body_bytes: 1 << 20,
            max_wait_ms: 1,
            max_sequences: 8,
            max_answer_bytes: 1 << 20,
        };
        InfoResponse {
            protocol_version: 2,
            server_version: "t".into(),
            architecture: "LlamaForCausalLM".into(),
            model_type: "llama".into(),
            vocab_size: 100,
            logits_size: 100,
            max_seq_len: 64,
            dtype: "f32".into(),
            device: "cpu".into(),
            tokenizer_sha256: "tok".into(),
            model_fingerprint: "m".into(),
            limits,
            rope_theta: 1e4,
            rope_scaling: "default".into(),
            sliding_window: None,
            sliding_layers: 0,
            host_simd: "baseline".into(),
            lm_head: "fused".into(),
            batch_invariant: true,
            weights: "safetensors".into(),
            probe,
        }
    }

    fn probe(hash: &str, target: [f32; 2]) -> Option<ProbeInfo> {
        Some(ProbeInfo {
            hash: hash.into(),
            ids_hash: "ids".into(),
            k: 8,
            positions: 2,
            target_logprobs: target.to_vec(),
        })
    }

    /// Replicas of one model whose probes differ are refused, naming both URLs, both hashes and
    /// the largest difference of their values; equal probes pass and are returned.
    #[test]
    fn replicas_must_agree_on_the_probe() {
        let u = |s: &str| Url::parse(s).unwrap();
        let same = [
            (u("http://a:1"), replica(probe("h1", [-1.0, -2.0]))),
            (u("http://b:1"), replica(probe("h1", [-1.0, -2.0]))),
        ];
        let info = check_replicas(&same).unwrap();
        assert_eq!(info.probe.unwrap().hash, "h1");
        let differ = [
            (u("http://a:1"), replica(probe("h1", [-1.0, -2.0]))),
            (u("http://b:1"), replica(probe("h2", [-1.0, -2.25]))),
        ];
        let err = check_replicas(&differ).unwrap_err();
        for part in ["http://a:1", "http://b:1", "h1", "h2", "probe", "2.5e-1"] {
            assert!(err.contains(part), "{part:?} missing from: {err}");
        }
        // Probes of other ids cannot be compared value by value, and say so.
        let mut other_ids = replica(probe("h3", [-1.0, -2.0]));
        if let Some(p) = other_ids.probe.as_mut() {
            p.ids_hash = "other".into();
        }
        let err = check_replicas(&[differ[0].clone(), (u("http://c:1"), other_ids)]).unwrap_err();
        assert!(err.contains("different probe ids"), "{err}");
    }

    /// A replica without a probe (an older server) is accepted; the probe that was published is
    /// the one returned (to be pinned), whichever replica published it.
    #[test]
    fn replicas_without_a_probe_are_accepted() {
        let u = |s: &str| Url::parse(s).unwrap();
        let mixed = [
            (u("http://old:1"), replica(None)),
            (u("http://new:1"), replica(probe("h1", [-1.0, -2.0]))),
        ];
        assert_eq!(check_replicas(&mixed).unwrap().probe.unwrap().hash, "h1");
        let old = [(u("http://old:1"), replica(None))];
        assert!(check_replicas(&old).unwrap().probe.is_none());
    }

    /// `/v1/info`'s sizes are bounded before anything is sized by them; a real head file's
    /// length (as the server writes it) passes.
    #[test]
    fn info_sizes_are_bounded() {
        let mut info = replica(None);
        check_info(&info).unwrap();
        for v in [0, MAX_VOCAB + 1, usize::MAX] {
            info.vocab_size = v;
            let err = check_info(&info).unwrap_err();
            assert!(err.contains("vocab_size"), "{err}");
        }
        info.vocab_size = MAX_VOCAB;
        check_info(&info).unwrap();

        use xdistill_shared::codec::HeadMeta;
        let meta = HeadMeta {
            model_fingerprint: "f".repeat(64),
            architecture: "Qwen3ForCausalLM".into(),
            vocab_size: 151_669,
            head_rows: 151_936,
            hidden_size: 64,
            dtype: WireDtype::Bf16,
            tied: true,
            bias: true,
            logit_scale: 1.0,
            logit_softcap: Some(30.0),
        };
        let mut fv = FullVocabInfo {
            hidden_route: "/hidden_states".into(),
            head_route: "/v1/head".into(),
            dtype: "bf16".into(),
            hidden_size: meta.hidden_size,
            head_rows: meta.head_rows,
            vocab_size: meta.vocab_size,
            tied: true,
            bias: true,
            logit_scale: 1.0,
            logit_softcap: Some(30.0),
            head_fingerprint: "a".repeat(64),
            head_bytes: meta.file_len(),
        };
        check_full_vocab(&fv).unwrap();
        fv.head_bytes = meta.file_len() + 2 * HEAD_HEADER_BYTES;
        let err = check_full_vocab(&fv).unwrap_err();
        assert!(err.contains("head_bytes"), "{err}");
        fv.head_bytes = u64::MAX;
        assert!(check_full_vocab(&fv).is_err());
        fv.head_bytes = meta.file_len();
        fv.head_rows = MAX_VOCAB + 1;
        assert!(check_full_vocab(&fv).unwrap_err().contains("exceeds"));
        fv.head_rows = meta.head_rows;
        fv.hidden_size = usize::MAX;
        assert!(check_full_vocab(&fv).unwrap_err().contains("exceeds"));
    }

    #[test]
    fn error_bodies_are_surfaced() {
        let body = br#"{"error":{"type":"invalid_request","message":"id 99 >= vocab","field":"sequences[0][1]"}}"#;
        let (k, m, f) = error_body(Some("application/json"), body, StatusCode::BAD_REQUEST);
        assert_eq!(
            (k.as_str(), m.as_str(), f.as_deref()),
            ("invalid_request", "id 99 >= vocab", Some("sequences[0][1]"))
        );
        let (_, m, _) = error_body(None, b"plain failure", StatusCode::BAD_GATEWAY);
        assert_eq!(m, "plain failure");
        let (_, m, _) = error_body(None, b"", StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(m, "Service Unavailable");
    }
}
