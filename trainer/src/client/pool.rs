//! One async runtime for every teacher of a run. The training loop is synchronous: it (and the
//! prefetch thread) blocks on the pool, and a step's requests to all its teachers are futures
//! awaited together inside that one `block_on`, so a step waits for the slowest teacher, not the
//! sum, with no thread per request and no runtime per teacher.

use super::{ClientError, TeacherClient};
use std::future::Future;
use xdistill_shared::protocol::{SequenceScores, TopkRequest};

/// Worker threads of the pool's runtime. They drive sockets, timers and the HTTP connections;
/// the request futures themselves are polled by the thread blocked on them, so two are plenty
/// however many teachers there are.
const WORKER_THREADS: usize = 2;

/// A scoring request that failed (after the client's retries), naming the teacher.
#[derive(Debug, thiserror::Error)]
#[error("teacher {teacher:?}: {message}")]
pub struct ScoreError {
    pub teacher: String,
    pub message: String,
}

/// The run's teacher connections (one [`TeacherClient`] per teacher, each over its replicas) on
/// one tokio runtime. Safe to share between threads (the loop and a [`super::Prefetcher`]).
pub struct TeacherPool {
    rt: tokio::runtime::Runtime,
    teachers: Vec<(String, TeacherClient)>,
}

impl TeacherPool {
    /// An empty pool with its runtime; [`Self::add`] the teachers.
    pub fn new() -> Result<TeacherPool, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name("teacher-pool")
            .enable_all()
            .build()
            .map_err(|e| ClientError::Build(format!("tokio runtime: {e}")))?;
        Ok(TeacherPool {
            rt,
            teachers: vec![],
        })
    }

    /// Adds a teacher under `name` (used in errors); returns its index.
    pub fn add(&mut self, name: &str, client: TeacherClient) -> usize {
        self.teachers.push((name.to_string(), client));
        self.teachers.len() - 1
    }

    /// The client of teacher `i`.
    pub fn client(&self, i: usize) -> &TeacherClient {
        &self.teachers[i].1
    }

    /// The number of teachers.
    pub fn len(&self) -> usize {
        self.teachers.len()
    }

    /// Whether the pool has no teacher yet.
    pub fn is_empty(&self) -> bool {
        self.teachers.is_empty()
    }

    /// Runs `f` to completion on the pool's runtime, blocking this (non-async) thread. Several
    /// threads may block on the pool at once.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// Teacher `i`'s answers to `req`, one per sequence; a failure names the teacher.
    pub async fn ask(
        &self,
        i: usize,
        req: &TopkRequest,
    ) -> Result<Vec<SequenceScores>, ScoreError> {
        let (name, client) = &self.teachers[i];
        match client.score(req).await {
            Ok(results) => Ok(results),
            Err(e) => Err(ScoreError {
                teacher: name.clone(),
                message: e.to_string(),
            }),
        }
    }

    /// Each `(teacher, request)`'s answers, all asked at once, in job order.
    pub async fn ask_each(
        &self,
        reqs: &[(usize, TopkRequest)],
    ) -> Result<Vec<Vec<SequenceScores>>, ScoreError> {
        join_in_order(reqs.iter().map(|(i, req)| self.ask(*i, req))).await
    }
}

/// Awaits every future together; their outputs in order, or the first error in order (not the
/// first to happen, so the report does not depend on timing). Every future runs to its end.
pub async fn join_in_order<T, E, I>(futures: I) -> Result<Vec<T>, E>
where
    I: IntoIterator,
    I::Item: Future<Output = Result<T, E>>,
{
    futures::future::join_all(futures)
        .await
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn jobs_run_together_and_the_first_error_in_order_wins() {
        let pool = TeacherPool::new().unwrap();
        let job = |ms: u64, fail: bool| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            if fail {
                Err(ms)
            } else {
                Ok(ms)
            }
        };
        // Together: each job waits at a barrier for all three, which only passes if they run
        // at once (one after another they would wait forever; the timeout turns that into a
        // failure, not a hang). No wall-clock bound, so a busy machine cannot fail it.
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(3));
        let met = |ms: u64| {
            let barrier = barrier.clone();
            async move {
                barrier.wait().await;
                job(ms, false).await
            }
        };
        let ok = pool.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(60),
                join_in_order([met(20), met(30), met(10)]),
            )
            .await
        });
        assert_eq!(
            ok.expect("the jobs did not run together"),
            Ok(vec![20, 30, 10])
        );
        // The later job fails first in time; the earlier one in job order is reported.
        let err = pool.block_on(join_in_order([
            job(10, false),
            job(150, true),
            job(20, true),
        ]));
        assert_eq!(err, Err(150));
    }
}
