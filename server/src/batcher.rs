//! Admission and batching, as an actor in front of the model worker.
//!
//! - Admission at the door: a request's input tokens are taken from a token semaphore of
//!   `--max-queue-tokens` permits with `try_acquire`; when they are not available the request
//!   gets 503 + Retry-After before any work. Permits return when each sequence is answered.
//! - The collector task receives sequences, waits up to `--max-wait-ms` for more (or until the
//!   padded batch would exceed `--max-batch-tokens`), keeps collecting while the worker is busy,
//!   and hands the worker whole batches. Requests with many sequences are split across batches.

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::{Candidates, ValidSequence};
use crate::scoring::{ScoreParams, ScoringError};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use xdistill_shared::protocol::SequenceScores;

/// Reply of the worker for one sequence.
pub type JobResult = Result<SequenceScores, ScoringError>;

/// Admitted tokens of one sequence; returned to the queue budget when dropped.
pub struct Admission {
    _permit: OwnedSemaphorePermit,
    tokens: usize,
    metrics: Arc<Metrics>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.metrics
            .queue_tokens
            .fetch_sub(self.tokens as i64, Relaxed);
        self.metrics.queue_sequences.fetch_sub(1, Relaxed);
    }
}

/// One sequence to score.
pub struct Job {
    pub ids: Arc<[u32]>,
    pub start: usize,
    pub params: ScoreParams,
    /// `[rows, m]` candidate ids to score exactly, if asked for.
    pub candidates: Option<Candidates>,
    pub reply: oneshot::Sender<JobResult>,
    pub admission: Admission,
}

impl Job {
    /// Tokens the model reads: `S - 1` (the last token predicts nothing we return), or all `S`
    /// when a next token is asked for.
    pub fn input_tokens(&self) -> usize {
        (self.ids.len() + self.params.next.is_some() as usize).saturating_sub(1)
    }
}

/// A set of sequences run in one forward pass.
pub struct Batch {
    pub jobs: Vec<Job>,
}

/// Tokens admitted for one request, to be split among its sequences.
pub struct Ticket {
    permit: OwnedSemaphorePermit,
}

/// Handle of the batcher, cheap to clone.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Job>,
    /// The worker's queue, only to see whether the worker is still there (it is closed once the
    /// worker thread has ended and dropped its receiver).
    worker: mpsc::Sender<Batch>,
    budget: Arc<Semaphore>,
    max_queue_tokens: usize,
    metrics: Arc<Metrics>,
}

/// Batching limits.
#[derive(Debug, Clone, Copy)]
pub struct BatchConfig {
    pub max_batch_tokens: usize,
    pub max_wait: Duration,
    pub max_queue_tokens: usize,
}

impl Batcher {
    /// Starts the collector task; batches go to `worker`.
    pub fn start(cfg: BatchConfig, worker: mpsc::Sender<Batch>, metrics: Arc<Metrics>) -> Batcher {
        // The token budget bounds the work in flight; the channel only smooths bursts.
        let (tx, rx) = mpsc::channel(4096);
        tokio::spawn(collect(rx, worker.clone(), cfg));
        Batcher {
            tx,
            worker,
            budget: Arc::new(Semaphore::new(cfg.max_queue_tokens)),
            max_queue_tokens: cfg.max_queue_tokens,
            metrics,
        }
    }

    /// True once the model worker thread has ended (its receiver is dropped, as when the thread
    /// returns or unwinds): nothing queued from now on can be scored.
    pub fn worker_stopped(&self) -> bool {
        self.worker.is_closed()
    }

    /// Takes `tokens` from the queue budget at once, or refuses (503) without waiting.
    pub fn admit(&self, tokens: usize) -> Result<Ticket, ApiError> {
        if self.worker_stopped() {
            return Err(ApiError::WorkerStopped);
        }
        let full = || {
            self.metrics.queue_rejected.fetch_add(1, Relaxed);
            ApiError::QueueFull {
                queued: self.max_queue_tokens - self.budget.available_permits(),
                limit: self.max_queue_tokens,
                retry_after_s: 1,
            }
        };
        let n = u32::try_from(tokens).map_err(|_| full())?;
        let permit = self
            .budget
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| full())?;
        Ok(Ticket { permit })
    }

    /// Queues one sequence paid from `ticket`; its scores arrive on the returned receiver.
    pub async fn submit(
        &self,
        ticket: &mut Ticket,
        seq: &ValidSequence,
        params: ScoreParams,
    ) -> Result<oneshot::Receiver<JobResult>, ApiError> {
        let tokens = seq.input_tokens();
        let permit = ticket
            .permit
            .split(tokens)
            .ok_or_else(|| ApiError::Internal("ticket smaller than its sequences".into()))?;
        self.metrics.queue_tokens.fetch_add(tokens as i64, Relaxed);
        self.metrics.queue_sequences.fetch_add(1, Relaxed);
        let admission = Admission {
            _permit: permit,
            tokens,
            metrics: self.metrics.clone(),
        };
        let (reply, rx) = oneshot::channel();
        let job = Job {
            ids: seq.ids.clone(),
            start: seq.start,
            params,
            candidates: seq.candidates.clone(),
            reply,
            admission,
        };
        self.tx.send(job).await.map_err(|_| {
            if self.worker_stopped() {
                ApiError::WorkerStopped
            } else {
                ApiError::ShuttingDown
            }
        })?;
        Ok(rx)
    }
}

/// Padded cost of a batch: sequences × longest input.
fn padded(n: usize, longest: usize) -> usize {
    n * longest
}

/// True when the pending jobs would fill a batch.
fn is_full(pending: &VecDeque<Job>, budget: usize) -> bool {
    let longest = pending.iter().map(Job::input_tokens).max().unwrap_or(0);
    padded(pending.len(), longest) >= budget
}

/// Takes the next batch: the oldest job always, then every other pending job (oldest first)
/// that keeps the padded size within `budget`. A job over the budget on its own runs alone.
fn take_batch(pending: &mut VecDeque<Job>, budget: usize) -> Vec<Job> {
    let Some(first) = pending.pop_front() else {
        return Vec::new();
    };
    let mut longest = first.input_tokens();
    let mut batch = vec![first];
    if longest >= budget {
        return batch;
    }
    let mut rest = VecDeque::with_capacity(pending.len());
    while let Some(job) = pending.pop_front() {
        let l = longest.max(job.input_tokens());
        if padded(batch.len() + 1, l) <= budget {
            longest = l;
            batch.push(job);
        } else {
            rest.push_back(job);
        }
    }
    *pending = rest;
    batch
}

/// The collector loop; ends when every handle is dropped and all pending work is handed over.
async fn collect(mut rx: mpsc::Receiver<Job>, worker: mpsc::Sender<Batch>, cfg: BatchConfig) {
    let mut pending: VecDeque<Job> = VecDeque::new();
    let mut open = true;
    loop {
        // 1. Wait for work.
        if pending.is_empty() {
            match rx.recv().await {
                Some(j) => pending.push_back(j),
                None => break,
            }
        }
        // 2. Coalesce until full or the wait window closes.
        let deadline = Instant::now() + cfg.max_wait;
        while open && !is_full(&pending, cfg.max_batch_tokens) {
            tokio::select! {
                j = rx.recv() => match j {
                    Some(j) => pending.push_back(j),
                    None => open = false,
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        // 3. Wait for the worker to take a batch, collecting meanwhile.
        let slot = loop {
            tokio::select! {
                biased;
                slot = worker.reserve() => break slot,
                j = rx.recv(), if open && !is_full(&pending, cfg.max_batch_tokens) => match j {
                    Some(j) => pending.push_back(j),
                    None => open = false,
                },
            }
        };
        let Ok(slot) = slot else {
            // The worker is gone: fail everything still queued.
            for j in pending.drain(..) {
                let _ = j.reply.send(Err(ScoringError::WorkerStopped));
            }
            while let Ok(j) = rx.try_recv() {
                let _ = j.reply.send(Err(ScoringError::WorkerStopped));
            }
            return;
        };
        // 4. Drop work whose caller went away, then hand over one batch.
        pending.retain(|j| !j.reply.is_closed());
        let batch = take_batch(&mut pending, cfg.max_batch_tokens);
        if !batch.is_empty() {
            slot.send(Batch { jobs: batch });
        }
        if !open && pending.is_empty() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdistill_shared::protocol::ValuesKind;

    fn params() -> ScoreParams {
        ScoreParams::native(2, 1.0, ValuesKind::Logprobs)
    }

    fn seq(ids: Vec<u32>) -> ValidSequence {
        ValidSequence {
            ids: ids.into(),
            start: 0,
            next_row: false,
            candidates: None,
        }
    }

    fn cfg(max_batch_tokens: usize, wait_ms: u64) -> BatchConfig {
        BatchConfig {
            max_batch_tokens,
            max_wait: Duration::from_millis(wait_ms),
            max_queue_tokens: 100,
        }
    }

    #[tokio::test]
    async fn admission_refuses_beyond_budget_and_returns_permits() {
        let metrics = Arc::new(Metrics::default());
        let (wtx, _wrx) = mpsc::channel(1);
        let b = Batcher::start(cfg(50, 1), wtx, metrics.clone());
        let t1 = b.admit(60).unwrap();
        assert!(matches!(
            b.admit(41),
            Err(ApiError::QueueFull { queued: 60, .. })
        ));
        drop(t1);
        let _t2 = b.admit(100).unwrap();
        assert_eq!(metrics.queue_rejected.load(Relaxed), 1);
    }

    /// Jobs are coalesced under the token budget, split across batches when over it, and every
    /// reply reaches its own caller.
    #[tokio::test]
    async fn coalesces_splits_and_routes() {
        let metrics = Arc::new(Metrics::default());
        let (wtx, mut wrx) = mpsc::channel::<Batch>(1);
        let b = Batcher::start(cfg(12, 20), wtx, metrics.clone());
        let mut ticket = b.admit(20).unwrap();
        let mut rxs = Vec::new();
        for n in [3u32, 4, 5, 6, 7] {
            // 5 sequences of 4 input tokens (5 ids) each: at most 3 fit 12 padded tokens.
            rxs.push(
                b.submit(&mut ticket, &seq(vec![n; 5]), params())
                    .await
                    .unwrap(),
            );
        }
        let mut sizes = Vec::new();
        for _ in 0..2 {
            let batch = wrx.recv().await.unwrap();
            sizes.push(batch.jobs.len());
            for j in batch.jobs {
                let id = j.ids[0];
                let _ = j.reply.send(Ok(SequenceScores {
                    rows: id as usize,
                    ..Default::default()
                }));
            }
        }
        assert_eq!(sizes, vec![3, 2]);
        for (n, rx) in [3usize, 4, 5, 6, 7].into_iter().zip(rxs) {
            assert_eq!(rx.await.unwrap().unwrap().rows, n);
        }
        assert_eq!(metrics.queue_tokens.load(Relaxed), 0);
    }

    #[tokio::test]
    async fn drops_cancelled_jobs() {
        let metrics = Arc::new(Metrics::default());
        let (wtx, mut wrx) = mpsc::channel::<Batch>(1);
        let b = Batcher::start(cfg(100, 20), wtx, metrics);
        let mut ticket = b.admit(8).unwrap();
        let gone = b
            .submit(&mut ticket, &seq(vec![1u32; 5]), params())
            .await
            .unwrap();
        drop(gone);
        let _kept = b
            .submit(&mut ticket, &seq(vec![2u32; 5]), params())
            .await
            .unwrap();
        let batch = wrx.recv().await.unwrap();
        assert_eq!(batch.jobs.len(), 1);
        assert_eq!(batch.jobs[0].ids[0], 2);
    }
}
