//! The wire contract seen from the client: endpoint paths, checking an answer against its
//! request and the replicas against each other, and reading the server's error bodies.

use reqwest::{StatusCode, Url};
use xdistill_shared::codec::Format;
use xdistill_shared::protocol::{ErrorBody, InfoResponse, TopkRequest, TopkResponse};

/// `GET`: the teacher's model, tokenizer hash and limits.
pub const INFO_PATH: &str = "/v1/info";
/// `GET`: the teacher's `tokenizer.json`.
pub const TOKENIZER_PATH: &str = "/tokenizer.json";
/// `GET`: 2xx once the teacher serves.
pub const HEALTH_PATH: &str = "/health";

/// Checks that every replica serves the same model (fingerprint) with the same tokenizer;
/// returns the common info. Replicas that disagree would silently mix two teachers.
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
    Ok(first.clone())
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

/// An error with its causes (reqwest's own message is terse: "error sending request").
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s += &format!(": {m}");
        }
        cur = c.source();
    }
    s
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
