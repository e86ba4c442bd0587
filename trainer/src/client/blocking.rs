//! A synchronous face of [`TeacherClient`] for the (synchronous) training loop.

use super::{ClientError, TeacherClient, TeacherTokenizer};
use reqwest::Url;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use xdistill_shared::protocol::{InfoResponse, TopkRequest, TopkResponse};

/// Owns a small tokio runtime and blocks on the async client. Cheap to clone; safe to use from
/// several threads at once (e.g. the loop and a [`super::Prefetcher`]).
#[derive(Clone)]
pub struct BlockingClient {
    rt: Arc<tokio::runtime::Runtime>,
    client: TeacherClient,
}

impl BlockingClient {
    pub fn new(client: TeacherClient) -> Result<BlockingClient, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("teacher-client")
            .enable_all()
            .build()
            .map_err(|e| ClientError::Build(format!("tokio runtime: {e}")))?;
        Ok(BlockingClient {
            rt: Arc::new(rt),
            client,
        })
    }

    pub fn client(&self) -> &TeacherClient {
        &self.client
    }

    /// The runtime, for callers that want to drive the async client themselves.
    pub fn handle(&self) -> tokio::runtime::Handle {
        self.rt.handle().clone()
    }

    pub fn topk(&self, req: &TopkRequest) -> Result<TopkResponse, ClientError> {
        self.rt.block_on(self.client.topk(req))
    }

    pub fn info(&self) -> Result<InfoResponse, ClientError> {
        self.rt.block_on(self.client.info())
    }

    pub fn fetch_tokenizer(
        &self,
        cache_dir: &Path,
        info: &InfoResponse,
    ) -> Result<PathBuf, ClientError> {
        self.rt
            .block_on(self.client.fetch_tokenizer(cache_dir, info))
    }

    pub fn info_all(&self) -> Vec<(Url, Result<InfoResponse, ClientError>)> {
        self.rt.block_on(self.client.info_all())
    }

    pub fn teacher_tokenizer(
        &self,
        info: &InfoResponse,
        student_tokenizer: &Path,
        local: Option<&Path>,
        cache_dir: &Path,
    ) -> Result<TeacherTokenizer, ClientError> {
        self.rt.block_on(
            self.client
                .teacher_tokenizer(info, student_tokenizer, local, cache_dir),
        )
    }

    pub fn wait_ready(&self, max_wait: Duration) -> Result<Url, ClientError> {
        self.rt.block_on(self.client.wait_ready(max_wait))
    }
}
