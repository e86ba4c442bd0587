//! The LM head and its loss in row chunks, so that `[N, V]` logits exist for one chunk at a time.
//!
//! A training pass ([`Decoder::train_forward`]) hands back the final hidden states detached. Here
//! the trained rows of those states are cut into chunks of at most [`CHUNK_BYTES`] of f32 logits;
//! each chunk becomes a leaf, goes through the head (`[n, H] -> [n, V]`) and the loss, and is
//! backpropagated at once. Three things are accumulated across chunks: the loss values, the
//! gradient of the hidden rows (scattered back into a `[B, T, H]` zero tensor) and the head's
//! parameter gradients. [`HeadOut::finish`] then pulls the hidden-state gradient through the
//! decoder and adds the head's: the micro-batch's gradients, equal to those of the whole loss
//! computed at once (chunk losses are normalised by the whole step's units, so they sum to it).
//!
//! The distillation (KD) and cross-entropy (CE) terms are kept apart when `[loss] ce` is
//! `dynamic`: its factor `|CE|/|KD|` is a function of the micro-batch's totals, known only after
//! the last chunk, so the two gradients are scaled and added at the end.
//!
//! Where the head sums its gradient in place and the chunk's terms have a fused form
//! ([`PieceTerms::fused`]: the same tokenizer's top-k divergence, the on-policy sampled-token
//! loss and the cross-entropy on a GPU), a chunk runs by hand instead of through autograd: the
//! logits, one kernel for the terms' values, one writing their gradient over the logits, then
//! the head's two GEMMs ([`crate::loss::fused_head`]). Under the dynamic mix the chunks run
//! twice, the totals first and then by hand with the factor they give (`dynamic_by_hand`).

use crate::config::ActivationCheckpointing;
use crate::loss::fused_head::{self, FusedTerms};
use crate::loss::{CeConfig, KdFigures, KdMetrics, LossConfig};
use crate::train::phases::{self, Phase};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use xdistill_kernels::GradSum;
use xdistill_shared::model::{AfterLayer, Decoder, TrainPass};

/// The most f32 logits bytes one chunk holds when the row count is not forced (256 MiB: 441
/// rows of Qwen3's 151,936-entry vocabulary).
pub const CHUNK_BYTES: usize = 256 << 20;

/// The most logits bytes, in the head's own dtype, one chunk holds where every loss of the
/// chunk runs fused ([`HeadOpts::fused_rows`]; 512 MiB: 1,766 rows of Qwen3 in bf16). The
/// logits and their gradient are then the chunk's only `[n, V]` tensors (no f32 copies, no
/// log-softmax), about 1 GiB together: within the head's share of the run's fixed memory.
pub const FUSED_CHUNK_BYTES: usize = 512 << 20;

/// How a training pass keeps activations and how many rows one head chunk takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeadOpts {
    /// `policy.activation_checkpointing`.
    pub activations: ActivationCheckpointing,
    /// Rows per head chunk; 0: as many as fit [`CHUNK_BYTES`].
    pub chunk_rows: usize,
}

impl HeadOpts {
    /// Rows per chunk for a head of `vocab` logits per row (at least 1).
    pub fn rows(&self, vocab: usize) -> usize {
        if self.chunk_rows > 0 {
            self.chunk_rows
        } else {
            (CHUNK_BYTES / (vocab.max(1) * 4)).max(1)
        }
    }

    /// Rows per chunk for the LM head `head` `[V, H]` when the chunk's losses are the fused
    /// ones (the same tokenizer's top-k divergences, its sampled-token loss and the
    /// cross-entropy): where they run
    /// ([`xdistill_kernels::TopkKd::runs_on`], a GPU with the project's kernels) the chunk
    /// holds [`FUSED_CHUNK_BYTES`] of logits in the head's dtype, four times the rows of
    /// [`HeadOpts::rows`] in bf16, so the per-chunk work on the head's `[V, H]` gradient runs
    /// a quarter as often; elsewhere, or with the rows forced, [`HeadOpts::rows`]. (Repeated
    /// teacher ids, which no teacher sends, would put such a chunk on the composed loss.)
    pub fn fused_rows(&self, head: &Tensor) -> Result<usize> {
        let vocab = head.dim(0)?;
        if self.chunk_rows > 0 || !xdistill_kernels::TopkKd::runs_on(head) {
            return Ok(self.rows(vocab));
        }
        Ok((FUSED_CHUNK_BYTES / (vocab.max(1) * head.dtype().size_in_bytes())).max(1))
    }

    /// The training forward of `ids` `[B, T]` with this policy's way of keeping activations.
    pub fn forward<'m>(&self, model: &'m Decoder, ids: &Tensor) -> Result<TrainPass<'m>> {
        let (b, t) = ids.dims2()?;
        let act = self.activations.resolve(model, b, t);
        phases::time(Phase::Forward, ids.device(), || {
            Ok(model.train_forward(ids, act)?)
        })
    }
}

/// How a micro-batch's KD and CE totals combine into the loss whose gradient is taken.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mix {
    /// `kd·KD + ce·CE`.
    Linear { kd: f64, ce: f64 },
    /// NeMo's dynamic scaling: `kd_weight·sg(|CE|/|KD|)·KD + CE`, the factor from the
    /// micro-batch's totals (as [`crate::loss::combine`] computes it from the whole loss).
    Dynamic { kd_weight: f64 },
}

impl Mix {
    /// The mix `[loss]` asks for.
    pub fn of(cfg: &LossConfig) -> Mix {
        match cfg.ce {
            CeConfig::None {} => Mix::Linear {
                kd: cfg.kd_weight,
                ce: 0.0,
            },
            CeConfig::Weight { weight } => Mix::Linear {
                kd: cfg.kd_weight,
                ce: weight,
            },
            CeConfig::Dynamic {} => Mix::Dynamic {
                kd_weight: cfg.kd_weight,
            },
        }
    }
}

/// One chunk of rows to run the head on: flat indices into the `[B·T, H]` hidden states, whose
/// logits the loss reads as `[shape.0, shape.1, V]`.
#[derive(Debug, Clone)]
pub struct Piece {
    pub rows: Vec<u32>,
    pub shape: (usize, usize),
}

/// The loss terms of one chunk (scalars, each normalised by the whole step's units).
#[derive(Default)]
pub struct ChunkLoss {
    /// The distillation term and its figures.
    pub kd: Option<(Tensor, KdFigures)>,
    /// The cross-entropy term and the chunk's count of trained tokens.
    pub ce: Option<(Tensor, f64)>,
}

/// A micro-batch's loss terms per head piece, as [`run`] asks for them.
pub trait PieceTerms {
    /// Piece `i`'s terms from its logits `[shape.0, shape.1, V]`, differentiable.
    fn composed(&mut self, i: usize, logits: &Tensor) -> Result<ChunkLoss>;

    /// Piece `i`'s terms in the fused form, where they have one (asked only where the head
    /// sums its gradient in a sink); `None`: [`PieceTerms::composed`].
    fn fused(&mut self, i: usize) -> Result<Option<FusedTerms>>;
}

/// The detached values of a micro-batch's loss, summed over its chunks.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeadSums {
    /// Summed KD values and counts; masses averaged over the units (weighted by count).
    pub kd: KdMetrics,
    /// Summed CE value (normalised by the step's tokens) and the trained tokens, when any chunk
    /// computed it.
    pub ce: Option<(f64, f64)>,
    /// The effective KD multiplier (`kd_weight`, times `|CE|/|KD|` under dynamic scaling).
    pub kd_scale: f64,
}

/// What [`run`] computed: the gradients still to be pulled through the decoder.
pub struct HeadOut {
    /// `[B, T, H]` gradient of the loss at the hidden states (zero at rows no chunk held).
    pub grad_hidden: Tensor,
    /// The head parameters' gradients (keyed by their `Var`s).
    pub head: GradStore,
    pub sums: HeadSums,
}

impl HeadOut {
    /// The micro-batch's gradients: the decoder's (through `pass`) plus the head's. A weight
    /// both sides reach (a tied head's) is summed in the head's wider dtype (f32: the decoder's
    /// gradient of a bf16 compute copy is bf16): added into the head's f32 sum in place where
    /// the in-place accumulation runs
    /// ([`xdistill_kernels::grad_accumulate`](fn@xdistill_kernels::grad_accumulate): one pass,
    /// the bits of widening and adding), else widened and added.
    pub fn finish(
        self,
        pass: TrainPass<'_>,
        after_layer: AfterLayer<'_>,
    ) -> Result<(GradStore, HeadSums)> {
        let dev = self.grad_hidden.device().clone();
        let mut g = phases::time(Phase::Backward, &dev, || {
            Ok(pass.backward_with(&self.grad_hidden, after_layer)?)
        })?;
        let ids: Vec<_> = self.head.get_ids().copied().collect();
        // The head's entries still to add (those summed in place are the decoder's now).
        let mut rest = GradStore::default();
        for id in ids {
            let Some(head) = self.head.get_id(id) else {
                continue;
            };
            let Some(mine) = g.get_id(id).filter(|m| m.dtype() != head.dtype()) else {
                rest.insert_id(id, head.clone());
                continue;
            };
            let in_place = head.dtype() == DType::F32
                && head.is_contiguous()
                && mine.is_contiguous()
                && xdistill_kernels::grad_accumulate::applies(&dev);
            if in_place {
                let sum = head.clone();
                xdistill_kernels::grad_accumulate(&[GradSum {
                    src: mine,
                    dst: &sum,
                    add: true,
                }])?;
                g.insert_id(id, sum);
            } else {
                let widened = mine.to_dtype(head.dtype())?;
                g.insert_id(id, widened);
                rest.insert_id(id, head.clone());
            }
        }
        g.extend(rest)?;
        Ok((g, self.sums))
    }
}

/// The gradient of one loss term accumulated over chunks.
struct Acc {
    /// Rows of the hidden states `[B·T]` and their width `H`.
    rows: usize,
    h: usize,
    /// The summation dtype (f32, f64 for f64 models).
    dtype: DType,
    /// Each absorbed chunk's rows (on the host and as `[n]` u32) and its hidden-state gradient
    /// `[n, H]`.
    parts: Vec<(Vec<u32>, Tensor, Tensor)>,
    head: GradStore,
}

impl Acc {
    fn new(rows: usize, h: usize, dtype: DType) -> Acc {
        Acc {
            rows,
            h,
            dtype,
            parts: Vec::new(),
            head: GradStore::default(),
        }
    }

    /// The hidden-state gradient `[B·T, H]`: each chunk's rows where they belong, zero at rows
    /// no chunk held, summed where chunks share a row. Chunks hold distinct rows (every caller
    /// cuts one list of rows), and then it is one gather from their concatenation; candle's
    /// `index_add` runs one thread per column through every row, a millisecond per chunk at
    /// 2k rows on an H200.
    fn hidden(self, dev: &candle_core::Device) -> Result<Tensor> {
        // source[r]: 1 + the position of row r's gradient in the chunks' concatenation, 0: none.
        let mut source = vec![0u32; self.rows];
        let mut distinct = true;
        for (at, &r) in (1u32..).zip(self.parts.iter().flat_map(|p| &p.0)) {
            let slot = source
                .get_mut(r as usize)
                .ok_or_else(|| anyhow::anyhow!("head chunk row {r} of {}", self.rows))?;
            distinct &= *slot == 0;
            *slot = at;
        }
        if !distinct {
            let mut acc = Tensor::zeros((self.rows, self.h), self.dtype, dev)?;
            for (_, idx, g) in &self.parts {
                acc = acc.index_add(idx, g, 0)?;
            }
            return Ok(acc);
        }
        let mut all = vec![Tensor::zeros((1, self.h), self.dtype, dev)?];
        all.extend(self.parts.into_iter().map(|p| p.2));
        let from = Tensor::from_vec(source, self.rows, dev)?;
        Ok(Tensor::cat(&all, 0)?.index_select(&from, 0)?)
    }

    /// Adds a chunk's hidden-state gradient `g` `[n, H]` at its rows (`rows`, and as `[n]` u32
    /// `idx`).
    fn add_rows(&mut self, rows: &[u32], idx: &Tensor, g: &Tensor) -> Result<()> {
        let g = g.to_dtype(self.dtype)?.reshape(((), self.h))?;
        self.parts.push((rows.to_vec(), idx.clone(), g));
        Ok(())
    }

    /// Backpropagates `loss` (a scalar of one chunk) and adds its gradients: the leaf's rows
    /// into the hidden-state gradient at `idx` `[n]`, the head's (`head_dims`, `[V, H]`) to the
    /// head's sum.
    ///
    /// The head weight is the only parameter a chunk's loss reaches. candle's `backward` also
    /// returns gradients for the loss's constant operands (teacher probabilities, masks: up to
    /// `[n, V]` each), with keys of their own; kept, they would pile up one chunk after another
    /// (measured: one `[n, V]` f32 per chunk, linear in the sequence), so only `[V, H]` entries
    /// are kept.
    fn absorb(&mut self, loss: &Tensor, chunk: &Chunk, head_dims: &[usize]) -> Result<()> {
        if !loss.track_op() {
            return Ok(()); // a constant (a chunk with nothing to train): no gradient
        }
        let mut g = loss.backward()?;
        if let Some(gl) = g.remove(chunk.leaf.as_tensor()) {
            self.add_rows(chunk.rows, chunk.idx, &gl)?;
        }
        // Summed over chunks in the accumulation dtype (the head's bf16 compute copy receives
        // a bf16 gradient per chunk).
        let mut head = GradStore::default();
        let ids: Vec<_> = g.get_ids().copied().collect();
        for id in ids {
            if let Some(t) = g.get_id(id).filter(|t| t.dims() == head_dims) {
                head.insert_id(id, t.to_dtype(self.dtype)?);
            }
        }
        self.head.extend(head)?;
        Ok(())
    }
}

/// One chunk of rows in the head: the leaf its logits came from, its rows as `[n]` u32 and on
/// the host.
struct Chunk<'a> {
    leaf: &'a Var,
    idx: &'a Tensor,
    rows: &'a [u32],
}

/// A GradStore with every entry multiplied by `c`.
fn scaled(g: GradStore, c: f64) -> Result<GradStore> {
    let mut out = GradStore::default();
    let ids: Vec<_> = g.get_ids().copied().collect();
    for id in ids {
        if let Some(t) = g.get_id(id) {
            out.insert_id(id, t.affine(c, 0.0)?);
        }
    }
    Ok(out)
}

/// Adds `m` to the running sums `s` (masses as count-weighted sums until [`finish_metrics`]).
fn add_metrics(s: &mut KdMetrics, m: &KdMetrics) {
    s.loss += m.loss;
    s.count += m.count;
    let add = |acc: &mut Option<f64>, v: Option<f64>| {
        if let Some(v) = v {
            *acc = Some(acc.unwrap_or(0.0) + v * m.count);
        }
    };
    add(&mut s.teacher_topk_mass, m.teacher_topk_mass);
    add(&mut s.student_topk_mass, m.student_topk_mass);
}

fn finish_metrics(mut s: KdMetrics) -> KdMetrics {
    let n = s.count.max(f64::MIN_POSITIVE);
    s.teacher_topk_mass = s.teacher_topk_mass.map(|v| v / n);
    s.student_topk_mass = s.student_topk_mass.map(|v| v / n);
    s
}

/// A micro-batch's figures summed over its chunks where they are: on the host those read
/// there, on the device the pending ones and the cross-entropy, read back in one copy at the
/// end ([`Figures::read`]) so that no chunk waits for the device.
#[derive(Default)]
struct Figures {
    /// Read figures, masses count-weighted ([`add_metrics`]).
    host: KdMetrics,
    /// Σ of [`KdFigures::Pending`] sums (`[3]` or `[1]` f64: one loss per micro-batch, so
    /// one length) and their units.
    pending: Option<(Tensor, f64)>,
    /// Σ of the chunks' CE values (f64 scalar) and their trained tokens.
    ce: Option<(Tensor, f64)>,
}

impl Figures {
    fn add_kd(&mut self, f: &KdFigures) -> Result<()> {
        match f {
            KdFigures::Read(m) => add_metrics(&mut self.host, m),
            KdFigures::Pending { sums, count } => {
                self.pending = Some(match self.pending.take() {
                    Some((s, n)) => ((s + sums)?, n + count),
                    None => (sums.clone(), *count),
                });
            }
        }
        Ok(())
    }

    fn add_ce(&mut self, loss: &Tensor, tokens: f64) -> Result<()> {
        let v = loss.detach().to_dtype(DType::F64)?;
        self.ce = Some(match self.ce.take() {
            Some((s, n)) => ((s + v)?, n + tokens),
            None => (v, tokens),
        });
        Ok(())
    }

    /// The summed KD metrics (masses averaged over the units) and the CE sum with its tokens.
    fn read(self) -> Result<(KdMetrics, Option<(f64, f64)>)> {
        let mut parts = Vec::with_capacity(4);
        if let Some((s, _)) = &self.pending {
            parts.push(s.clone());
        }
        if let Some((c, _)) = &self.ce {
            parts.push(c.reshape(1)?);
        }
        let host: Vec<f64> = match parts.len() {
            0 => Vec::new(),
            _ => Tensor::cat(&parts, 0)?.to_vec1()?, // the one copy back
        };
        let mut kd = self.host;
        if let Some((sums, count)) = self.pending {
            let n = sums.elem_count();
            add_metrics(&mut kd, &KdFigures::from_sums(&host[..n], count));
        }
        let ce = self.ce.map(|(_, tokens)| (host[host.len() - 1], tokens));
        Ok((finish_metrics(kd), ce))
    }
}

/// Runs the head and the `terms` over `pieces` of `hidden` `[B, T, H]` (detached), one chunk
/// at a time, and returns the hidden-state and head gradients of the loss `mix` combines.
pub fn run(
    model: &Decoder,
    hidden: &Tensor,
    pieces: &[Piece],
    mix: Mix,
    terms: &mut dyn PieceTerms,
) -> Result<HeadOut> {
    phases::time(Phase::HeadLoss, hidden.device(), || {
        run_chunks(model, hidden, pieces, mix, terms)
    })
}

/// [`run`], untimed.
fn run_chunks(
    model: &Decoder,
    hidden: &Tensor,
    pieces: &[Piece],
    mix: Mix,
    terms: &mut dyn PieceTerms,
) -> Result<HeadOut> {
    let (b, t, h) = hidden.dims3()?;
    let dev = hidden.device();
    // Gradients are summed in f32 (f64 for f64 models) whatever the compute dtype.
    let acc_dt = if hidden.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let flat = hidden.reshape((b * t, h))?;
    let head_dims = model.lm_head().dims().to_vec();
    if let (Mix::Dynamic { kd_weight }, true) = (mix, model.head_sinks()) {
        if let Some(out) = dynamic_by_hand(model, &flat, pieces, kd_weight, terms, acc_dt)? {
            return Ok(HeadOut {
                grad_hidden: out.grad_hidden.reshape((b, t, h))?,
                ..out
            });
        }
    }
    let mut main = Acc::new(b * t, h, acc_dt);
    // Dynamic scaling: the KD term's gradient apart from the CE term's (in `main`).
    let mut kd_acc = match mix {
        Mix::Dynamic { .. } => Some(Acc::new(b * t, h, acc_dt)),
        Mix::Linear { .. } => None,
    };
    // Where one backward per chunk runs (a linear mix) and the head allows it, the chunks' head
    // gradients are summed in place into one accumulator ([`Decoder::logits_into`]).
    let sink = match mix {
        Mix::Linear { .. } if model.head_sinks() => {
            Some(Tensor::zeros(head_dims.as_slice(), acc_dt, dev)?)
        }
        _ => None,
    };
    let mut figures = Figures::default();
    // Every piece's rows on the device in one copy, each piece a view: a copy from pageable
    // host memory per chunk could wait for the device's queue between the chunks' launches.
    let all_rows: Vec<u32> = pieces.iter().flat_map(|p| p.rows.iter().copied()).collect();
    let n_rows = all_rows.len();
    let all_idx = Tensor::from_vec(all_rows, n_rows, dev)?;
    let mut at = 0;
    for (i, p) in pieces.iter().enumerate() {
        let start = at;
        at += p.rows.len();
        if p.rows.is_empty() {
            continue;
        }
        if p.rows.len() != p.shape.0 * p.shape.1 {
            bail!(
                "head chunk of {} rows laid out as {:?}",
                p.rows.len(),
                p.shape
            );
        }
        let idx = all_idx.narrow(0, start, p.rows.len())?;
        // A linear mix into a sink: the chunk by hand where its terms have a fused form.
        if let (Some(s), Mix::Linear { kd, ce: w_ce }) = (&sink, mix) {
            if let Some(fused) = terms.fused(i)? {
                let x = flat.index_select(&idx, 0)?; // [n, H]
                let z = model.logits_untracked(&x)?; // [n, V], then its gradient
                let out = fused_head::run(&z, &fused, kd, w_ce)?;
                main.add_rows(&p.rows, &idx, &model.head_backward_into(&x, &z, s)?)?;
                if let Some((_, f)) = &out.kd {
                    figures.add_kd(f)?;
                }
                if let Some((l, n)) = &out.ce {
                    figures.add_ce(l, *n)?;
                }
                continue;
            }
        }
        // [n, H] -> leaf [b', t', H] -> logits [b', t', V].
        let rows = flat
            .index_select(&idx, 0)?
            .reshape((p.shape.0, p.shape.1, h))?;
        let leaf = Var::from_tensor(&rows)?;
        let chunk = Chunk {
            leaf: &leaf,
            idx: &idx,
            rows: &p.rows,
        };
        let logits = match &sink {
            Some(s) => model.logits_into(leaf.as_tensor(), s)?,
            None => model.logits(leaf.as_tensor())?,
        };
        let c = terms.composed(i, &logits)?;
        drop(logits);
        if let Some((_, f)) = &c.kd {
            figures.add_kd(f)?;
        }
        if let Some((l, n)) = &c.ce {
            figures.add_ce(l, *n)?;
        }
        match mix {
            Mix::Linear { kd, ce: w_ce } => {
                let mut total: Option<Tensor> = None;
                let mut add = |t: Tensor| -> Result<()> {
                    total = Some(match total.take() {
                        Some(s) => (s + t)?,
                        None => t,
                    });
                    Ok(())
                };
                if let Some((l, _)) = &c.kd {
                    add(l.affine(kd, 0.0)?)?;
                }
                if let Some((l, _)) = c.ce.as_ref().filter(|_| w_ce != 0.0) {
                    add(l.affine(w_ce, 0.0)?)?;
                }
                if let Some(total) = total {
                    main.absorb(&total, &chunk, &head_dims)?;
                }
            }
            Mix::Dynamic { .. } => {
                if let (Some((l, _)), Some(acc)) = (&c.kd, kd_acc.as_mut()) {
                    acc.absorb(l, &chunk, &head_dims)?;
                }
                if let Some((l, _)) = &c.ce {
                    main.absorb(l, &chunk, &head_dims)?;
                }
            }
        }
    }
    let (kd_m, ce) = figures.read()?;
    // Combine: the dynamic factor from the totals, as `loss::combine` computes it
    // ([`dynamic_factor`]).
    let (kd_scale, grad_hidden, head) = match (mix, kd_acc) {
        (Mix::Linear { kd, .. }, _) | (Mix::Dynamic { kd_weight: kd }, None) => {
            let mut head = std::mem::take(&mut main.head);
            // (A sink no chunk reached stays out, as a head no backward reached does.)
            if let Some(s) = sink.filter(|_| !main.parts.is_empty()) {
                head.insert(model.lm_head(), s);
            }
            (kd, main.hidden(dev)?, head)
        }
        (Mix::Dynamic { kd_weight }, Some(mut k)) => {
            let f = dynamic_factor(kd_weight, &kd_m, ce)?;
            let mut head = std::mem::take(&mut main.head);
            head.extend(scaled(std::mem::take(&mut k.head), f)?)?;
            let hidden = (main.hidden(dev)? + k.hidden(dev)?.affine(f, 0.0)?)?;
            (f, hidden, head)
        }
    };
    Ok(HeadOut {
        grad_hidden: grad_hidden.reshape((b, t, h))?,
        head,
        sums: HeadSums {
            kd: kd_m,
            ce,
            kd_scale,
        },
    })
}

/// NeMo's dynamic factor `kd_weight·|CE|/|KD|` from a micro-batch's totals (1 for the ratio
/// where the distillation term is 0), as `loss::combine` computes it.
fn dynamic_factor(kd_weight: f64, kd: &KdMetrics, ce: Option<(f64, f64)>) -> Result<f64> {
    let Some((ce_v, _)) = ce else {
        bail!("invalid loss input `ce`: the config's `ce` term needs the CE loss");
    };
    let (kd_v, ce_v) = (kd.loss.abs(), ce_v.abs());
    let s = if kd_v > 1e-12 { ce_v / kd_v } else { 1.0 };
    Ok(kd_weight * s)
}

/// NeMo's dynamic mix by hand, where every piece's terms have a fused form and the head sums
/// its gradient in place: a first pass over the chunks for the terms' totals (each chunk's
/// logits and one kernel pass, nothing written; the micro-batch's figures read once), the
/// factor from them, then each chunk by hand as a linear mix with the factor as the
/// distillation weight. One more logits GEMM per chunk than a linear mix, where autograd kept
/// the two terms' gradients apart (their `[n, V]` gradients and backward passes each) and
/// combined them at the end. `None` (nothing run) where a piece has no fused form. The
/// hidden-state gradient comes back as `[B·T, H]`.
fn dynamic_by_hand(
    model: &Decoder,
    flat: &Tensor,
    pieces: &[Piece],
    kd_weight: f64,
    terms: &mut dyn PieceTerms,
    acc_dt: DType,
) -> Result<Option<HeadOut>> {
    let dev = flat.device();
    let mut chunks = Vec::with_capacity(pieces.len());
    for (i, p) in pieces.iter().enumerate() {
        if p.rows.is_empty() {
            continue;
        }
        match terms.fused(i)? {
            Some(f) => chunks.push((p, f)),
            None => return Ok(None),
        }
    }
    // 1. The terms' totals. Every chunk's rows on the device in one copy (as `run_chunks`).
    let all_rows: Vec<u32> = chunks
        .iter()
        .flat_map(|(p, _)| p.rows.iter().copied())
        .collect();
    let all_idx = Tensor::from_vec(
        all_rows,
        chunks.iter().map(|(p, _)| p.rows.len()).sum::<usize>(),
        dev,
    )?;
    let mut figures = Figures::default();
    let mut inputs = Vec::with_capacity(chunks.len());
    let mut at = 0;
    for (p, f) in &chunks {
        let idx = all_idx.narrow(0, at, p.rows.len())?;
        at += p.rows.len();
        let x = flat.index_select(&idx, 0)?; // [n, H]
        let out = fused_head::values(&model.logits_untracked(&x)?, f)?;
        if let Some((_, kd)) = &out.kd {
            figures.add_kd(kd)?;
        }
        if let Some((l, n)) = &out.ce {
            figures.add_ce(l, *n)?;
        }
        inputs.push((idx, x));
    }
    let (kd_m, ce) = figures.read()?;
    let factor = dynamic_factor(kd_weight, &kd_m, ce)?;
    // 2. Each chunk by hand with the factor as the distillation weight.
    let (rows, h) = flat.dims2()?;
    let mut main = Acc::new(rows, h, acc_dt);
    let sink = Tensor::zeros(model.lm_head().dims(), acc_dt, dev)?;
    for ((p, f), (idx, x)) in chunks.iter().zip(&inputs) {
        let z = model.logits_untracked(x)?;
        fused_head::run(&z, f, factor, 1.0)?;
        main.add_rows(&p.rows, idx, &model.head_backward_into(x, &z, &sink)?)?;
    }
    let mut head = GradStore::default();
    if !main.parts.is_empty() {
        head.insert(model.lm_head(), sink);
    }
    Ok(Some(HeadOut {
        grad_hidden: main.hidden(dev)?,
        head,
        sums: HeadSums {
            kd: kd_m,
            ce,
            kd_scale: factor,
        },
    }))
}

/// `rows` cut into pieces of at most `per` rows, each laid out as `[1, n]`.
pub fn row_pieces(rows: &[u32], per: usize) -> Vec<Piece> {
    rows.chunks(per.max(1))
        .map(|c| Piece {
            rows: c.to_vec(),
            shape: (1, c.len()),
        })
        .collect()
}

/// Runs the head over `pieces` of `hidden` `[B, T, H]` without gradients, one chunk at a time
/// (validation): `each(i, logits)` sees piece `i`'s logits `[shape.0, shape.1, V]`.
pub fn forward_only<F>(
    model: &Decoder,
    hidden: &Tensor,
    pieces: &[Piece],
    mut each: F,
) -> Result<()>
where
    F: FnMut(usize, &Tensor) -> Result<()>,
{
    let (b, t, h) = hidden.dims3()?;
    let flat = hidden.detach().reshape((b * t, h))?;
    for (i, p) in pieces.iter().enumerate() {
        if p.rows.is_empty() {
            continue;
        }
        let idx = Tensor::from_vec(p.rows.clone(), p.rows.len(), hidden.device())?;
        let rows = flat
            .index_select(&idx, 0)?
            .reshape((p.shape.0, p.shape.1, h))?;
        each(i, &model.logits(&rows)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use xdistill_shared::model::device_ops;

    /// The hidden-state gradient put together from chunks equals adding each chunk's rows into
    /// zeros (candle's `index_add`, the reference): distinct rows in any order with rows no
    /// chunk holds (one gather), and rows two chunks share (summed).
    #[test]
    fn chunk_gradients_land_on_their_rows() {
        let dev = candle_core::Device::Cpu;
        let (rows, h) = (9, 3);
        let part = |r: &[u32], seed: u64| {
            let v = xdistill_shared::init::lcg_noise(seed, r.len() * h, 1.0);
            let g = Tensor::from_vec(v, (r.len(), h), &dev).unwrap();
            let idx = Tensor::from_vec(r.to_vec(), r.len(), &dev).unwrap();
            (r.to_vec(), idx, g)
        };
        for chunks in [
            vec![part(&[4, 0, 7], 1), part(&[2, 8], 2)],
            vec![part(&[4, 0, 7], 1), part(&[7, 1], 3)],
        ] {
            let mut want = Tensor::zeros((rows, h), DType::F32, &dev).unwrap();
            for (_, idx, g) in &chunks {
                want = want.index_add(idx, g, 0).unwrap();
            }
            let acc = Acc {
                rows,
                h,
                dtype: DType::F32,
                parts: chunks,
                head: GradStore::default(),
            };
            let got = acc.hidden(&dev).unwrap();
            assert_eq!(
                got.to_vec2::<f32>().unwrap(),
                want.to_vec2::<f32>().unwrap()
            );
        }
    }

    /// Chunks of the fused losses hold 512 MiB of logits in the head's dtype where they run
    /// (forced here: the CPU runs their reference), 256 MiB of f32 logits elsewhere; forced
    /// rows win either way.
    #[test]
    fn fused_chunks_are_sized_in_the_heads_dtype() {
        let head = Tensor::zeros((151_936, 8), DType::BF16, &candle_core::Device::Cpu).unwrap();
        let auto = HeadOpts::default();
        assert_eq!(
            auto.fused_rows(&head).unwrap(),
            441,
            "composed losses on the CPU"
        );
        device_ops::force_in_this_thread(Some(true));
        assert_eq!(auto.fused_rows(&head).unwrap(), 1_766);
        let forced = HeadOpts {
            chunk_rows: 3,
            ..HeadOpts::default()
        };
        assert_eq!(forced.fused_rows(&head).unwrap(), 3);
        device_ops::force_in_this_thread(None);
    }
}
