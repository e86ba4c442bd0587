//! The model worker: one OS thread owns the [`Decoder`] and runs whole batches it receives over
//! a channel. Batches are right-padded (the causal mask keeps real tokens exact); logits are
//! computed a chunk of positions at a time so memory stays bounded for large vocabularies.
//!
//! Scoring takes one of two paths ([`TopkPath`]): on the host (logits copied out, the fast Rust
//! loop of [`topk::score_rows`]) or on the model's device ([`xdistill_shared::topk::topk_rows`]:
//! only the `[N, k]` results are copied back; the default on a GPU).

use crate::batcher::{Batch, Job};
use crate::metrics::Metrics;
use crate::model::{self, ModelFacts};
use crate::topk::{self, ScoreParams, TopkPath};
use candle_core::Device;
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
    /// Where top-k runs (auto: on the device for a GPU, on the host for the CPU).
    pub topk: TopkPath,
}

/// Time spent per batch in the model and in top-k.
#[derive(Default)]
struct Timing {
    forward: Duration,
    topk: Duration,
}

struct Worker {
    decoder: Decoder,
    scorer: Scorer,
    max_batch_tokens: usize,
    metrics: Arc<Metrics>,
}

/// Turns hidden states into scores: the LM head a chunk of positions at a time, then top-k.
#[derive(Debug, Clone, Copy)]
pub struct Scorer {
    /// Valid ids (the tokenizer's vocabulary); LM-head rows at or above are padding.
    pub vocab: usize,
    /// Rows of the LM head.
    pub logits_size: usize,
    /// Positions per LM-head chunk (bounds the `[c, V]` logits held at once).
    pub chunk_rows: usize,
    /// Top-k on the device (true) or on the host.
    pub on_device: bool,
}

impl Scorer {
    /// Chunks of [`LOGIT_CHUNK_ELEMS`] logits; device scoring where `path` resolves to it.
    pub fn new(vocab: usize, logits_size: usize, path: TopkPath, device: &Device) -> Scorer {
        Scorer {
            vocab,
            logits_size,
            chunk_rows: (LOGIT_CHUNK_ELEMS / logits_size.max(1)).max(1),
            on_device: path.on_device(device),
        }
    }
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
            let scorer = Scorer::new(
                facts.vocab_size,
                facts.logits_size,
                cfg.topk,
                decoder.device(),
            );
            tracing::info!(
                on_device = scorer.on_device,
                chunk_rows = scorer.chunk_rows,
                "top-k path"
            );
            let worker = Worker {
                decoder,
                scorer,
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
        self.scorer.score(
            &self.decoder,
            hidden,
            first,
            &job.ids,
            job.start,
            &job.params,
            acc,
            timing,
        )
    }
}

impl Scorer {
    /// `hidden`: [n, H], the states of positions `first..first + n` of sequence `ids`. Appends to
    /// `acc` the rows of the requested positions (`start..S-1`) in that range, a chunk of
    /// [`Scorer::chunk_rows`] positions at a time (row p predicts `ids[p + 1]`).
    #[allow(clippy::too_many_arguments)]
    fn score(
        &self,
        decoder: &Decoder,
        hidden: &Tensor,
        first: usize,
        ids: &[u32],
        start: usize,
        params: &ScoreParams,
        acc: &mut SequenceScores,
        timing: &mut Timing,
    ) -> candle_core::Result<()> {
        let n = hidden.dim(0)?;
        let lo = first.max(start);
        let hi = (first + n).min(ids.len().saturating_sub(1));
        let mut c0 = lo;
        while c0 < hi {
            let c1 = (c0 + self.chunk_rows).min(hi);
            let f0 = Instant::now();
            // [c, H] -> [c, V] in the model dtype.
            let logits = decoder.logits(&hidden.narrow(0, c0 - first, c1 - c0)?)?;
            timing.forward += f0.elapsed();
            let targets = &ids[c0 + 1..c1 + 1];
            let t0 = Instant::now();
            let s = if self.on_device && device_topk_fits(params.k) {
                self.score_on_device(&logits, targets, params)?
            } else {
                let logits = logits.to_dtype(DType::F32)?.contiguous()?;
                with_host_f32(&logits, |rows| {
                    topk::score_rows(rows, self.logits_size, self.vocab, targets, params)
                })?
            };
            timing.topk += t0.elapsed();
            append(acc, s);
            c0 = c1;
        }
        Ok(())
    }

    /// Top-k, target log-prob and logsumexp of `logits` [c, V] where they are; only the `[c, k]`
    /// and `[c]` results come back to the host.
    fn score_on_device(
        &self,
        logits: &Tensor,
        targets: &[u32],
        p: &ScoreParams,
    ) -> candle_core::Result<SequenceScores> {
        let tg = Tensor::new(targets, logits.device())?;
        let r = xdistill_shared::topk::topk_rows(
            logits,
            &tg,
            p.k,
            p.temperature,
            self.vocab.min(self.logits_size),
            p.values,
        )?;
        Ok(SequenceScores {
            rows: targets.len(),
            k: p.k,
            topk_ids: r.ids.flatten_all()?.to_vec1()?,
            topk_values: r.values.flatten_all()?.to_vec1()?,
            target_logprobs: r.target_logprobs.to_vec1()?,
            logsumexp: r.logsumexp.to_vec1()?,
        })
    }
}

/// The device sort keeps 2k candidates per chunk of [`xdistill_shared::topk::SORT_CHUNK`] columns;
/// larger k (only with a raised `--max-k`) goes to the host path.
fn device_topk_fits(k: usize) -> bool {
    k >= 1 && 2 * k <= xdistill_shared::topk::SORT_CHUNK
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::VarBuilder;
    use xdistill_shared::hf::ModelConfig;
    use xdistill_shared::model::Ops;
    use xdistill_shared::protocol::ValuesKind;

    /// LM head of 9000 rows (more than one device sort chunk), of which 8990 are valid ids.
    const V: usize = 9000;
    const VALID: usize = 8990;

    fn decoder() -> Decoder {
        let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
            "model_type": "qwen3", "vocab_size": V, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "max_position_embeddings": 64, "rope_theta": 10000.0,
            "tie_word_embeddings": false
        }))
        .unwrap();
        let params = xdistill_trainer::init_model::random_params(&cfg, 0.5, 3).unwrap();
        let vb = VarBuilder::from_tensors(params, DType::F32, &Device::Cpu);
        Decoder::new(&cfg, vb, Ops::Fused).unwrap()
    }

    /// f64 scores of one logit row: top-k by a full sort, target log-prob, logsumexp.
    fn reference(row: &[f32], target: usize, k: usize, t: f64) -> (Vec<(u32, f64)>, f64, f64) {
        let z: Vec<f64> = row[..VALID].iter().map(|&x| x as f64 / t).collect();
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let mut idx: Vec<usize> = (0..VALID).collect();
        idx.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
        let top = idx[..k].iter().map(|&i| (i as u32, z[i] - lse)).collect();
        (top, z[target] - lse, lse)
    }

    /// Every chunking of the LM head, on both paths, gives the scores of the whole `[n, V]`
    /// logits computed at once, for exactly the requested positions.
    #[test]
    fn chunked_lm_head_equals_full_logits_on_both_paths() {
        let dec = decoder();
        let (first, n, start) = (2usize, 7usize, 4usize);
        // Hidden states of positions first..first+n: [n, 16], spread values.
        let h: Vec<f32> = (0..n * 16)
            .map(|i| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * 4.0)
            .collect();
        let hidden = Tensor::from_vec(h, (n, 16), &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..first + n + 1)
            .map(|i| (i * 997 % VALID) as u32)
            .collect();
        let full: Vec<Vec<f32>> = dec.logits(&hidden).unwrap().to_vec2().unwrap();
        let p = ScoreParams {
            k: 6,
            temperature: 0.8,
            values: ValuesKind::Logprobs,
        };
        for on_device in [false, true] {
            for chunk_rows in [1, 3, 64] {
                let scorer = Scorer {
                    vocab: VALID,
                    logits_size: V,
                    chunk_rows,
                    on_device,
                };
                let mut acc = SequenceScores {
                    k: p.k,
                    ..Default::default()
                };
                let mut timing = Timing::default();
                scorer
                    .score(&dec, &hidden, first, &ids, start, &p, &mut acc, &mut timing)
                    .unwrap();
                acc.check_shapes().unwrap();
                // Requested rows: positions start..first+n (row p predicts ids[p + 1]).
                assert_eq!(acc.rows, first + n - start);
                for (r, pos) in (start..first + n).enumerate() {
                    let (top, tl, lse) =
                        reference(&full[pos - first], ids[pos + 1] as usize, p.k, 0.8);
                    let what = format!("device {on_device} chunk {chunk_rows} row {r}");
                    let got_ids: Vec<u32> = top.iter().map(|e| e.0).collect();
                    assert_eq!(acc.ids_row(r), got_ids.as_slice(), "{what}");
                    for (v, want) in acc.values_row(r).iter().zip(&top) {
                        assert!(
                            (*v as f64 - want.1).abs() < 1e-4,
                            "{what}: {v} vs {}",
                            want.1
                        );
                    }
                    assert!((acc.target_logprobs[r] as f64 - tl).abs() < 1e-4, "{what}");
                    assert!((acc.logsumexp[r] as f64 - lse).abs() < 1e-4, "{what}");
                }
            }
        }
    }

    #[test]
    fn auto_path_is_host_on_the_cpu() {
        assert!(!TopkPath::Auto.on_device(&Device::Cpu));
        assert!(TopkPath::Device.on_device(&Device::Cpu));
        assert!(!TopkPath::Host.on_device(&Device::Cpu));
        assert!(device_topk_fits(1) && device_topk_fits(4096) && !device_topk_fits(4097));
    }
}
