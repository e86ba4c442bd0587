//! The model worker: one OS thread owns the [`Decoder`] and runs whole batches it receives over
//! a channel; what happens after the model's hidden states is [`crate::scoring`]'s.
//!
//! Two ways to run a batch (`--batch-invariant`):
//! - batch-invariant (the default): a sequence's bytes depend only on the sequence, its request
//!   and the server's flags, never on what it was batched with. Either each sequence runs its
//!   own forward (`[1, S - 1]`, no padding), or (`--packed-forward`, on a GPU by default) the
//!   batch's sequences run in one packed forward whose matmuls always take blocks of
//!   `--packed-rows` rows and whose attention runs per sequence
//!   ([`Decoder::forward_packed`]): the same kernels whatever the batch. Whether a sequence is
//!   packed depends on itself only (its length, a next row asked for), so it always takes the
//!   same path.
//! - padded: one right-padded `[B, T]` forward for the whole batch (the causal mask keeps real
//!   tokens exact up to float rounding, ~1e-6, which then depends on the batch's shape).
//!
//! In both, a sequence longer than `--max-batch-tokens` runs in chunks of that many tokens over
//! a KV cache; which path a sequence takes depends only on its own length. Each sequence fails
//! or succeeds on its own, with a typed [`ScoringError`] (a panic included).

use crate::batcher::{Batch, Job, JobResult};
use crate::metrics::Metrics;
use crate::model::{self, ModelFacts};
use crate::probe;
use crate::scoring::{
    HiddenSpan, LmHead, PackedRows, Phase, Scorer, ScoringError, SeqRef, Timing, TopkPath,
};
use candle_core::Tensor;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use xdistill_shared::model::{linear_kernel, Decoder, KvCache, PackedSeq};
use xdistill_shared::protocol::{ProbeInfo, SequenceScores};

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
    /// On the host path: the LM head fused with scoring, or the full logits first.
    pub lm_head: LmHead,
    /// One forward per sequence (no padding, no neighbours) instead of one per batch.
    pub batch_invariant: bool,
    /// In the batch-invariant mode: run packable sequences in one packed forward, matmuls in
    /// blocks of this many rows (`None`: a forward per sequence).
    pub packed_rows: Option<usize>,
    /// A GGUF file's weights: dequantized, or the projections kept quantized.
    pub gguf_weights: xdistill_shared::gguf::WeightMode,
}

struct Worker {
    decoder: Decoder,
    scorer: Scorer,
    max_batch_tokens: usize,
    batch_invariant: bool,
    /// Rows per matmul of the packed forward, when the batch-invariant mode packs.
    packed_rows: Option<usize>,
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
            let (decoder, mut facts) =
                match model::load_with(&cfg.model, &cfg.device, &cfg.dtype, cfg.gguf_weights) {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = ready.send(Err(e.to_string()));
                        return;
                    }
                };
            tracing::info!(
                model = %cfg.model.display(),
                device = %cfg.device,
                seconds = t0.elapsed().as_secs_f64(),
                "model loaded"
            );
            let scorer = Scorer::new(
                facts.vocab_size,
                facts.logits_size,
                cfg.topk,
                cfg.lm_head,
                decoder.device(),
            );
            facts.lm_head = scorer.path_name();
            // The head `/v1/head` serves, fingerprinted once (a chunk of rows at a time). A head
            // that cannot be served only turns those routes off.
            match crate::head_file::HeadServe::new(
                &decoder,
                &facts.fingerprint,
                &facts.architecture,
                facts.vocab_size,
            ) {
                Ok(head) => facts.head = Some(Arc::new(head)),
                Err(e) => tracing::warn!("no hidden-state or head routes: {e}"),
            }
            // Otherwise candle's matmul makes the fused head's tiles.
            let kernel = scorer.uses_head_kernel(decoder.lm_head());
            tracing::info!(
                on_device = scorer.on_device,
                lm_head = ?scorer.lm_head,
                lm_head_kernel = if kernel {
                    xdistill_cpu_kernels::simd::Simd::current().name()
                } else {
                    "candle"
                },
                linear_kernel = if linear_kernel(decoder.device(), decoder.lm_head().dtype()) {
                    xdistill_cpu_kernels::simd::Simd::current().name()
                } else {
                    "candle"
                },
                chunk_rows = scorer.chunk_rows,
                batch_invariant = cfg.batch_invariant,
                packed_rows = ?cfg.packed_rows,
                packed_gemm = xdistill_shared::model::packed_gemm_name(),
                attention = ?decoder.attention(),
                attention_bucket = xdistill_shared::model::attention_bucket(),
                cuda_kernels = xdistill_shared::device::cuda_kernels(),
                "scoring path"
            );
            let packed_rows = cfg.packed_rows.filter(|_| {
                let packs = decoder.packs();
                if !packs {
                    tracing::info!("packed forward: not for this model (sparse MoE or quantized)");
                }
                packs
            });
            let worker = Worker {
                decoder,
                scorer,
                max_batch_tokens: cfg.max_batch_tokens.max(1),
                batch_invariant: cfg.batch_invariant,
                packed_rows,
                metrics,
            };
            // A model whose probe cannot be scored (e.g. NaN logits) could answer nothing: it
            // does not start, rather than report itself healthy and fail every request.
            match rayon::scope(|_| worker.probe(facts.vocab_size, facts.max_position_embeddings)) {
                Ok(probe) => facts.probe = probe,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            }
            if ready.send(Ok(facts)).is_err() {
                return; // the server is gone already
            }
            while let Some(batch) = rx.blocking_recv() {
                // On a thread of rayon's pool, so that the parallel ops of the forward and the
                // LM head (hundreds per batch) start as work-stealing jobs instead of each being
                // injected from outside and waited for (≈ 30% of a small model's layer time).
                rayon::scope(|_| worker.run_batch(batch));
            }
            tracing::info!("worker stopped");
        })
}

impl Job {
    fn seq(&self) -> SeqRef<'_> {
        SeqRef {
            ids: &self.ids,
            start: self.start,
            params: &self.params,
            candidates: self.candidates.as_ref(),
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs `f`, turning a panic into [`ScoringError::Panicked`] and logging a failure.
fn guarded<T>(f: impl FnOnce() -> Result<T, ScoringError>) -> Result<T, ScoringError> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(x)) => Ok(x),
        Ok(Err(
            e @ (ScoringError::TemperatureOverflow { .. }
            | ScoringError::NonFiniteLogits { .. }
            | ScoringError::NonFiniteHidden { .. }),
        )) => {
            tracing::warn!("sequence refused: {e}");
            Err(e)
        }
        Ok(Err(e)) => {
            tracing::error!("sequence failed: {e}");
            Err(e)
        }
        Err(p) => {
            let msg = panic_message(p.as_ref());
            tracing::error!("worker panicked: {msg}");
            Err(ScoringError::Panicked(msg))
        }
    }
}

impl Worker {
    /// Scores the start-up probe ([`crate::probe`]) as a request scored alone would be (no
    /// metrics). `None` (logged) when the model's context is too short for one; an error
    /// naming the probe and the failure (for non-finite logits: the first id and position)
    /// when it cannot be scored, for then no request can be.
    fn probe(&self, vocab_size: usize, max_len: usize) -> Result<Option<ProbeInfo>, String> {
        let ids = probe::probe_ids(vocab_size, max_len);
        if ids.is_empty() {
            tracing::warn!("no start-up probe: the model scores no sequence of two tokens");
            return Ok(None);
        }
        let params = probe::probe_params(vocab_size);
        let seq = SeqRef {
            ids: &ids,
            start: 0,
            params: &params,
            candidates: None,
        };
        match self.compute(&[seq], &mut Timing::default()).pop() {
            Some(Ok(scores)) => {
                let info = probe::probe_info(&ids, &scores);
                tracing::info!(hash = %info.hash, positions = info.positions, "start-up probe");
                Ok(Some(info))
            }
            Some(Err(e)) => Err(format!(
                "the model cannot score: its start-up probe ({} tokens) failed: {e}",
                ids.len()
            )),
            None => Err("the model cannot score: its start-up probe got no answer".into()),
        }
    }

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
        let mut timing = Timing::on(self.decoder.device());
        let seqs: Vec<SeqRef<'_>> = jobs.iter().map(Job::seq).collect();
        let results = self.compute(&seqs, &mut timing);
        timing.finish();
        let m = &self.metrics;
        m.batch_forwards.fetch_add(1, Relaxed);
        m.batch_sequences.observe(jobs.len() as f64);
        let fed = |n: usize| n.min(self.max_batch_tokens);
        let tokens = if let (true, Some(rows)) = (self.batch_invariant, self.packed_rows) {
            // Each packed sequence takes whole buckets of rows (`forward_packed`).
            let bucket = xdistill_shared::model::attention_bucket();
            let packed: usize = seqs
                .iter()
                .filter(|s| self.packable(s))
                .map(|s| xdistill_shared::model::bucketed(s.ids.len() - 1, bucket))
                .sum();
            let alone: usize = seqs
                .iter()
                .filter(|s| !self.packable(s))
                .map(|s| fed(s.input_tokens()))
                .sum();
            packed.div_ceil(rows) * rows + alone
        } else if self.batch_invariant {
            seqs.iter().map(|s| fed(s.input_tokens())).sum()
        } else {
            let longest = seqs.iter().map(SeqRef::input_tokens).max().unwrap_or(0);
            jobs.len() * fed(longest)
        };
        m.batch_padded_tokens.observe(tokens as f64);
        m.batch_forward_duration
            .observe(timing.forward.as_secs_f64());
        m.batch_head_duration.observe(timing.head.as_secs_f64());
        m.batch_topk_duration.observe(timing.topk.as_secs_f64());
        m.batch_copy_duration.observe(timing.copy.as_secs_f64());
        drop(seqs);
        for (job, r) in jobs.into_iter().zip(results) {
            // The job's queue budget goes back before its answer, so that a caller who has read
            // the answer finds the budget returned (it came back just after, a race under load).
            let Job {
                reply, admission, ..
            } = job;
            drop(admission);
            // A caller that left meanwhile is not an error.
            let _ = reply.send(r);
        }
        m.batch_duration.observe(t0.elapsed().as_secs_f64());
    }

    /// Scores of every sequence, in order; each fails or succeeds on its own.
    fn compute(&self, seqs: &[SeqRef<'_>], timing: &mut Timing) -> Vec<JobResult> {
        if let (true, Some(rows)) = (self.batch_invariant, self.packed_rows) {
            return self.compute_packed(seqs, rows, timing);
        }
        if self.batch_invariant || seqs.len() == 1 {
            return seqs
                .iter()
                .map(|&seq| guarded(|| self.compute_alone(seq, timing)))
                .collect();
        }
        // One padded forward for all; a failure there fails every sequence.
        match guarded(|| self.forward_padded(seqs, timing)) {
            Err(e) => seqs.iter().map(|_| Err(e.clone())).collect(),
            Ok(hidden) => seqs
                .iter()
                .enumerate()
                .map(|(i, &seq)| {
                    guarded(|| {
                        let mut acc = seq.empty();
                        let span = HiddenSpan {
                            states: &hidden.get(i)?,
                            first: 0,
                        };
                        self.scorer
                            .score(&self.decoder, span, seq, &mut acc, timing)?;
                        Ok(acc)
                    })
                })
                .collect(),
        }
    }

    /// Whether `seq` runs in the packed forward: a rule on the sequence alone (its inputs fit
    /// one forward and are fewer than a packed block's rows, no next row asked for), so that it
    /// takes the same path in every batch. A sequence that fills a block by itself gains
    /// nothing from packing and runs faster alone (an H200, Qwen3-0.6B's shape, 2026-11-29:
    /// 4 × 2048 tokens 99.2k tokens/s alone against 80.5k packed, 1 × 8192 100.4k against
    /// 70.3k; 8 × 512 71.1k packed against 59.4k alone).
    fn packable(&self, seq: &SeqRef<'_>) -> bool {
        let inputs = seq.ids.len().saturating_sub(1);
        seq.params.next.is_none()
            && inputs >= 1
            && inputs <= self.max_batch_tokens
            && self.packed_rows.is_none_or(|rows| inputs < rows)
    }

    /// The batch-invariant mode with a packed forward: the packable sequences in one
    /// [`Decoder::forward_packed`] (its failure fails each of them), the others on their own.
    fn compute_packed(
        &self,
        seqs: &[SeqRef<'_>],
        rows: usize,
        timing: &mut Timing,
    ) -> Vec<JobResult> {
        // Each packable sequence's first row in the packed forward.
        let mut rows_at = Vec::with_capacity(seqs.len());
        let mut packed = Vec::new();
        let mut at = 0;
        for seq in seqs {
            if self.packable(seq) {
                let ids = &seq.ids[..seq.ids.len() - 1];
                rows_at.push(Some(at));
                at += ids.len();
                packed.push(PackedSeq {
                    ids,
                    total: seq.ids.len(),
                });
            } else {
                rows_at.push(None);
            }
        }
        let hidden = if packed.is_empty() {
            None
        } else {
            Some(guarded(|| {
                timing.in_phase(Phase::Forward, || {
                    Ok(self.decoder.forward_packed(&packed, rows)?)
                })
            }))
        };
        // Device scoring: the packed sequences' rows in blocks across sequences.
        let mut by_block: Vec<Option<Result<SequenceScores, ScoringError>>> =
            seqs.iter().map(|_| None).collect();
        if let Some(Ok(h)) = &hidden {
            let members: Vec<(usize, PackedRows<'_>)> = seqs
                .iter()
                .zip(&rows_at)
                .enumerate()
                .filter_map(|(i, (seq, at))| {
                    let at = (*at)?;
                    self.scorer
                        .packs(seq)
                        .then_some((i, PackedRows { seq: *seq, at }))
                })
                .collect();
            if !members.is_empty() {
                let packed: Vec<PackedRows<'_>> = members.iter().map(|(_, p)| *p).collect();
                let results =
                    guarded(|| Ok(self.scorer.score_packed(&self.decoder, h, &packed, timing)));
                match results {
                    Ok(each) => {
                        for ((i, _), r) in members.iter().zip(each) {
                            by_block[*i] = Some(r);
                        }
                    }
                    Err(e) => {
                        for (i, _) in &members {
                            by_block[*i] = Some(Err(e.clone()));
                        }
                    }
                }
            }
        }
        seqs.iter()
            .zip(rows_at)
            .zip(by_block)
            .map(|((&seq, at), done)| match (at, &hidden, done) {
                (_, _, Some(done)) => done,
                (Some(at), Some(Ok(h)), None) => guarded(|| {
                    let mut acc = seq.empty();
                    let span = HiddenSpan {
                        states: &h.narrow(0, at, seq.ids.len() - 1)?,
                        first: 0,
                    };
                    self.scorer
                        .score(&self.decoder, span, seq, &mut acc, timing)?;
                    Ok(acc)
                }),
                (Some(_), Some(Err(e)), None) => Err(e.clone()),
                _ => guarded(|| self.compute_alone(seq, timing)),
            })
            .collect()
    }

    /// Hidden states of a right-padded batch: [B, T, H] (the last token of each sequence is
    /// not needed, unless a next row is asked for).
    fn forward_padded(
        &self,
        seqs: &[SeqRef<'_>],
        timing: &mut Timing,
    ) -> Result<Tensor, ScoringError> {
        let dev = self.decoder.device();
        let (b, t) = (
            seqs.len(),
            seqs.iter().map(SeqRef::input_tokens).max().unwrap_or(0),
        );
        // 1. Right-pad the inputs: [B, T].
        let mut ids = vec![0u32; b * t];
        for (i, seq) in seqs.iter().enumerate() {
            let n = seq.input_tokens();
            ids[i * t..i * t + n].copy_from_slice(&seq.ids[..n]);
        }
        // 2. Hidden states of all positions: [B, T, H].
        let hidden = timing.in_phase(Phase::Forward, || {
            let ids = Tensor::from_vec(ids, (b, t), dev)?;
            self.decoder.forward_hidden(&ids, None, None, None)
        })?;
        Ok(hidden)
    }

    /// One sequence on its own, computed as a request without a next token computes it: its
    /// `S - 1` inputs in one `[1, S - 1]` forward, or in chunks of `max_batch_tokens` over a KV
    /// cache when longer (a rule on its own length only). When a next token is asked for, one
    /// more step (the last token over the cache) gives the row after the sequence, so the rows
    /// before it keep the bits a plain request gets. (A fresh cache does not change the first
    /// forward's arithmetic: there is nothing to concatenate.)
    fn compute_alone(
        &self,
        seq: SeqRef<'_>,
        timing: &mut Timing,
    ) -> Result<SequenceScores, ScoringError> {
        let inputs = seq.ids.len() - 1;
        let chunk = if inputs > self.max_batch_tokens {
            self.max_batch_tokens
        } else {
            inputs.max(1)
        };
        // The cache knows the whole length, so length-dependent RoPE (LongRoPE) treats every
        // chunk as part of this sequence, as one forward over it would.
        let mut cache = KvCache::for_sequence(seq.ids.len());
        let mut acc = seq.empty();
        for c0 in (0..inputs).step_by(chunk) {
            let c1 = (c0 + chunk).min(inputs);
            self.forward_and_score(seq, c0..c1, &mut cache, &mut acc, timing)?;
        }
        if seq.params.next.is_some() {
            self.forward_and_score(seq, inputs..inputs + 1, &mut cache, &mut acc, timing)?;
        }
        Ok(acc)
    }

    /// Forwards positions `range` of `seq` over `cache` and appends their rows to `acc`.
    fn forward_and_score(
        &self,
        seq: SeqRef<'_>,
        range: std::ops::Range<usize>,
        cache: &mut KvCache,
        acc: &mut SequenceScores,
        timing: &mut Timing,
    ) -> Result<(), ScoringError> {
        let hidden = timing.in_phase(Phase::Forward, || {
            let ids = Tensor::new(&seq.ids[range.clone()], self.decoder.device())?.unsqueeze(0)?; // [1, c]
            self.decoder
                .forward_hidden(&ids, Some(cache), None, None)?
                .get(0) // [c, H]
        })?;
        let span = HiddenSpan {
            states: &hidden,
            first: range.start,
        };
        self.scorer.score(&self.decoder, span, seq, acc, timing)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Candidates;
    use crate::scoring::tests::{decoder, V, VALID};
    use crate::scoring::{LmHead, ScoreParams, TopkPath};
    use candle_core::Device;
    use xdistill_shared::protocol::ValuesKind;

    fn worker(batch_invariant: bool, max_batch_tokens: usize) -> Worker {
        Worker {
            decoder: decoder(),
            scorer: Scorer::new(VALID, V, TopkPath::Host, LmHead::Fused, &Device::Cpu),
            max_batch_tokens,
            batch_invariant,
            packed_rows: None,
            metrics: Arc::new(Metrics::default()),
        }
    }

    /// [`worker`] in the batch-invariant mode with a packed forward (blocks of `rows` rows).
    fn packed_worker(max_batch_tokens: usize, rows: usize) -> Worker {
        Worker {
            packed_rows: Some(rows),
            ..worker(true, max_batch_tokens)
        }
    }

    /// [`packed_worker`] scoring on the device path (here the CPU runs it), the LM head and
    /// top-k in blocks of `head_rows` rows across sequences.
    fn packed_device_worker(max_batch_tokens: usize, rows: usize, head_rows: usize) -> Worker {
        let mut scorer = Scorer::new(VALID, V, TopkPath::Device, LmHead::Fused, &Device::Cpu);
        scorer.chunk_rows = head_rows;
        Worker {
            scorer,
            ..packed_worker(max_batch_tokens, rows)
        }
    }

    fn bits(s: &SequenceScores) -> Vec<u32> {
        s.bits()
    }

    /// Batch-invariant mode: a short sequence and one over the batch budget (the KV-cache
    /// path) get the same bits alone and batched with neighbours of other lengths, in any
    /// order. The padded mode's differences are printed for comparison.
    #[test]
    fn batch_invariant_scores_do_not_depend_on_neighbours() {
        let seq_ids = |seed: usize, len: usize| -> Vec<u32> {
            (0..len)
                .map(|i| ((i * 7 + seed) * 997 % VALID) as u32)
                .collect()
        };
        let (x, y, z, long) = (seq_ids(1, 9), seq_ids(2, 20), seq_ids(3, 4), seq_ids(4, 50));
        let p = ScoreParams::native(5, 0.9, ValuesKind::Logprobs);
        let q = ScoreParams::native(3, 1.7, ValuesKind::Logits);
        let cands = Candidates {
            m: 2,
            ids: (0..16).map(|i| (i * 31 % VALID) as u32).collect(),
        };
        let seq = |ids: &'static [u32], params: &'static ScoreParams, start: usize| SeqRef {
            ids,
            start,
            params,
            candidates: None,
        };
        let leak = |v: Vec<u32>| -> &'static [u32] { Vec::leak(v) };
        let (x, y, z, long) = (leak(x), leak(y), leak(z), leak(long));
        let (p, q): (&'static ScoreParams, &'static ScoreParams) =
            (Box::leak(Box::new(p)), Box::leak(Box::new(q)));
        let cands: &'static Candidates = Box::leak(Box::new(cands));
        let xs = SeqRef {
            candidates: Some(cands),
            ..seq(x, p, 0)
        };
        let ls = seq(long, p, 3);
        let mixes: Vec<Vec<SeqRef<'static>>> = vec![
            vec![seq(y, q, 2), xs, seq(z, p, 0), ls],
            vec![ls, seq(z, q, 1), seq(y, p, 0), xs, xs],
        ];
        // Invariant (a forward per sequence, then packed in blocks of 8 rows, then that with
        // the device path's LM head in blocks of 6 rows across sequences), then padded.
        for (invariant, packed, device) in [
            (true, None, false),
            (true, Some(8), false),
            (true, Some(8), true),
            (false, None, false),
        ] {
            // 20 tokens per batch: the 49 input tokens of `long` run in chunks over a KV cache.
            let w = match packed {
                Some(rows) if device => packed_device_worker(20, rows, 6),
                Some(rows) => packed_worker(20, rows),
                None => worker(invariant, 20),
            };
            let mut t = Timing::default();
            let alone_x = w.compute(&[xs], &mut t).remove(0).unwrap();
            let alone_l = w.compute(&[ls], &mut t).remove(0).unwrap();
            assert_eq!((alone_x.rows, alone_l.rows), (8, 46));
            for mix in &mixes {
                let got = w.compute(mix, &mut t);
                let i = mix.iter().position(|s| s.ids.len() == 9).unwrap();
                let same_x = bits(got[i].as_ref().unwrap()) == bits(&alone_x);
                if invariant {
                    assert!(same_x, "the short sequence changed with its neighbours");
                    let j = mix.iter().position(|s| s.ids.len() == 50).unwrap();
                    assert_eq!(bits(got[j].as_ref().unwrap()), bits(&alone_l));
                } else {
                    println!("padded forward: short sequence identical when batched: {same_x}");
                }
            }
        }
    }

    /// The device path's blocks across sequences answer what each sequence's own chunks
    /// answer (to f32 rounding: another matmul shape), for top-k log-probs and logits, ranks
    /// and candidate ids, starts inside the sequence, blocks that straddle sequences and a
    /// padded last block; sequences asking different questions never share a block.
    #[test]
    fn packed_head_blocks_answer_as_each_sequences_own_chunks() {
        let leak = |v: Vec<u32>| -> &'static [u32] { Vec::leak(v) };
        let ids = |seed: usize, len: usize| {
            leak(
                (0..len)
                    .map(|i| ((i * 13 + seed) * 389 % VALID) as u32)
                    .collect(),
            )
        };
        let p: &'static ScoreParams =
            Box::leak(Box::new(ScoreParams::native(4, 0.8, ValuesKind::Logprobs)));
        let q: &'static ScoreParams = Box::leak(Box::new(ScoreParams {
            ranks: true,
            ..ScoreParams::native(2, 1.3, ValuesKind::Logits)
        }));
        // `p` at another temperature only.
        let r: &'static ScoreParams =
            Box::leak(Box::new(ScoreParams::native(4, 1.9, ValuesKind::Logprobs)));
        let cands: &'static Candidates = Box::leak(Box::new(Candidates {
            m: 3,
            ids: (0..3 * 11).map(|i| (i * 47 % VALID) as u32).collect(),
        }));
        let seqs = [
            SeqRef {
                ids: ids(1, 11),
                start: 2,
                params: p,
                candidates: None,
            },
            SeqRef {
                ids: ids(2, 7),
                start: 0,
                params: q,
                candidates: None,
            },
            SeqRef {
                ids: ids(3, 13),
                start: 1,
                params: p,
                candidates: Some(cands),
            },
            SeqRef {
                ids: ids(4, 5),
                start: 0,
                params: r,
                candidates: None,
            },
            SeqRef {
                ids: ids(5, 9),
                start: 3,
                params: q,
                candidates: None,
            },
        ];
        let blocks = packed_device_worker(64, 16, 5);
        let own = {
            let mut w = packed_device_worker(64, 16, 5);
            w.packed_rows = None; // a forward and chunks per sequence
            w
        };
        let mut t = Timing::default();
        let got = blocks.compute(&seqs, &mut t);
        let want = own.compute(&seqs, &mut t);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
            assert_eq!((g.rows, g.k, g.m), (w.rows, w.k, w.m), "sequence {i}");
            assert_eq!(g.rows, seqs[i].ids.len() - 1 - seqs[i].start);
            assert_eq!(g.topk_ids, w.topk_ids, "sequence {i}: ids");
            assert_eq!(g.target_ranks, w.target_ranks, "sequence {i}: ranks");
            for (a, b) in [
                (&g.topk_values, &w.topk_values),
                (&g.target_logprobs, &w.target_logprobs),
                (&g.logsumexp, &w.logsumexp),
                (&g.ids_logprobs, &w.ids_logprobs),
            ] {
                assert_eq!(a.len(), b.len(), "sequence {i}");
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                        "sequence {i}: {x} vs {y}"
                    );
                }
            }
        }
        assert_eq!(want[1].as_ref().unwrap().target_ranks.len(), 6);
        assert_eq!(want[2].as_ref().unwrap().ids_logprobs.len(), 11 * 3);
    }

    /// `/hidden_states`' rows: the final-norm states of positions `start..S - 1` (here through
    /// KV-cache chunks of 8, and packed in blocks of 16 rows, agreeing with one whole forward to
    /// rounding), with no scores, and the same bits alone and batched with a scoring neighbour
    /// (batch-invariant mode, either way).
    #[test]
    fn hidden_rows_are_the_head_input_and_batch_invariant() {
        let ids: &'static [u32] = Vec::leak((0..30u32).map(|i| i * 523 % VALID as u32).collect());
        let hp: &'static ScoreParams = Box::leak(Box::new(ScoreParams::hidden_states()));
        let sp: &'static ScoreParams =
            Box::leak(Box::new(ScoreParams::native(3, 1.0, ValuesKind::Logprobs)));
        let hs = SeqRef {
            ids,
            start: 4,
            params: hp,
            candidates: None,
        };
        for w in [worker(true, 8), packed_worker(32, 16)] {
            let mut t = Timing::default();
            let alone = w.compute(&[hs], &mut t).remove(0).unwrap();
            let h = w.decoder.config().hidden_size;
            assert_eq!(alone.rows, 25);
            assert_eq!(alone.hidden.len(), 25 * h * 4);
            assert!(alone.topk_ids.is_empty() && alone.logsumexp.is_empty());
            let mixed = w.compute(&[mk_seq(ids, sp), hs], &mut t);
            assert_eq!(mixed[1].as_ref().unwrap().hidden, alone.hidden);
            // Row r is position 4 + r of the whole sequence's forward.
            let full = w
                .decoder
                .forward_hidden(
                    &Tensor::new(&ids[..29], &Device::Cpu)
                        .unwrap()
                        .unsqueeze(0)
                        .unwrap(),
                    None,
                    None,
                    None,
                )
                .unwrap()
                .get(0)
                .unwrap()
                .narrow(0, 4, 25)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let got = xdistill_shared::protocol::WireDtype::F32
                .to_f32(&alone.hidden)
                .unwrap();
            for (a, b) in got.iter().zip(&full) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }

    /// A temperature that overflows the scaled logits, or non-finite logits, fail that sequence
    /// with the cause named; its neighbours in the batch are answered as usual.
    #[test]
    fn non_finite_scores_fail_with_their_cause() {
        let ids: Vec<u32> = vec![5, 900, 33, 4000, 12];
        let tiny = ScoreParams::native(4, 1e-45, ValuesKind::Logprobs);
        let fine = ScoreParams::native(4, 1.0, ValuesKind::Logprobs);
        for w in [
            worker(true, 64),
            worker(false, 64),
            packed_device_worker(64, 16, 4),
        ] {
            let mk = |params| SeqRef {
                ids: &ids,
                start: 0,
                params,
                candidates: None,
            };
            let got = w.compute(&[mk(&tiny), mk(&fine)], &mut Timing::default());
            let err = got[0].as_ref().unwrap_err().to_string();
            assert!(
                err.starts_with("temperature 1e-45 overflows the scaled logits"),
                "{err}"
            );
            assert_eq!(got[1].as_ref().unwrap().rows, 4);
        }
        // NaN hidden states (a broken model) are named as such, whatever the temperature.
        let dec = decoder();
        let mut h = vec![0.5f32; 3 * 16];
        h[20] = f32::NAN;
        let hidden = Tensor::from_vec(h, (3, 16), &Device::Cpu).unwrap();
        let scorer = Scorer::new(VALID, V, TopkPath::Host, LmHead::Fused, &Device::Cpu);
        let seq = mk_seq(&ids[..4], &fine);
        let mut acc = seq.empty();
        let span = HiddenSpan {
            states: &hidden,
            first: 0,
        };
        let err = scorer
            .score(&dec, span, seq, &mut acc, &mut Timing::default())
            .unwrap_err();
        let m = err.to_string();
        assert!(
            matches!(&err, ScoringError::NonFiniteLogits { .. })
                && m.contains("logits are not finite")
                && m.contains("position 1"),
            "{err}"
        );
    }

    fn mk_seq<'a>(ids: &'a [u32], params: &'a ScoreParams) -> SeqRef<'a> {
        SeqRef {
            ids,
            start: 0,
            params,
            candidates: None,
        }
    }
}
