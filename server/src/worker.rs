//! The model worker: one OS thread owns the [`Decoder`] and runs whole batches it receives over
//! a channel. Logits are computed a chunk of positions at a time so memory stays bounded for
//! large vocabularies.
//!
//! Two ways to run a batch (`--batch-invariant`):
//! - batch-invariant (the default): each sequence runs its own forward (`[1, S - 1]`, no
//!   padding), so its bytes depend only on the sequence, its request and the server's flags,
//!   never on what it was batched with. The batcher still coalesces (admission and queueing are
//!   the same); only the forward is per sequence.
//! - padded: one right-padded `[B, T]` forward for the whole batch (the causal mask keeps real
//!   tokens exact up to float rounding, ~1e-6, which then depends on the batch's shape).
//!
//! In both, a sequence longer than `--max-batch-tokens` runs in chunks of that many tokens over
//! a KV cache; which path a sequence takes depends only on its own length. A result with a
//! non-finite value is never returned: the sequence fails with the cause named.
//!
//! Scoring takes one of two paths ([`TopkPath`]): on the host or on the model's device
//! ([`xdistill_shared::topk::topk_rows`]: only the `[N, k]` results are copied back; the default
//! on a GPU). On the host the LM head is fused with scoring by default ([`LmHead::Fused`]): the
//! logits of a chunk of positions come a vocabulary tile at a time and each tile is folded into
//! the rows' running scores ([`topk::RowFolds`]) while in cache; `full` materialises `[c, V]`
//! and scores it with [`topk::score_rows`].

use crate::batcher::{Batch, Job};
use crate::metrics::Metrics;
use crate::model::{self, ModelFacts};
use crate::topk::{self, CandidateRows, LmHead, RowFolds, RowLayout, ScoreParams, TopkPath};
use crate::validation::Candidates;
use candle_core::Device;
use candle_core::{DType, Storage, Tensor};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use xdistill_shared::model::{linear_kernel, Decoder, KvCache};
use xdistill_shared::protocol::SequenceScores;

/// Most logits (f32) materialised at once: 16 Mi elements = 64 MiB, ≈110 positions of Qwen3.
const LOGIT_CHUNK_ELEMS: usize = 16 << 20;
/// Positions per chunk of the fused LM head: one `[256, TILE]` f32 tile is 2 MiB (it stays in
/// the cores' L2/L3), and the head's weights are read once per 256 positions.
const FUSED_CHUNK_ROWS: usize = 256;

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
    /// A GGUF file's weights: dequantized, or the projections kept quantized.
    pub gguf_weights: xdistill_shared::gguf::WeightMode,
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
    batch_invariant: bool,
    metrics: Arc<Metrics>,
}

/// Why one sequence got no scores.
#[derive(Debug)]
pub enum JobError {
    /// The model (or a tensor op around it) failed.
    Forward(candle_core::Error),
    /// A score came out NaN or infinite; the message names the cause.
    NonFinite(String),
}

impl From<candle_core::Error> for JobError {
    fn from(e: candle_core::Error) -> Self {
        JobError::Forward(e)
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Forward(e) => write!(f, "forward failed: {e}"),
            JobError::NonFinite(m) => f.write_str(m),
        }
    }
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
    /// On the host: the LM head a vocabulary tile at a time, folded into the scores.
    pub lm_head: LmHead,
    /// With `lm_head` fused: the AVX-512 kernel computes and folds the tiles (where the CPU
    /// has it and the head is f32); otherwise candle's matmul makes them.
    pub head_kernel: bool,
}

impl Scorer {
    /// Chunks of [`LOGIT_CHUNK_ELEMS`] logits (of [`FUSED_CHUNK_ROWS`] positions when fused);
    /// device scoring where `path` resolves to it.
    pub fn new(
        vocab: usize,
        logits_size: usize,
        path: TopkPath,
        lm_head: LmHead,
        device: &Device,
    ) -> Scorer {
        let on_device = path.on_device(device);
        let chunk_rows = match (on_device, lm_head) {
            (false, LmHead::Fused) => FUSED_CHUNK_ROWS,
            _ => (LOGIT_CHUNK_ELEMS / logits_size.max(1)).max(1),
        };
        Scorer {
            vocab,
            logits_size,
            chunk_rows,
            on_device,
            lm_head,
            head_kernel: RowFolds::head_kernel_available(),
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
            // Otherwise candle's matmul makes the fused head's tiles.
            let kernel = scorer.head_kernel
                && kernel_reads(decoder.lm_head())
                && !scorer.on_device
                && scorer.lm_head == LmHead::Fused;
            tracing::info!(
                on_device = scorer.on_device,
                lm_head = ?scorer.lm_head,
                lm_head_kernel = if kernel { "avx512" } else { "candle" },
                linear_kernel = if linear_kernel(decoder.device(), decoder.lm_head().dtype()) {
                    "avx512"
                } else {
                    "candle"
                },
                chunk_rows = scorer.chunk_rows,
                batch_invariant = cfg.batch_invariant,
                "scoring path"
            );
            let worker = Worker {
                decoder,
                scorer,
                max_batch_tokens: cfg.max_batch_tokens.max(1),
                batch_invariant: cfg.batch_invariant,
                metrics,
            };
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

/// Whether the AVX-512 LM-head kernel can read `head` in place: f32, contiguous, host memory.
fn kernel_reads(head: &Tensor) -> bool {
    head.dtype() == DType::F32 && head.device().is_cpu() && head.is_contiguous()
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
    acc.ids_logprobs.extend(s.ids_logprobs);
    acc.target_ranks.extend(s.target_ranks);
}

/// What the scorer needs of one sequence (a [`Job`] without its reply channel).
#[derive(Clone, Copy)]
pub struct SeqRef<'a> {
    pub ids: &'a [u32],
    pub start: usize,
    pub params: &'a ScoreParams,
    pub candidates: Option<&'a Candidates>,
}

impl SeqRef<'_> {
    /// Tokens the model reads (as [`Job::input_tokens`]): `S - 1`, or `S` with a next row.
    fn input_tokens(&self) -> usize {
        self.end()
    }
    /// Positions scored are `start..end()`: up to `S - 1`, or `S` with a next row.
    fn end(&self) -> usize {
        self.ids.len() - 1 + self.params.next.is_some() as usize
    }
    /// Candidate ids of positions `p0..p1`.
    fn candidates(&self, p0: usize, p1: usize) -> CandidateRows<'_> {
        match self.candidates {
            Some(c) => CandidateRows {
                ids: &c.ids,
                m: c.m,
            }
            .rows(p0 - self.start, p1 - self.start),
            None => CandidateRows::default(),
        }
    }
    /// An empty result to append rows to.
    fn empty(&self) -> SequenceScores {
        SequenceScores {
            k: self.params.k,
            m: self.candidates.map_or(0, |c| c.m),
            ..Default::default()
        }
    }
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

/// Runs `f`, turning its error or panic into the message its caller gets.
fn guarded<T>(f: impl FnOnce() -> Result<T, JobError>) -> Result<T, String> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(x)) => Ok(x),
        Ok(Err(e @ JobError::NonFinite(_))) => {
            tracing::warn!("sequence refused: {e}");
            Err(e.to_string())
        }
        Ok(Err(e)) => {
            tracing::error!("sequence failed: {e}");
            Err(e.to_string())
        }
        Err(p) => {
            let msg = panic_message(p.as_ref());
            tracing::error!("worker panicked: {msg}");
            Err(format!("worker panicked: {msg}"))
        }
    }
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
        let seqs: Vec<SeqRef<'_>> = jobs.iter().map(Job::seq).collect();
        let results = self.compute(&seqs, &mut timing);
        let m = &self.metrics;
        m.batch_forwards.fetch_add(1, Relaxed);
        m.batch_sequences.observe(jobs.len() as f64);
        let fed = |n: usize| n.min(self.max_batch_tokens);
        let tokens = if self.batch_invariant {
            seqs.iter().map(|s| fed(s.input_tokens())).sum()
        } else {
            let longest = seqs.iter().map(SeqRef::input_tokens).max().unwrap_or(0);
            jobs.len() * fed(longest)
        };
        m.batch_padded_tokens.observe(tokens as f64);
        m.batch_forward_duration
            .observe(timing.forward.as_secs_f64());
        m.batch_topk_duration.observe(timing.topk.as_secs_f64());
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
    fn compute(
        &self,
        seqs: &[SeqRef<'_>],
        timing: &mut Timing,
    ) -> Vec<Result<SequenceScores, String>> {
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

    /// Hidden states of a right-padded batch: [B, T, H] (the last token of each sequence is
    /// not needed, unless a next row is asked for).
    fn forward_padded(&self, seqs: &[SeqRef<'_>], timing: &mut Timing) -> Result<Tensor, JobError> {
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
        let f0 = Instant::now();
        let ids = Tensor::from_vec(ids, (b, t), dev)?;
        // 2. Hidden states of all positions: [B, T, H].
        let hidden = self.decoder.forward_hidden(&ids, None, None, None)?;
        timing.forward += f0.elapsed();
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
    ) -> Result<SequenceScores, JobError> {
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
    ) -> Result<(), JobError> {
        let f0 = Instant::now();
        let ids = Tensor::new(&seq.ids[range.clone()], self.decoder.device())?.unsqueeze(0)?; // [1, c]
        let hidden = self
            .decoder
            .forward_hidden(&ids, Some(cache), None, None)?
            .get(0)?; // [c, H]
        timing.forward += f0.elapsed();
        let span = HiddenSpan {
            states: &hidden,
            first: range.start,
        };
        self.scorer.score(&self.decoder, span, seq, acc, timing)?;
        Ok(())
    }
}

/// What is asked of a run of rows: their targets `[c]`, candidate ids `[c, m]` and the
/// request's parameters.
#[derive(Clone, Copy)]
struct RowsAsked<'a> {
    targets: &'a [u32],
    cands: CandidateRows<'a>,
    params: &'a ScoreParams,
}

/// Hidden states `[n, H]` of positions `first..first + n` of one sequence.
#[derive(Clone, Copy)]
pub struct HiddenSpan<'a> {
    pub states: &'a Tensor,
    pub first: usize,
}

impl Scorer {
    /// Appends to `acc` the rows of `seq`'s requested positions (`start..end`) that fall in
    /// `span`, a chunk of [`Scorer::chunk_rows`] positions at a time (row p predicts `ids[p + 1]`).
    /// The next row (position `S - 1`, with a next token asked for) chooses its own target.
    fn score(
        &self,
        decoder: &Decoder,
        span: HiddenSpan<'_>,
        seq: SeqRef<'_>,
        acc: &mut SequenceScores,
        timing: &mut Timing,
    ) -> Result<(), JobError> {
        let (hidden, first) = (span.states, span.first);
        let n = hidden.dim(0)?;
        let lo = first.max(seq.start);
        let hi = (first + n).min(seq.end());
        // Rows with a known target: positions before S - 1.
        let known = hi.min(seq.ids.len() - 1);
        let params = seq.params;
        let mut c0 = lo;
        while c0 < known {
            let c1 = (c0 + self.chunk_rows).min(known);
            let rows = hidden.narrow(0, c0 - first, c1 - c0)?; // [c, H]
            let asked = RowsAsked {
                targets: &seq.ids[c0 + 1..c1 + 1],
                cands: seq.candidates(c0, c1),
                params,
            };
            let s = self.score_rows(decoder, &rows, asked, timing)?;
            self.check_finite(&s, decoder, &rows, c0, params.temperature)?;
            append(acc, s);
            c0 = c1;
        }
        if let Some(how) = params.next {
            let last = seq.ids.len() - 1;
            if (lo..hi).contains(&last) {
                let f0 = Instant::now();
                let logits = decoder.logits(&hidden.narrow(0, last - first, 1)?)?;
                let logits = logits.to_dtype(DType::F32)?.contiguous()?;
                timing.forward += f0.elapsed();
                let t0 = Instant::now();
                let cands = seq.candidates(last, last + 1);
                let (s, token) = with_host_f32(&logits, |row| {
                    let valid = self.vocab.min(self.logits_size);
                    let token = topk::choose_next(&row[..valid], params.temperature, how);
                    let s = topk::score_rows(row, self.layout(), &[token], cands, params);
                    (s, token)
                })?;
                timing.topk += t0.elapsed();
                let row = hidden.narrow(0, last - first, 1)?;
                self.check_finite(&s, decoder, &row, last, params.temperature)?;
                append(acc, s);
                acc.next_token = Some(token);
            }
        }
        Ok(())
    }

    /// The scoring path as `/v1/info` reports it: `device`, or on the host `fused` / `full`.
    pub fn path_name(&self) -> &'static str {
        match (self.on_device, self.lm_head) {
            (true, _) => "device",
            (false, LmHead::Fused) => "fused",
            (false, LmHead::Full) => "full",
        }
    }

    /// Scores of `rows` [c, H] on the path this scorer takes: the AVX-512 LM-head kernel when
    /// it applies, else the head a tile at a time through candle (no ranks), else the full
    /// logits.
    fn score_rows(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        q: RowsAsked<'_>,
        timing: &mut Timing,
    ) -> Result<SequenceScores, JobError> {
        if self.scores_on_device(q.params) || self.lm_head != LmHead::Fused {
            return self.score_full(decoder, rows, q, timing);
        }
        if self.head_kernel {
            if let Some(s) = self.score_head_kernel(decoder, rows, q, timing)? {
                return Ok(s);
            }
        }
        match RowFolds::tiled(self.layout(), q.targets, q.cands, q.params) {
            Some(folds) => self.score_fused(decoder, rows, folds, timing),
            None => self.score_full(decoder, rows, q, timing),
        }
    }

    fn scores_on_device(&self, params: &ScoreParams) -> bool {
        self.on_device && device_topk_fits(params.k)
    }

    /// Scores of `rows` [c, H] by the AVX-512 LM-head kernel ([`RowFolds::fold_head`]), which
    /// reads the f32 head in place; `None` when the head or the rows are not f32 host memory.
    /// Its wall time is split between `forward` and `topk` by [`topk::HeadTiming::split`]; the rows'
    /// final top-k and log-probs count as `topk`.
    fn score_head_kernel(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        q: RowsAsked<'_>,
        timing: &mut Timing,
    ) -> Result<Option<SequenceScores>, JobError> {
        let head = decoder.lm_head();
        if !kernel_reads(head) || rows.dtype() != DType::F32 {
            return Ok(None);
        }
        let h = head.dim(1)?;
        let t0 = Instant::now();
        let mut folds = RowFolds::for_head(self.layout(), q.targets, q.cands, q.params);
        let split = with_host_f32(head, |w| {
            with_host_f32(rows, |x| folds.fold_head(x, &w[..self.logits_size * h], h))
        })??;
        let (forward, scoring) = split.split(t0.elapsed());
        timing.forward += forward;
        let f0 = Instant::now();
        let scores = folds.finish();
        timing.topk += scoring + f0.elapsed();
        Ok(Some(scores))
    }

    /// Scores of `rows` [c, H] by the fused LM head: the logits of one vocabulary tile at a time
    /// ([c, TILE]), folded into `folds` before the next is computed. Tiles past the valid
    /// vocabulary (LM-head padding) are never computed.
    fn score_fused(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        mut folds: RowFolds<'_>,
        timing: &mut Timing,
    ) -> Result<SequenceScores, JobError> {
        let valid = self.vocab.min(self.logits_size);
        for c0 in (0..valid).step_by(RowFolds::TILE) {
            let cols = c0..(c0 + RowFolds::TILE).min(self.logits_size);
            let f0 = Instant::now();
            let tile = decoder
                .logits_cols(rows, cols.clone())?
                .to_dtype(DType::F32)?
                .contiguous()?;
            timing.forward += f0.elapsed();
            let t0 = Instant::now();
            with_host_f32(&tile, |t| folds.fold(t, cols))?;
            timing.topk += t0.elapsed();
        }
        let t0 = Instant::now();
        let scores = folds.finish();
        timing.topk += t0.elapsed();
        Ok(scores)
    }

    /// Scores of `rows` [c, H] from their whole `[c, V]` logits, on the device or the host.
    fn score_full(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        q: RowsAsked<'_>,
        timing: &mut Timing,
    ) -> Result<SequenceScores, JobError> {
        let RowsAsked {
            targets,
            cands,
            params,
        } = q;
        let f0 = Instant::now();
        // [c, H] -> [c, V] in the model dtype.
        let logits = decoder.logits(rows)?;
        timing.forward += f0.elapsed();
        let t0 = Instant::now();
        let s = if self.scores_on_device(params) {
            self.score_on_device(&logits, targets, cands, params)?
        } else {
            let host = logits.to_dtype(DType::F32)?.contiguous()?;
            with_host_f32(&host, |rows| {
                topk::score_rows(rows, self.layout(), targets, cands, params)
            })?
        };
        timing.topk += t0.elapsed();
        Ok(s)
    }

    /// Refuses scores with a non-finite value, naming the cause ([`topk::first_non_finite`]).
    /// `rows`: the `[c, H]` hidden states of positions `p0..p0 + c` they came from; the failing
    /// row's logits are recomputed from them only when something is wrong.
    fn check_finite(
        &self,
        s: &SequenceScores,
        decoder: &Decoder,
        rows: &Tensor,
        p0: usize,
        temperature: f32,
    ) -> Result<(), JobError> {
        let Some((r, field)) = topk::first_non_finite(s) else {
            return Ok(());
        };
        let valid = self.vocab.min(self.logits_size);
        let row: Vec<f32> = decoder
            .logits(&rows.narrow(0, r, 1)?)?
            .get(0)?
            .narrow(0, 0, valid)?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        Err(JobError::NonFinite(topk::non_finite_cause(
            &row,
            temperature,
            p0 + r,
            field,
        )))
    }

    fn layout(&self) -> RowLayout {
        RowLayout {
            width: self.logits_size,
            valid: self.vocab,
        }
    }

    /// Top-k, target log-prob and logsumexp of `logits` [c, V] where they are; only the `[c, k]`
    /// and `[c]` results come back to the host.
    fn score_on_device(
        &self,
        logits: &Tensor,
        targets: &[u32],
        cands: CandidateRows<'_>,
        p: &ScoreParams,
    ) -> candle_core::Result<SequenceScores> {
        let dev = logits.device();
        let tg = Tensor::new(targets, dev)?;
        let ct = match cands.m {
            0 => None,
            m => Some(Tensor::from_slice(cands.ids, (targets.len(), m), dev)?),
        };
        let q = xdistill_shared::topk::RowQuery {
            k: p.k,
            temperature: p.temperature,
            valid: self.vocab.min(self.logits_size),
            values: p.values,
            ranks: p.ranks,
        };
        let r = xdistill_shared::topk::topk_rows(logits, &tg, ct.as_ref(), &q)?;
        let mut s = SequenceScores {
            rows: targets.len(),
            k: p.k,
            topk_ids: r.ids.flatten_all()?.to_vec1()?,
            topk_values: r.values.flatten_all()?.to_vec1()?,
            target_logprobs: r.target_logprobs.to_vec1()?,
            logsumexp: r.logsumexp.to_vec1()?,
            m: cands.m,
            ids_logprobs: match r.ids_logprobs {
                Some(t) => t.flatten_all()?.to_vec1()?,
                None => Vec::new(),
            },
            target_ranks: match r.target_ranks {
                Some(t) => t.to_vec1()?,
                None => Vec::new(),
            },
            next_token: None,
        };
        // A target inside the top k is ranked by its position there (as on the host path); the
        // device count ranks ties last, which differs only for tied values.
        for (row, &t) in targets.iter().enumerate().take(s.target_ranks.len()) {
            if let Some(j) = s.topk_ids[row * p.k..(row + 1) * p.k]
                .iter()
                .position(|&id| id == t)
            {
                s.target_ranks[row] = j as u32 + 1;
            }
        }
        Ok(s)
    }
}

/// The device sort keeps 2k candidates per chunk of [`xdistill_shared::topk::SORT_CHUNK`] columns;
/// larger k (only with a raised `--max-k`) goes to the host path.
fn device_topk_fits(k: usize) -> bool {
    2 * k <= xdistill_shared::topk::SORT_CHUNK
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topk::NextToken;
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
        let params = xdistill_shared::init::random_params(&cfg, 0.5, 3).unwrap();
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
        // Candidate ids: 3 per requested row, spread over the valid vocabulary.
        let rows = first + n - start;
        let cands = Candidates {
            m: 3,
            ids: (0..rows * 3).map(|i| (i * 2011 % VALID) as u32).collect(),
        };
        // The host paths' answers without ranks, per chunking, for the bit-level claims below.
        let mut host: Vec<((LmHead, bool), usize, SequenceScores)> = Vec::new();
        let kernel = RowFolds::head_kernel_available();
        let mut paths = vec![
            (false, LmHead::Full, false),
            (false, LmHead::Fused, false),
            (true, LmHead::Full, false),
        ];
        if kernel {
            paths.push((false, LmHead::Fused, true));
        }
        for ((on_device, lm_head, head_kernel), ranks) in
            paths.into_iter().flat_map(|x| [(x, true), (x, false)])
        {
            let p = ScoreParams {
                ranks,
                ..ScoreParams::native(6, 0.8, ValuesKind::Logprobs)
            };
            let p = &p;
            for chunk_rows in [1, 3, 64] {
                let scorer = Scorer {
                    vocab: VALID,
                    logits_size: V,
                    chunk_rows,
                    on_device,
                    lm_head,
                    head_kernel,
                };
                let seq = SeqRef {
                    ids: &ids,
                    start,
                    params: p,
                    candidates: Some(&cands),
                };
                let mut acc = seq.empty();
                let mut timing = Timing::default();
                let span = HiddenSpan {
                    states: &hidden,
                    first,
                };
                scorer
                    .score(&dec, span, seq, &mut acc, &mut timing)
                    .unwrap();
                acc.check_shapes().unwrap();
                // Requested rows: positions start..first+n (row p predicts ids[p + 1]).
                assert_eq!(acc.rows, rows);
                for (r, pos) in (start..first + n).enumerate() {
                    let row = &full[pos - first];
                    let (top, tl, lse) = reference(row, ids[pos + 1] as usize, p.k, 0.8);
                    let what = format!(
                        "device {on_device} {lm_head:?} kernel {head_kernel} ranks {ranks} chunk {chunk_rows} row {r}"
                    );
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
                    for j in 0..3 {
                        let c = cands.ids[r * 3 + j] as usize;
                        let want = row[c] as f64 / 0.8 - lse;
                        let got = acc.ids_logprobs_row(r)[j] as f64;
                        assert!((got - want).abs() < 1e-4, "{what} cand {j}");
                    }
                    // Rank: 1 + the number of valid ids with a larger logit (no ties here).
                    if ranks {
                        let zt = row[ids[pos + 1] as usize];
                        let want_rank = 1 + row[..VALID].iter().filter(|&&x| x > zt).count();
                        assert_eq!(acc.target_ranks[r] as usize, want_rank, "{what}");
                    } else {
                        assert!(acc.target_ranks.is_empty());
                    }
                }
                if !on_device && !ranks {
                    host.push(((lm_head, head_kernel), chunk_rows, acc));
                }
            }
        }
        // Which equalities hold where (every answer above is within 1e-4 of the f64 truth):
        // 1. On every CPU, the fused head through candle's tiles gives the full logits' bits at
        //    the same chunking: each tile is the same matmul as the full one's columns.
        // 2. Across chunkings, candle's paths agree to f32 rounding only: its matmul (the gemm
        //    crate) picks its kernel from the matrix shape and the CPU (AVX2 or AVX-512), so a
        //    row's bits may change with the number of rows in its chunk (they do on AVX2 CPUs).
        // 3. The AVX-512 head kernel sums each dot product in a fixed order whatever the chunk
        //    (server/src/topk/head.rs): its bits do not depend on the chunking.
        let with = |path: (LmHead, bool)| -> Vec<(usize, &SequenceScores)> {
            host.iter()
                .filter(|(p, _, _)| *p == path)
                .map(|(_, c, a)| (*c, a))
                .collect()
        };
        let (full, tiled) = (with((LmHead::Full, false)), with((LmHead::Fused, false)));
        assert_eq!((full.len(), tiled.len()), (3, 3));
        for ((c, f), (ct, t)) in full.iter().zip(&tiled) {
            assert_eq!(c, ct);
            assert!(
                f.bits() == t.bits(),
                "chunk {c}: the fused LM head through candle's tiles differs from the full logits"
            );
        }
        let tolerance = 1e-5f32;
        for (c, a) in &full[1..] {
            let b = full[0].1;
            assert_eq!(a.topk_ids, b.topk_ids, "chunk {c}: top-k ids");
            for (name, x, y) in [
                ("top-k values", &a.topk_values, &b.topk_values),
                ("target log-probs", &a.target_logprobs, &b.target_logprobs),
                ("logsumexp", &a.logsumexp, &b.logsumexp),
                ("candidate log-probs", &a.ids_logprobs, &b.ids_logprobs),
            ] {
                let worst = x
                    .iter()
                    .zip(y)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst <= tolerance,
                    "chunk {c} vs 1: {name} differ by {worst}"
                );
            }
        }
        if kernel {
            let k = with((LmHead::Fused, true));
            assert_eq!(k.len(), 3);
            assert!(
                k.iter().all(|(_, a)| a.bits() == k[0].1.bits()),
                "the kernel's bits depend on the chunking"
            );
        }
    }

    /// With a next token asked for, the position after the last token is scored too (its target
    /// is the chosen token), on both paths and whatever the chunking; greedy takes the argmax.
    #[test]
    fn next_row_scores_the_chosen_token() {
        let dec = decoder();
        let ids: Vec<u32> = vec![5, 900, 33, 4000, 12];
        let x = Tensor::new(ids.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let hidden = dec
            .forward_hidden(&x, None, None, None)
            .unwrap()
            .get(0)
            .unwrap(); // [5, H]
        let full: Vec<Vec<f32>> = dec.logits(&hidden).unwrap().to_vec2().unwrap();
        let p = ScoreParams {
            next: Some(NextToken::Greedy),
            ..ScoreParams::native(2, 1.0, ValuesKind::Logprobs)
        };
        for (on_device, chunk_rows) in [(false, 2), (true, 64)] {
            let scorer = Scorer {
                vocab: VALID,
                logits_size: V,
                chunk_rows,
                on_device,
                lm_head: LmHead::Fused,
                head_kernel: RowFolds::head_kernel_available(),
            };
            let seq = SeqRef {
                ids: &ids,
                start: 3,
                params: &p,
                candidates: None,
            };
            let mut acc = seq.empty();
            let span = HiddenSpan {
                states: &hidden,
                first: 0,
            };
            scorer
                .score(&dec, span, seq, &mut acc, &mut Timing::default())
                .unwrap();
            // Rows at positions 3 (predicting ids[4]) and 4 (the next token).
            assert_eq!(acc.rows, 2);
            let (top, _, _) = reference(&full[4], 0, 1, 1.0);
            let token = acc.next_token.unwrap();
            assert_eq!(token, top[0].0);
            assert_eq!(acc.ids_row(1)[0], token);
            assert!((acc.target_logprobs[1] as f64 - top[0].1).abs() < 1e-4);
            let (_, tl, _) = reference(&full[3], ids[4] as usize, 1, 1.0);
            assert!((acc.target_logprobs[0] as f64 - tl).abs() < 1e-4);
        }
    }

    /// candle's CPU matmul (gemm 0.19) computes a row of `x · Wᵀ` with the same bits whatever
    /// the number of rows M ≥ 2, for LM-head-like shapes (N in the thousands): the reduction
    /// over K is blocked by K alone. M = 1 goes to a gemv kernel with another summation order
    /// (printed, not asserted), as do tiny products (M·N ≤ 256, a "horizontal" kernel). So the
    /// LM-head chunking changes no row but a one-row chunk's; the batch-invariant guarantee does
    /// not rest on this (a sequence's chunking depends only on itself and its request).
    #[test]
    fn matmul_rows_do_not_depend_on_the_row_count() {
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
                .collect()
        };
        for (k, n) in [(16usize, 9000usize), (128, 4000), (1024, 3000)] {
            let w = Tensor::from_vec(values(n * k, 1), (n, k), &Device::Cpu).unwrap();
            let x = Tensor::from_vec(values(130 * k, 2), (130, k), &Device::Cpu).unwrap();
            let wt = w.t().unwrap();
            let full: Vec<Vec<f32>> = x.matmul(&wt).unwrap().to_vec2().unwrap();
            for m in [1usize, 2, 3, 7, 16, 64, 65, 129] {
                let part: Vec<Vec<f32>> = x
                    .narrow(0, 130 - m, m)
                    .unwrap()
                    .matmul(&wt)
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                let differ = (0..m)
                    .filter(|&r| {
                        let want = &full[130 - m + r];
                        part[r]
                            .iter()
                            .zip(want)
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                    })
                    .count();
                if m == 1 {
                    println!("k {k} n {n}: one row alone differs: {}", differ == 1);
                } else {
                    assert_eq!(differ, 0, "k {k} n {n} m {m}");
                }
            }
        }
    }

    fn worker(batch_invariant: bool, max_batch_tokens: usize) -> Worker {
        Worker {
            decoder: decoder(),
            scorer: Scorer::new(VALID, V, TopkPath::Host, LmHead::Fused, &Device::Cpu),
            max_batch_tokens,
            batch_invariant,
            metrics: Arc::new(Metrics::default()),
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
        for invariant in [true, false] {
            // 20 tokens per batch: the 49 input tokens of `long` run in chunks over a KV cache.
            let w = worker(invariant, 20);
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

    /// A temperature that overflows the scaled logits, or non-finite logits, fail that sequence
    /// with the cause named; its neighbours in the batch are answered as usual.
    #[test]
    fn non_finite_scores_fail_with_their_cause() {
        let ids: Vec<u32> = vec![5, 900, 33, 4000, 12];
        let tiny = ScoreParams::native(4, 1e-45, ValuesKind::Logprobs);
        let fine = ScoreParams::native(4, 1.0, ValuesKind::Logprobs);
        for invariant in [true, false] {
            let w = worker(invariant, 64);
            let mk = |params| SeqRef {
                ids: &ids,
                start: 0,
                params,
                candidates: None,
            };
            let got = w.compute(&[mk(&tiny), mk(&fine)], &mut Timing::default());
            let err = got[0].as_ref().unwrap_err();
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
        assert!(
            matches!(&err, JobError::NonFinite(m) if m.contains("logits are not finite")
                && m.contains("position 1")),
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

    #[test]
    fn auto_path_is_host_on_the_cpu() {
        assert!(!TopkPath::Auto.on_device(&Device::Cpu));
        assert!(TopkPath::Device.on_device(&Device::Cpu));
        assert!(!TopkPath::Host.on_device(&Device::Cpu));
        assert!(device_topk_fits(0) && device_topk_fits(4096) && !device_topk_fits(4097));
    }
}
