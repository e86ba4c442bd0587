//! The hidden-state transport (`teacher.transport = "hidden"`): `POST /hidden_states` and the
//! teacher's LM head from `GET /v1/head`, downloaded once into a cache keyed by its SHA-256
//! fingerprint and checked against `/v1/info`'s before it is used.

use super::wire::endpoint;
use super::{ClientError, TeacherClient};
use bytes::Bytes;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::Url;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use xdistill_shared::codec::{self, Format};
use xdistill_shared::protocol::{
    FullVocabInfo, HiddenRequest, HiddenResponse, InfoWithFullVocab, SequenceScores, TopkRequest,
    HEAD_PATH, HIDDEN_PATH,
};

/// What the client checks every `/hidden_states` answer against: the head it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct HiddenSpec {
    /// `/v1/info`'s `head_fingerprint` (SHA-256 of the head file the trainer loaded).
    pub head_fingerprint: String,
    pub hidden_size: usize,
}

impl TeacherClient {
    /// From now on, [`Self::score`] asks this teacher for hidden states that go with `spec`'s
    /// head (set once, when the run has loaded the head).
    pub fn use_hidden(&self, spec: HiddenSpec) -> Result<(), ClientError> {
        self.inner
            .hidden
            .set(spec)
            .map_err(|_| ClientError::Build("the hidden-state transport is already set".into()))
    }

    /// The head this client's hidden states must go with, when it uses that transport.
    pub fn hidden_spec(&self) -> Option<&HiddenSpec> {
        self.inner.hidden.get()
    }

    /// The teacher's answers to `req`, one per sequence, over this client's transport: the
    /// top-k of `/topk_logits`, or (hidden transport) `/hidden_states` for the same positions
    /// with each sequence's `[rows, H]` states widened to f32 in [`SequenceScores::hidden`]
    /// (`k` = 0; `req`'s k and temperature do not apply: the trainer applies the head).
    pub async fn score(&self, req: &TopkRequest) -> Result<Vec<SequenceScores>, ClientError> {
        let Some(spec) = self.hidden_spec() else {
            return Ok(self.topk(req).await?.results);
        };
        let hreq = HiddenRequest {
            sequences: req.sequences.clone(),
            start: req.start,
            starts: req.starts.clone(),
        };
        let resp = self.hidden(&hreq, spec).await?;
        resp.results
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let v = resp
                    .f32_rows(i)
                    .map_err(|message| ClientError::InvalidResponse {
                        url: HIDDEN_PATH.to_string(),
                        message,
                    })?;
                Ok(SequenceScores {
                    rows: r.rows,
                    k: 0,
                    hidden: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    ..Default::default()
                })
            })
            .collect()
    }

    /// `/v1/info`'s `full_vocab` object of every replica, in URL order (`None`: a replica
    /// without the hidden-state routes).
    pub async fn full_vocab_all(&self) -> Vec<(Url, Result<Option<FullVocabInfo>, ClientError>)> {
        let mut out = Vec::new();
        for base in self.inner.urls.clone() {
            let one = self.replica(&base);
            let opts = &self.inner.opts;
            let r = one
                .with_retries("GET /v1/info", opts.max_wait, opts.max_attempts, |base| {
                    let one = &one;
                    async move {
                        let url = endpoint(&base, super::INFO_PATH);
                        let rb = one.inner.http.get(url.clone()).header(ACCEPT, codec::JSON);
                        let (_, bytes) = one.send(&url, rb, super::body::SMALL_BODY).await?;
                        let fv = serde_json::from_slice::<InfoWithFullVocab>(&bytes)
                            .map_err(|e| ClientError::Decode {
                                url: url.to_string(),
                                source: codec::CodecError::Json(e),
                            })?
                            .full_vocab;
                        if let Some(fv) = &fv {
                            super::wire::check_full_vocab(fv).map_err(|message| {
                                ClientError::InvalidResponse {
                                    url: url.to_string(),
                                    message,
                                }
                            })?;
                        }
                        Ok(fv)
                    }
                })
                .await;
            out.push((base, r));
        }
        out
    }

    /// `POST /hidden_states` for `req`, retried like `/topk_logits`; the answer is checked
    /// against the request (sequence count, rows) and against `spec` (hidden size, head
    /// fingerprint: a teacher whose head changed under a run is an error, not a silent mix).
    pub async fn hidden(
        &self,
        req: &HiddenRequest,
        spec: &HiddenSpec,
    ) -> Result<HiddenResponse, ClientError> {
        let body = Bytes::from(
            codec::encode_hidden_request(Format::Msgpack, req).map_err(ClientError::Encode)?,
        );
        let opts = &self.inner.opts;
        self.with_retries(
            "POST /hidden_states",
            opts.max_wait,
            opts.max_attempts,
            |base| self.hidden_once(base, body.clone(), req, spec),
        )
        .await
    }

    async fn hidden_once(
        &self,
        base: Url,
        body: Bytes,
        req: &HiddenRequest,
        spec: &HiddenSpec,
    ) -> Result<HiddenResponse, ClientError> {
        let url = endpoint(&base, HIDDEN_PATH);
        let limit = super::body::hidden_limit(req, spec.hidden_size);
        let (headers, bytes) = self.post_msgpack(&url, body, &req.sequences, limit).await?;
        let resp = codec::decode_hidden_response(&bytes).map_err(|source| ClientError::Decode {
            url: url.to_string(),
            source,
        })?;
        check_hidden_response(req, &resp, spec).map_err(|message| {
            ClientError::InvalidResponse {
                url: url.to_string(),
                message,
            }
        })?;
        self.check_model(&url, &resp.model)?;
        self.check_probe(&url, &headers)?;
        Ok(resp)
    }

    /// The teacher's head file as a local path: `cache_dir/<fingerprint>.safetensors` when a
    /// cached copy hashes to `info.head_fingerprint`, else downloaded (streamed to disk with a
    /// progress bar, hashed on the way, renamed into place only when the hash matches).
    pub async fn fetch_head(
        &self,
        info: &FullVocabInfo,
        cache_dir: &Path,
    ) -> Result<PathBuf, ClientError> {
        let expected = info.head_fingerprint.to_ascii_lowercase();
        // The fingerprint names a file: only a SHA-256 in hex may become a path.
        if expected.len() != 64 || !expected.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ClientError::InvalidResponse {
                url: HEAD_PATH.to_string(),
                message: format!(
                    "/v1/info's head_fingerprint {:?} is not a SHA-256 in hex",
                    info.head_fingerprint
                ),
            });
        }
        let path = cache_dir.join(format!("{expected}.safetensors"));
        if path.exists() {
            let got = sha256_file(&path)?;
            if got == expected {
                tracing::info!("teacher head: cached at {}", path.display());
                return Ok(path);
            }
            tracing::warn!(
                "{}: cached head has SHA-256 {got}, not {expected}; fetching it again",
                path.display()
            );
        }
        std::fs::create_dir_all(cache_dir).map_err(io(cache_dir))?;
        let route = info.head_route.clone();
        let opts = &self.inner.opts;
        self.with_retries("GET /v1/head", opts.max_wait, opts.max_attempts, |base| {
            let (route, path, expected) = (&route, &path, &expected);
            async move {
                let url = endpoint(&base, route);
                self.download_head(&url, path, expected, info.head_bytes)
                    .await
            }
        })
        .await?;
        tracing::info!("teacher head saved to {}", path.display());
        Ok(path)
    }

    /// One download attempt of the head into `path` (via a temporary file beside it).
    async fn download_head(
        &self,
        url: &Url,
        path: &Path,
        expected: &str,
        len: u64,
    ) -> Result<(), ClientError> {
        let mut rb = self.inner.http.get(url.clone());
        if let Some(key) = &self.inner.opts.api_key {
            rb = rb.bearer_auth(key);
        }
        let transport = |e: reqwest::Error| ClientError::Transport {
            url: url.to_string(),
            message: xdistill_shared::report::error_chain(&e),
        };
        // A long download must not be cut by the scoring timeout: the head of an 8B model is
        // over a gigabyte.
        let mut resp = rb
            .timeout(std::time::Duration::from_secs(24 * 3600))
            .send()
            .await
            .map_err(transport)?;
        let status = resp.status();
        if !status.is_success() {
            // The body is the error; `send`'s classification applies.
            let ct = resp
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let bytes = super::body::read_error(resp).await;
            let (kind, message, field) = super::wire::error_body(ct.as_deref(), &bytes, status);
            return Err(if super::is_retryable_status(status) {
                ClientError::Unavailable {
                    url: url.to_string(),
                    status: status.as_u16(),
                    message,
                    retry_after: None,
                }
            } else {
                ClientError::Rejected {
                    url: url.to_string(),
                    status: status.as_u16(),
                    kind,
                    message,
                    field,
                }
            });
        }
        // Unique to this writer: runs may share the cache (`checkpointing.cache_dir`).
        let tmp = path.with_extension(format!(
            "part-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        let bar = indicatif::ProgressBar::new(len).with_style(
            indicatif::ProgressStyle::with_template(
                "teacher head {bytes}/{total_bytes} {wide_bar} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let mut hasher = Sha256::new();
        let mut got_len = 0u64;
        let result = async {
            while let Some(chunk) = resp.chunk().await.map_err(transport)? {
                if got_len + chunk.len() as u64 > len {
                    // Longer than /v1/info says: not the head (and not a disk to fill).
                    return Err(ClientError::TooLarge {
                        url: url.to_string(),
                        limit: len,
                    });
                }
                hasher.update(&chunk);
                file.write_all(&chunk).map_err(io(&tmp))?;
                got_len += chunk.len() as u64;
                bar.set_position(got_len);
            }
            file.flush().map_err(io(&tmp))?;
            Ok::<(), ClientError>(())
        }
        .await;
        bar.finish_and_clear();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let got = hex::encode(hasher.finalize());
        if got != expected || got_len != len {
            let _ = std::fs::remove_file(&tmp);
            return Err(ClientError::HeadMismatch {
                url: url.to_string(),
                expected: expected.to_string(),
                got,
                bytes: got_len,
                expected_bytes: len,
            });
        }
        std::fs::rename(&tmp, path).map_err(io(path))?;
        Ok(())
    }
}

/// Checks a `/hidden_states` answer against its request and the head the client holds.
pub fn check_hidden_response(
    req: &HiddenRequest,
    resp: &HiddenResponse,
    spec: &HiddenSpec,
) -> Result<(), String> {
    if resp.head_fingerprint != spec.head_fingerprint {
        return Err(format!(
            "the hidden states go with head {}, but this run holds head {} (the teacher's model \
             changed; restart the run to fetch the new head)",
            resp.head_fingerprint, spec.head_fingerprint
        ));
    }
    if resp.hidden_size != spec.hidden_size {
        return Err(format!(
            "hidden_size {}, the head has {}",
            resp.hidden_size, spec.hidden_size
        ));
    }
    if resp.results.len() != req.sequences.len() {
        return Err(format!(
            "{} results for {} sequences",
            resp.results.len(),
            req.sequences.len()
        ));
    }
    for (i, (r, s)) in resp.results.iter().zip(&req.sequences).enumerate() {
        let want = s.len().saturating_sub(1 + req.start_of(i));
        if r.rows != want {
            return Err(format!(
                "sequence {i}: {} rows for {} tokens from position {} (expected {want})",
                r.rows,
                s.len(),
                req.start_of(i)
            ));
        }
    }
    Ok(())
}

fn io(p: &Path) -> impl FnOnce(std::io::Error) -> ClientError {
    let path = p.to_path_buf();
    move |source| ClientError::Io { path, source }
}

/// SHA-256 (hex) of a file, read in blocks.
fn sha256_file(path: &Path) -> Result<String, ClientError> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io(path))?;
    Ok(hex::encode(h.finalize()))
}
