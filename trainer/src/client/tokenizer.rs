//! The teacher's tokenizer: `GET /tokenizer.json`, the hash-keyed local cache, and whether the
//! student shares it (which decides same- vs cross-tokenizer training).

use super::wire::{endpoint, TOKENIZER_PATH};
use super::{ClientError, TeacherClient};
use bytes::Bytes;
use std::path::{Path, PathBuf};
use xdistill_shared::protocol::InfoResponse;

/// Whether the student and the teacher share a tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TeacherTokenizer {
    /// Byte-identical `tokenizer.json`: same-tokenizer losses, no alignment.
    Same,
    /// The teacher's own tokenizer file: cross-tokenizer alignment needed.
    Different(PathBuf),
}

impl TeacherClient {
    /// `GET /tokenizer.json`: the teacher's tokenizer file, as served (retried).
    pub async fn tokenizer_json(&self) -> Result<Bytes, ClientError> {
        let max_wait = self.inner.opts.max_wait;
        self.with_retries(
            "GET /tokenizer.json",
            max_wait,
            self.inner.opts.max_attempts,
            |base| async move {
                let url = endpoint(&base, TOKENIZER_PATH);
                let rb = self.inner.http.get(url.clone());
                Ok(self.send(&url, rb, super::body::TOKENIZER_BODY).await?.1)
            },
        )
        .await
    }

    /// The teacher tokenizer as a local file, cached as `cache_dir/<sha256>/tokenizer.json`
    /// keyed by `info.tokenizer_sha256`; downloaded (and its hash checked) when not cached.
    pub async fn fetch_tokenizer(
        &self,
        cache_dir: &Path,
        info: &InfoResponse,
    ) -> Result<PathBuf, ClientError> {
        let expected = info.tokenizer_sha256.to_ascii_lowercase();
        // The hash names a directory: only a SHA-256 in hex may become a path.
        if expected.len() != 64 || !expected.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ClientError::InvalidResponse {
                url: TOKENIZER_PATH.to_string(),
                message: format!(
                    "/v1/info's tokenizer_sha256 {:?} is not a SHA-256 in hex",
                    info.tokenizer_sha256
                ),
            });
        }
        let dir = cache_dir.join(&expected);
        let path = dir.join("tokenizer.json");
        if let Ok(bytes) = std::fs::read(&path) {
            if sha256_hex(&bytes) == expected {
                return Ok(path);
            }
            tracing::warn!(
                "{}: cached tokenizer has the wrong hash; fetching it again",
                path.display()
            );
        }
        let bytes = self.tokenizer_json().await?;
        let got = sha256_hex(&bytes);
        if got != expected {
            return Err(ClientError::TokenizerMismatch { expected, got });
        }
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| ClientError::Io { path: p, source }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        // Unique to this writer: runs may share the cache (`checkpointing.cache_dir`).
        let tmp = dir.join(format!(
            ".tokenizer.json.tmp-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&tmp, &bytes).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        tracing::info!("teacher tokenizer saved to {}", path.display());
        Ok(path)
    }

    /// The teacher tokenizer for a run whose student uses `student_tokenizer`:
    /// [`TeacherTokenizer::Same`] when the files are identical (same sha256 as `/v1/info`'s),
    /// else a local file: `local` when given (a hash mismatch is only warned about, since an
    /// equivalent file may be formatted differently), else fetched into `cache_dir`.
    pub async fn teacher_tokenizer(
        &self,
        info: &InfoResponse,
        student_tokenizer: &Path,
        local: Option<&Path>,
        cache_dir: &Path,
    ) -> Result<TeacherTokenizer, ClientError> {
        let student = std::fs::read(student_tokenizer).map_err(|source| ClientError::Io {
            path: student_tokenizer.to_path_buf(),
            source,
        })?;
        if sha256_hex(&student).eq_ignore_ascii_case(&info.tokenizer_sha256) {
            return Ok(TeacherTokenizer::Same);
        }
        if let Some(p) = local {
            let bytes = std::fs::read(p).map_err(|source| ClientError::Io {
                path: p.to_path_buf(),
                source,
            })?;
            if !sha256_hex(&bytes).eq_ignore_ascii_case(&info.tokenizer_sha256) {
                tracing::warn!(
                    "{}: sha256 differs from the teacher's tokenizer ({}); using it anyway",
                    p.display(),
                    info.tokenizer_sha256
                );
            }
            return Ok(TeacherTokenizer::Different(p.to_path_buf()));
        }
        Ok(TeacherTokenizer::Different(
            self.fetch_tokenizer(cache_dir, info).await?,
        ))
    }
}

/// Lower-case hex SHA-256 of `bytes` (the form `/v1/info` advertises).
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}
