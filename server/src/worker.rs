//! The model worker: one OS thread owns the [`Decoder`] and runs whole batches it receives over
//! a channel. Batches are right-padded (the causal mask keeps real tokens exact); logits are
//! computed a chunk of positions at a time so memory stays bounded for large vocabularies.

use crate::batcher::{Batch, Job};
use crate::metrics::Metrics;
use crate::model::{self, ModelFacts};
use crate::topk::{self, ScoreParams};
use candle_core::{DType, Storage, Tensor};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use xdistill_shared::model::{Decoder, KvCache};
use xdistill_shared::protocol::SequenceScores;

/// Most logits (f32) materialised at once: 16 Mi elements = 64 MiB, ≈110 positions of Qwen3.
const LOGIT_CHUNK_ELEMS: usize = 16 << 20;

/// What the worker thread needs to load its model.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub model: PathBuf,
    pub device: String,
    pub dtype: String,
    /// Inputs longer than this run alone, in chunks of this many tokens over a KV cache.
    pub max_batch_tokens: usize,
}

/// Time spent per batch in the model and in top-k.
#[derive(Default)]
struct Timing {
    forward: Duration,
    topk: Duration,
}

struct Worker {
    decoder: Decoder,
    /// Valid ids (the tokenizer's vocabulary); LM-head rows at or above are padding.
    vocab: usize,
    logits_size: usize,
    max_batch_tokens: usize,
    metrics: Arc<Metrics>,
}

/// Starts the worker thread. It loads the model, reports the outcome on `ready`, then serves
/// batches until `rx` closes (every queued batch is finished first).
pub fn spawn(
    cfg: WorkerConfig,
    metrics: Arc<Metrics>,
    mut rx: mpsc::Receiver<Batch>,
    ready: oneshot::Sender<Result<ModelFacts, String>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("xdistill-worker".into())
        .spawn(move || {
            let t0 = Instant::now();
            let (decoder, facts) = match model::load(&cfg.model, &cfg.device, &cfg.dtype) {
                Ok(x) => x,
                Err(e) => {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
            };
            tracing::info!(
                model = %cfg.model.display(),
                seconds = t0.elapsed().as_secs_f64(),
                "model loaded"
            );
            let worker = Worker {
                decoder,
                vocab: facts.vocab_size,
                logits_size: facts.logits_size,
                max_batch_tokens: cfg.max_batch_tokens.max(1),
                metrics,
            };
            if ready.send(Ok(facts)).is_err() {
                return; // the server is gone already
            }
            while let Some(batch) = rx.blocking_recv() {
                worker.run_batch(batch);
            }
            tracing::info!("worker stopped");
        })
}

/// Runs `f` on the f32 data of a contiguous tensor: borrowed in place on the CPU, copied to
/// the host from other devices.
fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&cpu.as_slice::<f32>()?[a..b]));
        }
    }
    let host = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&host))
}

fn append(acc: &mut SequenceScores, s: SequenceScores) {
    acc.rows += s.rows;
    acc.topk_ids.extend(s.topk_ids);
    acc.topk_values.extend(s.topk_values);
    acc.target_logprobs.extend(s.target_logprobs);
    acc.logsumexp.extend(s.logsumexp);
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl Worker {
    /// Runs one batch and answers every caller; never panics out of the thread.
    fn run_batch(&self, batch: Batch) {
        let t0 = Instant::now();
        // Drop cancelled work before computing it: the caller's receiver is gone.
        let (jobs, cancelled): (Vec<Job>, Vec<Job>) =
            batch.jobs.into_iter().partition(|j| !j.reply.is_closed());
        self.metrics
            .batch_cancelled
            .fetch_add(cancelled.len() as u64, Relaxed);
        drop(cancelled);
        if jobs.is_empty() {
            return;
        }
        let mut timing = Timing::default();
        let outcome =
            std::panic::catch_unwind(AssertUnwindSafe(|| self.compute(&jobs, &mut timing)));
        let results: Vec<Result<SequenceScores, String>> = match outcome {
            Ok(Ok(scores)) => scores.into_iter().map(Ok).collect(),
            Ok(Err(e)) => {
                tracing::error!("batch failed: {e}");
                jobs.iter()
                    .map(|_| Err(format!("forward failed: {e}")))
                    .collect()
            }
            Err(p) => {
                let msg = panic_message(p.as_ref());
                tracing::error!("batch panicked: {msg}");
                jobs.iter()
                    .map(|_| Err(format!("worker panicked: {msg}")))
                    .collect()
            }
        };
        let m = &self.metrics;
        m.batch_forwards.fetch_add(1, Relaxed);
        m.batch_sequences.observe(jobs.len() as f64);
        let longest = jobs.iter().map(Job::input_tokens).max().unwrap_or(0);
        m.batch_padded_tokens
            .observe((jobs.len() * longest.min(self.max_batch_tokens)) as f64);
        m.batch_forward_duration
            .observe(timing.forward.as_secs_f64());
        m.batch_topk_duration.observe(timing.topk.as_secs_f64());
        for (job, r) in jobs.into_iter().zip(results) {
            // A caller that left meanwhile is not an error.
            let _ = job.reply.send(r);
        }
        m.batch_duration.observe(t0.elapsed().as_secs_f64());
    }

    /// Scores of every job, in order.
    fn compute(
        &self,
        jobs: &[Job],
        timing: &mut Timing,
    ) -> candle_core::Result<Vec<SequenceScores>> {
        if let [job] = jobs {
            if job.input_tokens() > self.max_batch_tokens {
                return Ok(vec![self.compute_long(job, timing)?]);
            }
        }
        let dev = self.decoder.device();
        let (b, t) = (
            jobs.len(),
            jobs.iter().map(Job::input_tokens).max().unwrap_or(0),
        );
        // 1. Right-pad the inputs (the last token of each sequence is not needed): [B, T].
        let mut ids = vec![0u32; b * t];
        for (i, job) in jobs.iter().enumerate() {
            let n = job.input_tokens();
            ids[i * t..i * t + n].copy_from_slice(&job.ids[..n]);
        }
        let f0 = Instant::now();
        let ids = Tensor::from_vec(ids, (b, t), dev)?;
        // 2. Hidden states of all positions: [B, T, H].
        let hidden = self.decoder.forward_hidden(&ids, None, None, None)?;
        timing.forward += f0.elapsed();
        // 3. Per sequence: logits of its requested positions, then top-k.
        let mut out = Vec::with_capacity(b);
        for (i, job) in jobs.iter().enumerate() {
            let mut acc = self.empty(&job.params);
            self.score_positions(&hidden.get(i)?, 0, job, &mut acc, timing)?;
            out.push(acc);
        }
        Ok(out)
    }

    /// A sequence longer than the batch budget: chunks of `max_batch_tokens` over a KV cache.
    fn compute_long(&self, job: &Job, timing: &mut Timing) -> candle_core::Result<SequenceScores> {
        let dev = self.decoder.device();
        let mut cache = KvCache::default();
        let mut acc = self.empty(&job.params);
        let n = job.input_tokens();
        for c0 in (0..n).step_by(self.max_batch_tokens) {
            let c1 = (c0 + self.max_batch_tokens).min(n);
            let f0 = Instant::now();
            let ids = Tensor::new(&job.ids[c0..c1], dev)?.unsqueeze(0)?; // [1, c]
            let hidden = self
                .decoder
                .forward_hidden(&ids, Some(&mut cache), None, None)?
                .get(0)?; // [c, H]
            timing.forward += f0.elapsed();
            self.score_positions(&hidden, c0, job, &mut acc, timing)?;
        }
        Ok(acc)
    }

    fn empty(&self, p: &ScoreParams) -> SequenceScores {
        SequenceScores {
            k: p.k,
            ..Default::default()
        }
    }

    /// `hidden`: [n, H], the states of positions `first..first + n` of `job`'s sequence. Appends
    /// to `acc` the rows of the requested positions (`start..S-1`) that fall in that range.
    fn score_positions(
        &self,
        hidden: &Tensor,
        first: usize,
        job: &Job,
        acc: &mut SequenceScores,
        timing: &mut Timing,
    ) -> candle_core::Result<()> {
        let n = hidden.dim(0)?;
        let lo = first.max(job.start);
        let hi = (first + n).min(job.ids.len() - 1);
        let chunk = (LOGIT_CHUNK_ELEMS / self.logits_size.max(1)).max(1);
        let mut c0 = lo;
        while c0 < hi {
            let c1 = (c0 + chunk).min(hi);
            let f0 = Instant::now();
            // [c, H] -> [c, V] in f32.
            let logits = self
                .decoder
                .logits(&hidden.narrow(0, c0 - first, c1 - c0)?)?
                .to_dtype(DType::F32)?
                .contiguous()?;
            timing.forward += f0.elapsed();
            // Row p predicts token p + 1.
            let targets = &job.ids[c0 + 1..c1 + 1];
            let s = with_host_f32(&logits, |rows| {
                let t0 = Instant::now();
                let s = topk::score_rows(rows, self.logits_size, self.vocab, targets, &job.params);
                timing.topk += t0.elapsed();
                s
            })?;
            append(acc, s);
            c0 = c1;
        }
        Ok(())
    }
}
