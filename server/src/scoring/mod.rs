//! Scoring: hidden states of a sequence's positions in, the rows a client receives out (top-k,
//! target log-probs, logsumexp, candidate log-probs, ranks, the next token). The worker
//! (`worker.rs`) decides which positions run through the model together; everything after the
//! model's hidden states happens here.
//!
//! [`Scorer::score`] runs the LM head a chunk of positions at a time (so memory stays bounded
//! for large vocabularies) and takes one of these paths ([`TopkPath`], [`LmHead`]):
//! - on the model's device (`device`: [`xdistill_shared::topk::topk_rows`], only the `[N, k]`
//!   results are copied back; the default on a GPU);
//! - on the host, with the LM head fused with scoring (the default on the CPU): the logits of a
//!   chunk come a vocabulary tile at a time and each tile is folded into the rows' running
//!   scores ([`RowFolds`], from `xdistill_cpu_kernels::row_scores`) while in cache; on AVX-512 or AVX2 with
//!   an f32 head the head kernel ([`RowFolds::fold_head`]) makes and folds the tiles itself;
//! - on the host from the full `[c, V]` logits ([`score_rows`]; `--lm-head full`, and requests
//!   for ranks when the fused head goes through candle).
//!
//! After a packed forward, the device path scores the batch's rows in fixed blocks across
//! sequences ([`Scorer::score_packed`], `packed`).
//!
//! The row after the last token, when a next token is asked for, chooses its own target
//! (`next`). No result with a non-finite value is returned (`finite`): the sequence fails
//! with a [`ScoringError`] that names the cause and says whose fault it is.

mod device;
mod error;
mod finite;
mod next;
mod packed;
mod params;
#[cfg(test)]
pub(crate) mod tests;

pub use device::device_topk_fits;
pub use error::ScoringError;
pub use finite::{first_non_finite, non_finite_cause};
pub use next::choose_next;
pub use packed::PackedRows;
pub use params::{CandidateRows, LmHead, NextToken, ScoreParams, TopkPath};
pub use xdistill_cpu_kernels::row_scores::{rank_of, score_rows, HeadTiming, RowFolds};

use crate::request::Candidates;
use candle_core::{DType, Device, Storage, Tensor};
use std::time::{Duration, Instant};
use xdistill_shared::model::Decoder;
use xdistill_shared::protocol::SequenceScores;

/// Most logits (f32) materialised at once on the host: 16 Mi elements = 64 MiB, ≈110 positions
/// of Qwen3.
const LOGIT_CHUNK_ELEMS: usize = 16 << 20;
/// Most logits materialised at once on a GPU: 128 Mi elements (256 MiB in bf16), ≈880 positions
/// of Qwen3, so a sequence of up to that many rows takes one head matmul, one top-k launch and
/// one copy back (a chunk of 110 cost a synchronisation per 110 rows and a thin matmul).
/// Chunks are cut within a sequence, so a sequence's chunks, and its scores, do not depend on
/// its batch.
const GPU_LOGIT_CHUNK_ELEMS: usize = 128 << 20;
/// Positions per chunk of the fused LM head: one `[256, TILE]` f32 tile is 2 MiB (it stays in
/// the cores' L2/L3), and the head's weights are read once per 256 positions.
const FUSED_CHUNK_ROWS: usize = 256;

/// The phases of a batch the worker times ([`Timing`]), in the order a row meets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The decoder's layers: ids to final hidden states.
    Forward,
    /// The LM head's matmul: hidden states to logits.
    Head,
    /// Top-k, log-softmax statistics, target log-probs, ranks (on the device or the host).
    Topk,
    /// Results from the device to the host (none on the CPU).
    Copy,
}

impl Phase {
    /// The profiler's name for it.
    fn profiled(self) -> xdistill_shared::profiling::Phase {
        use xdistill_shared::profiling::Phase as P;
        match self {
            Phase::Forward => P::Forward,
            Phase::Head => P::Head,
            Phase::Topk => P::Topk,
            Phase::Copy => P::Copy,
        }
    }
}

/// Time per [`Phase`] of a batch. On a CUDA device each phase is timed by two events recorded
/// on the device's stream around the work it queues, read by [`Timing::finish`] once the batch
/// is done: the GPU's own time per phase (work queued asynchronously counts in the phase that
/// queued it, not in the first later one that waits for it), and the host never waits for the
/// GPU to end a phase. Elsewhere the host's clock (the CPU runs nothing asynchronously).
#[derive(Default)]
pub struct Timing {
    pub forward: Duration,
    pub head: Duration,
    pub topk: Duration,
    pub copy: Duration,
    /// On a CUDA device: its stream and the phases' (start, end) events so far.
    #[cfg(feature = "cuda")]
    gpu: Option<gpu_clock::Clock>,
    /// The device whose work the phases are: each is a profiler's region there too
    /// ([`xdistill_shared::profiling`]).
    device: Option<Device>,
}

impl std::fmt::Debug for Timing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timing")
            .field("forward", &self.forward)
            .field("head", &self.head)
            .field("topk", &self.topk)
            .field("copy", &self.copy)
            .finish()
    }
}

impl Timing {
    /// Timing for work on `device`: by events on a CUDA device, else by the host's clock.
    pub fn on(device: &Device) -> Timing {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            return Timing {
                gpu: Some(gpu_clock::Clock::new(d)),
                device: Some(device.clone()),
                ..Timing::default()
            };
        }
        Timing {
            device: Some(device.clone()),
            ..Timing::default()
        }
    }

    /// Runs `f` as part of `phase`, adding its time (on a GPU, its kernels' time once
    /// [`Timing::finish`] has read the events).
    pub fn in_phase<R>(&mut self, phase: Phase, f: impl FnOnce() -> R) -> R {
        let _region = self
            .device
            .as_ref()
            .map(|d| xdistill_shared::profiling::region(d, phase.profiled()));
        #[cfg(feature = "cuda")]
        if let Some(clock) = &mut self.gpu {
            let start = clock.mark();
            let r = f();
            clock.push(phase, start);
            return r;
        }
        let t0 = Instant::now();
        let r = f();
        *self.slot(phase) += t0.elapsed();
        r
    }

    /// Adds the GPU's times of the phases recorded so far (waiting for the last one; after a
    /// batch's copies back, nothing is left to wait for). A no-op off the GPU.
    pub fn finish(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(clock) = &mut self.gpu {
            for (phase, d) in clock.take() {
                *self.slot(phase) += d;
            }
        }
    }

    /// Adds `d`, measured elsewhere (the head kernel (AVX-512 or AVX2) splits its own time), to `phase`.
    pub fn add(&mut self, phase: Phase, d: Duration) {
        *self.slot(phase) += d;
    }

    fn slot(&mut self, phase: Phase) -> &mut Duration {
        match phase {
            Phase::Forward => &mut self.forward,
            Phase::Head => &mut self.head,
            Phase::Topk => &mut self.topk,
            Phase::Copy => &mut self.copy,
        }
    }
}

/// A phase timer of CUDA events (see [`Timing`]).
#[cfg(feature = "cuda")]
mod gpu_clock {
    use super::Phase;
    use candle_core::cuda_backend::cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};
    use std::sync::Arc;
    use std::time::Duration;

    pub struct Clock {
        stream: Arc<CudaStream>,
        marks: Vec<(Phase, CudaEvent, CudaEvent)>,
    }

    impl Clock {
        pub fn new(dev: &candle_core::CudaDevice) -> Clock {
            Clock {
                stream: dev.cuda_stream(),
                marks: Vec::new(),
            }
        }

        /// An event recorded now on the stream (`None` if the driver refused: that phase goes
        /// untimed; the error, if real, surfaces in the next device call).
        pub fn mark(&self) -> Option<CudaEvent> {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()
        }

        /// Ends `phase`, started at `start`.
        pub fn push(&mut self, phase: Phase, start: Option<CudaEvent>) {
            if let (Some(start), Some(end)) = (start, self.mark()) {
                self.marks.push((phase, start, end));
            }
        }

        /// Each recorded phase's GPU time (waits for its end event), and forgets them.
        pub fn take(&mut self) -> Vec<(Phase, Duration)> {
            self.marks
                .drain(..)
                .filter_map(|(phase, start, end)| {
                    let ms = start.elapsed_ms(&end).ok()?;
                    Some((phase, Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3)))
                })
                .collect()
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
    /// With `lm_head` fused: the head kernel (AVX-512 or AVX2) computes and folds the tiles (where the CPU
    /// has it and the head is f32); otherwise candle's matmul makes them.
    pub head_kernel: bool,
}

/// What the scorer needs of one sequence (a [`crate::batcher::Job`] without its reply channel).
#[derive(Clone, Copy)]
pub struct SeqRef<'a> {
    pub ids: &'a [u32],
    pub start: usize,
    pub params: &'a ScoreParams,
    pub candidates: Option<&'a Candidates>,
}

impl SeqRef<'_> {
    /// Tokens the model reads (as [`crate::batcher::Job::input_tokens`]): `S - 1`, or `S` with
    /// a next row.
    pub fn input_tokens(&self) -> usize {
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
    pub fn empty(&self) -> SequenceScores {
        SequenceScores {
            k: self.params.k,
            m: self.candidates.map_or(0, |c| c.m),
            ..Default::default()
        }
    }
}

/// Hidden states `[n, H]` of positions `first..first + n` of one sequence.
#[derive(Clone, Copy)]
pub struct HiddenSpan<'a> {
    pub states: &'a Tensor,
    pub first: usize,
}

/// What is asked of a run of rows: their targets `[c]`, candidate ids `[c, m]` and the
/// request's parameters.
#[derive(Clone, Copy)]
struct RowsAsked<'a> {
    targets: &'a [u32],
    cands: CandidateRows<'a>,
    params: &'a ScoreParams,
}

impl Scorer {
    /// Device scoring where `path` resolves to it; chunks as `chunk_rows` sizes them.
    pub fn new(
        vocab: usize,
        logits_size: usize,
        path: TopkPath,
        lm_head: LmHead,
        device: &Device,
    ) -> Scorer {
        let on_device = path.on_device(device);
        let chunk_rows = chunk_rows(
            on_device && device.is_cuda(),
            on_device,
            lm_head,
            logits_size,
        );
        Scorer {
            vocab,
            logits_size,
            chunk_rows,
            on_device,
            lm_head,
            head_kernel: RowFolds::head_kernel_available(),
        }
    }

    /// The scoring path as `/v1/info` reports it: `device`, or on the host `fused` / `full`.
    pub fn path_name(&self) -> &'static str {
        match (self.on_device, self.lm_head) {
            (true, _) => "device",
            (false, LmHead::Fused) => "fused",
            (false, LmHead::Full) => "full",
        }
    }

    /// Whether the head kernel (AVX-512 or AVX2) scores with `head` (the decoder's LM head): the CPU has
    /// it, the path is the fused host one, and it can read the head in place.
    pub fn uses_head_kernel(&self, head: &Tensor) -> bool {
        self.head_kernel && kernel_reads(head) && !self.on_device && self.lm_head == LmHead::Fused
    }

    /// Appends to `acc` the rows of `seq`'s requested positions (`start..end`) that fall in
    /// `span`, a chunk of [`Scorer::chunk_rows`] positions at a time (row p predicts `ids[p + 1]`).
    /// The next row (position `S - 1`, with a next token asked for) chooses its own target.
    pub fn score(
        &self,
        decoder: &Decoder,
        span: HiddenSpan<'_>,
        seq: SeqRef<'_>,
        acc: &mut SequenceScores,
        timing: &mut Timing,
    ) -> Result<(), ScoringError> {
        let (hidden, first) = (span.states, span.first);
        let n = hidden.dim(0)?;
        let lo = first.max(seq.start);
        let hi = (first + n).min(seq.end());
        // Rows with a known target: positions before S - 1.
        let known = hi.min(seq.ids.len() - 1);
        let params = seq.params;
        if params.hidden {
            return append_hidden(hidden, first, lo, known, acc);
        }
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
        let last = seq.ids.len() - 1;
        if params.next.is_some() && (lo..hi).contains(&last) {
            let row = hidden.narrow(0, last - first, 1)?; // [1, H]
            let (s, token) = self.score_next(
                decoder,
                &row,
                seq.candidates(last, last + 1),
                params,
                timing,
            )?;
            self.check_finite(&s, decoder, &row, last, params.temperature)?;
            append(acc, s);
            acc.next_token = Some(token);
        }
        Ok(())
    }

    /// Scores of `rows` [c, H] on the path this scorer takes: on the device, else the
    /// LM-head kernel when it applies, else the head a tile at a time through candle (no
    /// ranks), else the full logits.
    fn score_rows(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        q: RowsAsked<'_>,
        timing: &mut Timing,
    ) -> Result<SequenceScores, ScoringError> {
        if self.scores_on_device(q.params) || self.lm_head != LmHead::Fused {
            return self.score_full(decoder, rows, q, timing);
        }
        if self.head_kernel {
            if let Some(s) = self.score_head_kernel(decoder, rows, q, timing)? {
                return Ok(s);
            }
        }
        let query = q.params.rows(self.valid());
        match RowFolds::tiled(self.logits_size, q.targets, q.cands, &query) {
            Some(folds) => self.score_fused(decoder, rows, folds, timing),
            None => self.score_full(decoder, rows, q, timing),
        }
    }

    fn scores_on_device(&self, params: &ScoreParams) -> bool {
        self.on_device && device_topk_fits(params.k)
    }

    /// Scores of `rows` [c, H] by the LM-head kernel (AVX-512 or AVX2) ([`RowFolds::fold_head`]), which
    /// reads the f32 head in place; `None` when the head or the rows are not f32 host memory.
    /// Its wall time is split between [`Phase::Head`] and [`Phase::Topk`] by
    /// [`HeadTiming::split`]; the rows' final top-k and log-probs count as top-k.
    fn score_head_kernel(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        q: RowsAsked<'_>,
        timing: &mut Timing,
    ) -> Result<Option<SequenceScores>, ScoringError> {
        let head = decoder.lm_head();
        if !kernel_reads(head) || rows.dtype() != DType::F32 {
            return Ok(None);
        }
        let h = head.dim(1)?;
        let t0 = Instant::now();
        let query = q.params.rows(self.valid());
        let mut folds = RowFolds::for_head(self.logits_size, q.targets, q.cands, &query);
        let split = with_host_f32(head, |w| {
            with_host_f32(rows, |x| folds.fold_head(x, &w[..self.logits_size * h], h))
        })??;
        let (matmul, scoring) = split.split(t0.elapsed());
        timing.add(Phase::Head, matmul);
        timing.add(Phase::Topk, scoring);
        Ok(Some(timing.in_phase(Phase::Topk, || folds.finish().into())))
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
    ) -> Result<SequenceScores, ScoringError> {
        for c0 in (0..self.valid()).step_by(RowFolds::TILE) {
            let cols = c0..(c0 + RowFolds::TILE).min(self.logits_size);
            let tile = timing.in_phase(Phase::Head, || decoder.logits_cols(rows, cols.clone()))?;
            let tile = timing.in_phase(Phase::Copy, || host_f32(&tile))?;
            timing.in_phase(Phase::Topk, || {
                with_host_f32(&tile, |t| folds.fold(t, cols))
            })?;
        }
        Ok(timing.in_phase(Phase::Topk, || folds.finish().into()))
    }

    /// Scores of `rows` [c, H] from their whole `[c, V]` logits, on the device or the host.
    fn score_full(
        &self,
        decoder: &Decoder,
        rows: &Tensor,
        q: RowsAsked<'_>,
        timing: &mut Timing,
    ) -> Result<SequenceScores, ScoringError> {
        let RowsAsked {
            targets,
            cands,
            params,
        } = q;
        // [c, H] -> [c, V] in the model dtype.
        let logits = timing.in_phase(Phase::Head, || decoder.logits(rows))?;
        if self.scores_on_device(params) {
            let found = timing.in_phase(Phase::Topk, || {
                device::topk_on_device(&logits, targets, cands, params, self.valid())
            })?;
            return Ok(timing.in_phase(Phase::Copy, || found.into_host(targets, params.k))?);
        }
        let host = timing.in_phase(Phase::Copy, || host_f32(&logits))?;
        let s = timing.in_phase(Phase::Topk, || {
            with_host_f32(&host, |rows| {
                score_rows(
                    rows,
                    self.logits_size,
                    targets,
                    cands,
                    &params.rows(self.valid()),
                )
            })
        })?;
        Ok(s.into())
    }

    /// Columns of the logits that are real tokens.
    fn valid(&self) -> usize {
        self.vocab.min(self.logits_size)
    }
}

/// Positions per LM-head chunk: [`GPU_LOGIT_CHUNK_ELEMS`] logits when they are scored on a
/// GPU, [`FUSED_CHUNK_ROWS`] positions on the fused host path, else [`LOGIT_CHUNK_ELEMS`]
/// logits (at least one row).
fn chunk_rows(on_gpu: bool, on_device: bool, lm_head: LmHead, logits_size: usize) -> usize {
    let rows = |elems: usize| (elems / logits_size.max(1)).max(1);
    match (on_gpu, on_device, lm_head) {
        (true, _, _) => rows(GPU_LOGIT_CHUNK_ELEMS),
        (false, false, LmHead::Fused) => FUSED_CHUNK_ROWS,
        _ => rows(LOGIT_CHUNK_ELEMS),
    }
}

/// Whether the LM-head kernel can read `head` in place: f32, contiguous, host memory.
fn kernel_reads(head: &Tensor) -> bool {
    head.dtype() == DType::F32 && head.device().is_cpu() && head.is_contiguous()
}

/// `t` as contiguous f32 in host memory (a no-op for such a tensor; a cast, and a copy from
/// the device on a GPU): what [`with_host_f32`] then borrows in place.
fn host_f32(t: &Tensor) -> candle_core::Result<Tensor> {
    t.to_dtype(DType::F32)?
        .contiguous()?
        .to_device(&Device::Cpu)
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

/// `/hidden_states`: appends the hidden states of positions `lo..hi` (of `hidden`, whose first
/// row is position `first`) to `acc.hidden` as little-endian bytes in the model's dtype. A
/// non-finite state fails the sequence (the model's fault).
fn append_hidden(
    hidden: &Tensor,
    first: usize,
    lo: usize,
    hi: usize,
    acc: &mut SequenceScores,
) -> Result<(), ScoringError> {
    if lo >= hi {
        return Ok(());
    }
    let rows = hidden.narrow(0, lo - first, hi - lo)?; // [c, H]
    let h = rows.dim(1)?;
    let at = acc.hidden.len();
    crate::head_file::append_le_bytes(&rows, &mut acc.hidden)?;
    if let Some(dtype) = crate::head_file::wire_dtype(rows.dtype()) {
        let values = dtype
            .to_f32(&acc.hidden[at..])
            .map_err(ScoringError::Forward)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(ScoringError::NonFiniteHidden {
                element: i % h.max(1),
                position: lo + i / h.max(1),
                value: values[i],
            });
        }
    }
    acc.rows += hi - lo;
    Ok(())
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
