//! Cross-tokenizer distillation on byte-aligned chunks: projected KL (NeMo's P-KL) and the gold
//! hybrid (KL on exactly mapped tokens, sorted-probability L1 elsewhere).
//!
//! Inputs live on the host ([`XTokenBatch`], [`Projection`]): the per-chunk index lists are built
//! there with plain loops, then differentiable gathers, `index_add`s and the sparse product
//! [`xdistill_kernels::sparse_matmul`] (P-KL's projection) pull what is needed out of the
//! student's probabilities on the device.

mod projection;

pub use projection::Projection;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};
use xdistill_kernels::SparseColumns;

use super::stable::{log1mexp, logsumexp_last, softmax_last, LOG_FLOOR, TAIL_FLOOR};
use super::topk::topk_indices;
use super::{
    compute_dtype, Anchor, KdFigures, KdMetrics, LossError, Normalizer, Result, TailMode,
    Temperature,
};

/// Added to projected probabilities before the log (a teacher token no student token maps to).
const Q_EPS: f64 = 1e-10;
/// Additive log-penalty of unused slots (probability `e^-1e4 = 0`).
const PAD_PENALTY: f64 = -1.0e4;

/// Probability mass summed per group id (a student token), the groups in order of first
/// appearance: first_kl's and the ensemble's grouping of a teacher row by first student token.
/// An index keeps it linear in the row's length (k reaches the teacher's whole vocabulary, 32k
/// and more, where a search of the groups per entry took seconds per step); each group's mass is
/// added in the row's order, so the sums do not depend on the index.
#[derive(Debug, Default)]
pub struct GroupedMass {
    groups: Vec<(u32, f64)>,
    index: std::collections::HashMap<u32, usize>,
}

impl GroupedMass {
    /// Room for `n` groups.
    pub fn with_capacity(n: usize) -> GroupedMass {
        GroupedMass {
            groups: Vec::with_capacity(n),
            index: std::collections::HashMap::with_capacity(n),
        }
    }

    /// Adds `p` to the mass of group `g`.
    pub fn add(&mut self, g: u32, p: f64) {
        match self.index.entry(g) {
            std::collections::hash_map::Entry::Occupied(e) => self.groups[*e.get()].1 += p,
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.groups.len());
                self.groups.push((g, p));
            }
        }
    }

    /// `(group, mass)` in order of first appearance.
    pub fn into_vec(self) -> Vec<(u32, f64)> {
        self.groups
    }
}

/// One batch of aligned sequences for the cross-tokenizer losses, on the host, row-major.
///
/// Both tokenizations are in the *shifted* view: position `t`'s logits predict token `t + 1`,
/// and `*_chunk[t]` is the chunk of token `t + 1` (−1: none, e.g. padding or prompt). Chunk ids
/// of row `b` lie in `0..num_chunks[b]`. Fields a loss does not read may be left empty:
/// P-KL reads the chunks and the teacher top-k; gold also the targets; ALM the chunks, the
/// student targets and the teacher target log-probs.
#[derive(Debug, Clone, Default)]
pub struct XTokenBatch {
    /// B.
    pub batch: usize,
    /// Ts, student positions per row.
    pub student_len: usize,
    /// Tt, teacher positions per row.
    pub teacher_len: usize,
    /// Entries per teacher top-k row.
    pub k: usize,
    /// `[B, Ts]` chunk of each student position (i64, −1 = none).
    pub student_chunk: Vec<i64>,
    /// `[B, Tt]` chunk of each teacher position (i64, −1 = none).
    pub teacher_chunk: Vec<i64>,
    /// `[B]` chunks per row.
    pub num_chunks: Vec<usize>,
    /// `[B, Ts]` the student token each position predicts (token `t + 1`).
    pub student_targets: Vec<u32>,
    /// `[B, Tt]` the teacher token each position predicts.
    pub teacher_targets: Vec<u32>,
    /// `[B, Tt, k]` teacher top-k ids (descending log-prob).
    pub teacher_topk_ids: Vec<u32>,
    /// `[B, Tt, k]` teacher `log_softmax(z_T/τ)` at those ids.
    pub teacher_topk_logprobs: Vec<f32>,
    /// `[B, Tt]` teacher log-prob of `teacher_targets`.
    pub teacher_target_logprobs: Vec<f32>,
}

/// The student and teacher positions of one chunk with both sides non-empty, in order.
#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub b: usize,
    pub student: Vec<usize>,
    pub teacher: Vec<usize>,
}

impl XTokenBatch {
    /// `batch` rows of `student_len` and `teacher_len` positions and `k` teacher entries each,
    /// every position outside any chunk and every other value zero: what a collator fills in.
    pub fn empty(batch: usize, student_len: usize, teacher_len: usize, k: usize) -> XTokenBatch {
        let (b, ts, tt) = (batch, student_len, teacher_len);
        XTokenBatch {
            batch,
            student_len,
            teacher_len,
            k,
            student_chunk: vec![-1; b * ts],
            teacher_chunk: vec![-1; b * tt],
            num_chunks: vec![0; b],
            student_targets: vec![0; b * ts],
            teacher_targets: vec![0; b * tt],
            teacher_topk_ids: vec![0; b * tt * k],
            teacher_topk_logprobs: vec![0.0; b * tt * k],
            teacher_target_logprobs: vec![0.0; b * tt],
        }
    }

    fn check_len<T>(&self, field: &'static str, v: &[T], want: usize) -> Result<()> {
        if v.len() != want {
            return Err(LossError::input(
                field,
                format!("has {} entries, expected {want}", v.len()),
            ));
        }
        Ok(())
    }

    /// Chunks with at least one student and one teacher position, ordered by (row, chunk id).
    pub(crate) fn chunks(&self) -> Result<Vec<Chunk>> {
        let (b, ts, tt) = (self.batch, self.student_len, self.teacher_len);
        self.check_len("student_chunk", &self.student_chunk, b * ts)?;
        self.check_len("teacher_chunk", &self.teacher_chunk, b * tt)?;
        self.check_len("num_chunks", &self.num_chunks, b)?;
        let mut out = Vec::new();
        for row in 0..b {
            let n = self.num_chunks[row];
            let mut sides: Vec<(Vec<usize>, Vec<usize>)> = vec![(vec![], vec![]); n];
            let mut place = |ids: &[i64], field: &'static str, student: bool| -> Result<()> {
                for (t, &c) in ids.iter().enumerate() {
                    if c == -1 {
                        continue;
                    }
                    if c < 0 || c as usize >= n {
                        return Err(LossError::input(
                            field,
                            format!("row {row} position {t}: chunk {c} not in -1..{n}"),
                        ));
                    }
                    let s = &mut sides[c as usize];
                    if student { &mut s.0 } else { &mut s.1 }.push(t);
                }
                Ok(())
            };
            place(
                &self.student_chunk[row * ts..(row + 1) * ts],
                "student_chunk",
                true,
            )?;
            place(
                &self.teacher_chunk[row * tt..(row + 1) * tt],
                "teacher_chunk",
                false,
            )?;
            for (student, teacher) in sides {
                if !student.is_empty() && !teacher.is_empty() {
                    out.push(Chunk {
                        b: row,
                        student,
                        teacher,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Checks the lengths of the teacher top-k buffers (ids are checked row by row on use).
    fn check_topk(&self) -> Result<()> {
        let n = self.batch * self.teacher_len * self.k;
        if self.k == 0 {
            return Err(LossError::input("k", "must be at least 1"));
        }
        self.check_len("teacher_topk_ids", &self.teacher_topk_ids, n)?;
        self.check_len("teacher_topk_logprobs", &self.teacher_topk_logprobs, n)?;
        Ok(())
    }

    /// Teacher top-k of position `(b, t)`: ids (checked against the vocabulary) and log-probs
    /// (NaN rejected, floored at [`LOG_FLOOR`]).
    fn topk_row(&self, b: usize, t: usize, teacher_vocab: usize) -> Result<(&[u32], Vec<f64>)> {
        let r = (b * self.teacher_len + t) * self.k;
        let ids = &self.teacher_topk_ids[r..r + self.k];
        if let Some(u) = ids.iter().find(|&&u| u as usize >= teacher_vocab) {
            return Err(LossError::input(
                "teacher_topk_ids",
                format!("row {b} position {t}: id {u} >= teacher vocab {teacher_vocab}"),
            ));
        }
        let lps = self.teacher_topk_logprobs[r..r + self.k]
            .iter()
            .map(|&v| {
                if v.is_nan() {
                    Err(LossError::input(
                        "teacher_topk_logprobs",
                        format!("row {b} position {t}: NaN"),
                    ))
                } else {
                    Ok((v as f64).clamp(LOG_FLOOR, 0.0))
                }
            })
            .collect::<Result<Vec<f64>>>()?;
        Ok((ids, lps))
    }
}

/// Checks `[B, Ts, V]` against the batch and narrows the vocabulary to the projection's
/// (padded LM-head columns are not tokens); returns the logits in the compute dtype.
pub(crate) fn student_view(logits: &Tensor, batch: &XTokenBatch, vocab: usize) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    if b != batch.batch || t != batch.student_len || v < vocab {
        return Err(LossError::input(
            "student_logits",
            format!(
                "shape {:?}, expected [B = {}, Ts = {}, V >= {vocab}]",
                logits.dims(),
                batch.batch,
                batch.student_len
            ),
        ));
    }
    let z = if v > vocab {
        logits.narrow(2, 0, vocab)?
    } else {
        logits.clone()
    };
    Ok(z.to_dtype(compute_dtype(logits))?)
}

/// An index tensor for `n`-element flat lookups (u32 when it fits, else i64).
pub(crate) fn index_tensor(idx: Vec<u64>, limit: usize, device: &Device) -> Result<Tensor> {
    let n = idx.len();
    Ok(if limit <= u32::MAX as usize {
        Tensor::from_vec(
            idx.into_iter().map(|i| i as u32).collect::<Vec<_>>(),
            n,
            device,
        )?
    } else {
        Tensor::from_vec(
            idx.into_iter().map(|i| i as i64).collect::<Vec<_>>(),
            n,
            device,
        )?
    })
}

pub(crate) fn host_tensor(v: Vec<f64>, shape: &[usize], dt: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(v, shape, dev)?.to_dtype(dt)?)
}

fn zero_loss(dt: DType, dev: &Device) -> Result<(Tensor, KdFigures)> {
    Ok((Tensor::zeros((), dt, dev)?, KdMetrics::default().into()))
}

/// Both sides' log-likelihood of each chunk's text, for the losses that need only the actual
/// next tokens (ALM, the chunk-level sampled KL): the student's `ℓS_c = Σ_{s∈c} lp_S(y_s)` at
/// `temperature`, `[C]` on the logits' device with gradient, and the teacher's
/// `ℓT_c = Σ_{t∈c} lp_T(y_t)` on the host (each term floored at [`LOG_FLOOR`]).
pub(crate) fn chunk_loglikelihoods(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    chunks: &[Chunk],
    temperature: f64,
) -> Result<(Tensor, Vec<f64>)> {
    let (b, ts, v) = student_logits.dims3()?;
    if b != batch.batch || ts != batch.student_len {
        return Err(LossError::input(
            "student_logits",
            format!(
                "shape {:?}, expected [B = {}, Ts = {}, V]",
                student_logits.dims(),
                batch.batch,
                batch.student_len
            ),
        ));
    }
    let tt = batch.teacher_len;
    batch.check_len("student_targets", &batch.student_targets, b * ts)?;
    batch.check_len(
        "teacher_target_logprobs",
        &batch.teacher_target_logprobs,
        b * tt,
    )?;
    if let Some(y) = batch.student_targets.iter().find(|&&y| y as usize >= v) {
        return Err(LossError::input(
            "student_targets",
            format!("id {y} >= vocab {v}"),
        ));
    }
    // 1. Host: student positions per chunk and the teacher's chunk log-likelihoods.
    let (mut pos, mut seg, mut lt) = (Vec::new(), Vec::new(), Vec::new());
    for (ci, c) in chunks.iter().enumerate() {
        let mut l = 0.0;
        for &t in &c.teacher {
            let x = batch.teacher_target_logprobs[c.b * tt + t];
            if x.is_nan() {
                return Err(LossError::input(
                    "teacher_target_logprobs",
                    format!("row {} position {t}: NaN", c.b),
                ));
            }
            l += (x as f64).clamp(LOG_FLOOR, 0.0);
        }
        lt.push(l);
        for &t in &c.student {
            pos.push((c.b * ts + t) as u64);
            seg.push(ci as u32);
        }
    }
    // 2. Device: student target log-probs z[y] − logsumexp(z), summed per chunk.
    let dev = student_logits.device();
    let z = student_logits
        .to_dtype(compute_dtype(student_logits))?
        .affine(1.0 / temperature, 0.0)?;
    let y = Tensor::from_vec(batch.student_targets.clone(), (b, ts, 1), dev)?;
    let lp = (z.gather(&y, 2)?.squeeze(2)? - logsumexp_last(&z)?)?.flatten_all()?;
    let picked = lp.index_select(&index_tensor(pos, lp.elem_count(), dev)?, 0)?;
    let seg = Tensor::from_vec(seg, picked.elem_count(), dev)?;
    let ls = Tensor::zeros(chunks.len(), lp.dtype(), dev)?.index_add(&seg, &picked, 0)?;
    Ok((ls, lt))
}

/// The common start of the top-k chunk losses: the checked student logits `[B, Ts, Vs]` in the
/// compute dtype, and the chunks with both sides (after checking the top-k buffers).
fn view_and_chunks(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    proj: &Projection,
) -> Result<(Tensor, Vec<Chunk>)> {
    let z = student_view(student_logits, batch, proj.student_vocab())?;
    batch.check_topk()?;
    Ok((z, batch.chunks()?))
}

/// Chunk-level projected KL (NeMo's P-KL) over the teacher top-k set K of each chunk.
///
/// For a chunk c with student positions S_c and teacher positions T_c, the anchor teacher
/// position a (first or last of T_c) supplies K and its exact log-probs L_c = lp_T,a\[K\].
/// `q_t = Wᵀ softmax(z_S,t/τ)`, `Q_c = mean_{t∈S_c} q_t[K]`,
/// `loss = τ² · Σ_c D_c / N` with N the number of chunks with both sides (or `normalizer`) and,
/// by `tail`:
/// - `Renormalize` (NeMo's P-KL): `D_c = Σ_K e^{L_c}(L_c − log Q̂_c)`, Q̂ = Q renormalised over K;
/// - `Bucket`: the (k+1)-way KL with the mass outside K as one more entry on both sides,
///   `D_c = Σ_K e^{L_c}(L_c − log Q_c) + T_c(log T_c − log(1 − Σ_K Q_c))`, `T_c = 1 − Σ_K e^{L_c}`
///   (both floored at 1e-6). Unlike NeMo's form it penalises student mass outside K, which a
///   student trained from scratch otherwise keeps (it then matches the teacher inside K and
///   still samples junk);
/// - `Ignore`: `D_c = Σ_K e^{L_c}(L_c − log Q_c)`, Q not renormalised.
///
/// `student_logits`: `[B, Ts, V]`, `V ≥ proj.student_vocab()`.
pub fn pkl_loss(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    proj: &Projection,
    anchor: Anchor,
    tail: TailMode,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let normalizer = normalizer.map(Normalizer::get);
    let temperature = temperature.get();
    let (z, chunks) = view_and_chunks(student_logits, batch, proj)?;
    let (dt, dev) = (z.dtype(), z.device().clone());
    if chunks.is_empty() {
        return zero_loss(dt, &dev);
    }
    let (k, ts, vs) = (batch.k, batch.student_len, proj.student_vocab());

    // 1. Host: Q_c[j] = Σ_{t∈S_c} Σ_{(s,w) ∈ W[:, K_c[j]]} w/|S_c| · p_t[s] as a sparse product
    //    over the student's log-probs gathered at each chunk's student tokens: the chunk's
    //    distinct tokens get the columns of a `[B·Ts, m]` gather (the same for every position
    //    of the chunk), so only those log-probs are computed (no `[B, Ts, V]` softmax on the
    //    CPU). One W entry per (chunk, K entry, position, student token): 15M at k = 32,000 on
    //    45 chunks of a Qwen3 student under a Llama 2 teacher, so the plan is counted first.
    let positions = batch.batch * ts;
    let n_units = chunks.len();
    let mut lt = Vec::with_capacity(n_units * k);
    let mut anchors = Vec::with_capacity(n_units);
    let mut chunk_cols = Vec::with_capacity(n_units); // each chunk's distinct student tokens
    let mut slot_of = vec![u32::MAX; vs]; // a chunk's column of each student token (reset per chunk)
    let mut entries = 0usize;
    for c in &chunks {
        let a = match anchor {
            Anchor::First => c.teacher[0],
            Anchor::Last => c.teacher[c.teacher.len() - 1],
        };
        let (ids, lps) = batch.topk_row(c.b, a, proj.teacher_vocab())?;
        lt.extend_from_slice(&lps);
        let mut cols = Vec::new();
        for &u in ids {
            let students = proj.column(u as usize).0;
            entries += students.len() * c.student.len();
            for &s in students {
                if slot_of[s as usize] == u32::MAX {
                    slot_of[s as usize] = cols.len() as u32;
                    cols.push(s);
                }
            }
        }
        for &s in &cols {
            slot_of[s as usize] = u32::MAX;
        }
        anchors.push(ids);
        chunk_cols.push(cols);
    }
    let m = chunk_cols.iter().map(Vec::len).max().unwrap_or(0);
    if positions.saturating_mul(m) > u32::MAX as usize {
        return Err(LossError::input(
            "teacher_topk_ids",
            format!(
                "a gather of {positions} student positions × {m} student tokens does not fit a \
                 u32 index: use fewer positions per micro-batch or a smaller k"
            ),
        ));
    }
    // [B·Ts, m] ids (rows outside chunks and short rows padded with token 0, never read).
    let mut gather_ids = vec![0u32; positions * m];
    let (mut ptr, mut rows, mut wts) = (
        vec![0usize],
        Vec::with_capacity(entries),
        Vec::with_capacity(entries),
    );
    for ((c, ids), cols) in chunks.iter().zip(&anchors).zip(&chunk_cols) {
        for &t in &c.student {
            let row = c.b * ts + t;
            gather_ids[row * m..row * m + cols.len()].copy_from_slice(cols);
        }
        for (i, &s) in cols.iter().enumerate() {
            slot_of[s as usize] = i as u32;
        }
        let inv_m = 1.0 / c.student.len() as f32;
        for &u in ids.iter() {
            let (students, weights) = proj.column(u as usize);
            for &t in &c.student {
                let base = ((c.b * ts + t) * m) as u32;
                for (&s, &w) in students.iter().zip(weights) {
                    rows.push(base + slot_of[s as usize]);
                    wts.push(w * inv_m);
                }
            }
            ptr.push(rows.len());
        }
        for &s in cols {
            slot_of[s as usize] = u32::MAX;
        }
    }
    drop(chunk_cols);

    // 2. Device: p_S at the gathered tokens, then Q = p · W, [C, k].
    let q = if rows.is_empty() {
        Tensor::zeros(n_units * k, dt, &dev)?
    } else {
        let w = Arc::new(SparseColumns::new(positions * m, ptr, rows, wts)?);
        let gather_ids = Tensor::from_vec(gather_ids, (batch.batch, ts, m), &dev)?;
        let z = if temperature == 1.0 {
            z
        } else {
            z.affine(1.0 / temperature, 0.0)?
        };
        let p = xdistill_kernels::gather_log_softmax(&z, &gather_ids)?
            .exp()?
            .reshape((1, positions * m))?;
        xdistill_kernels::sparse_matmul(&p, &w)?
    };
    let q = q.reshape((n_units, k))?.affine(1.0, Q_EPS)?;
    let q_mass = q.sum_keepdim(D::Minus1)?; // [C, 1]
    let student_mass = q_mass.detach().squeeze(D::Minus1)?;
    let log_q = match tail {
        TailMode::Renormalize => q.broadcast_div(&q_mass)?.log()?,
        TailMode::Bucket | TailMode::Ignore => q.log()?,
    };

    // 3. Σ_K e^L (L − log Q) per chunk (+ the tail entry), summed and normalised, τ².
    let l = host_tensor(lt, &[n_units, k], dt, &dev)?;
    let mut per_chunk = (l.exp()? * (&l - log_q)?)?.sum(D::Minus1)?;
    if tail == TailMode::Bucket {
        let lt_tail = log1mexp(&logsumexp_last(&l)?, TAIL_FLOOR)?; // [C]
        let ls_tail = log1mexp(&q_mass.log()?.squeeze(D::Minus1)?, TAIL_FLOOR)?;
        per_chunk = (per_chunk + (lt_tail.exp()? * (&lt_tail - ls_tail)?)?)?;
    }
    let n = normalizer.unwrap_or(n_units as f64);
    let loss = per_chunk
        .sum_all()?
        .affine(temperature * temperature / n, 0.0)?;
    let figures = KdFigures::pending(
        &loss,
        &[&l.exp()?.sum_all()?, &student_mass.sum_all()?],
        n_units as f64,
    )?;
    Ok((loss, figures))
}

/// First-token KL: forward KL at each chunk's *first* student position, with the teacher's
/// top-k coarsened to the student's first tokens.
///
/// For chunk c, the first teacher position a₀ supplies K and `P_T[u] = e^{L_u}`; every u ∈ K
/// is spelled by the student starting with token `f(u)` (`Projection::teacher_first`), so the
/// teacher's mass is grouped by first student token, `P[g] = Σ_{f(u)=g} P_T[u]` (a u with no
/// first token adds to the tail). The student side is its distribution at the chunk's first
/// position t₀ (the same context as a₀: the text before the chunk), `p[g] = softmax(z_t₀/τ)[g]`.
/// `D_c = Σ_g P[g](log P[g] − log p[g]) + T(log T − log S)`, `T = 1 − Σ_g P[g]`,
/// `S = 1 − Σ_g p[g]` (both floored at 1e-6): a proper (|G|+1)-way KL.
/// `loss = τ² · Σ_c D_c / N`, N = chunks with both sides (or `normalizer`).
///
/// Why: P-KL's W maps a student token only to the teacher tokens that spell it, so a teacher
/// token longer than every student token (Qwen3's `"\n\n"` vs Llama 2's `<0x0A>`+`<0x0A>`) has no
/// preimage and P-KL pushes the student away from the right first piece. Here the long token's mass lands on its
/// first piece. The later student positions of a multi-token chunk get no distillation term.
pub fn first_kl_loss(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    proj: &Projection,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let normalizer = normalizer.map(Normalizer::get);
    let temperature = temperature.get();
    if proj.teacher_first.is_empty() {
        return Err(LossError::input(
            "projection",
            "first_kl needs the teacher → student first-token map (Projection::with_teacher_first)"
                .to_string(),
        ));
    }
    let (z, chunks) = view_and_chunks(student_logits, batch, proj)?;
    let (dt, dev) = (z.dtype(), z.device().clone());
    if chunks.is_empty() {
        return zero_loss(dt, &dev);
    }
    let (k, ts, vs) = (batch.k, batch.student_len, proj.student_vocab());

    // 1. Host: per chunk, the student row of its first position and the teacher's mass grouped
    //    by first student token, padded to k (padding: weight 0, mask 0).
    let (mut rows, mut ids, mut pt, mut mask) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut constant, mut teacher_mass) = (0.0f64, 0.0f64);
    let mut t_tail = Vec::with_capacity(chunks.len());
    for c in &chunks {
        rows.push((c.b * ts + c.student[0]) as u32);
        let (kids, lps) = batch.topk_row(c.b, c.teacher[0], proj.teacher_vocab())?;
        let mut grouped = GroupedMass::with_capacity(k);
        for (&u, &l) in kids.iter().zip(&lps) {
            if let Some(g) = proj.teacher_first(u as usize) {
                grouped.add(g, l.exp());
            }
        }
        let groups = grouped.into_vec();
        let in_groups: f64 = groups.iter().map(|g| g.1).sum();
        teacher_mass += in_groups;
        let tail = (1.0 - in_groups).max(TAIL_FLOOR);
        t_tail.push(tail);
        constant += groups.iter().map(|(_, p)| p * p.ln()).sum::<f64>() + tail * tail.ln();
        let pad = groups.first().map(|g| g.0).unwrap_or(0);
        for j in 0..k {
            let (g, p, m) = groups
                .get(j)
                .map(|&(g, p)| (g, p, 1.0))
                .unwrap_or((pad, 0.0, 0.0));
            ids.push(g);
            pt.push(p);
            mask.push(m);
        }
    }
    let n_units = chunks.len();

    // 2. Device: log p[g] at each chunk's first position, [C, k]; S = Σ_g p[g] over real groups.
    let rows = Tensor::from_vec(rows, n_units, &dev)?;
    let zr = z.reshape((batch.batch * ts, vs))?.index_select(&rows, 0)?; // [C, V]
                                                                         // Only the k gathered log-probs: no [C, V] log-softmax on the CPU.
    let ls = xdistill_kernels::gather_log_softmax(
        &zr.affine(1.0 / temperature, 0.0)?,
        &Tensor::from_vec(ids, (n_units, k), &dev)?,
    )?; // [C, k]
    let mask = host_tensor(mask, &[n_units, k], dt, &dev)?;
    let s_mass = (ls.exp()? * &mask)?.sum(D::Minus1)?; // [C]
    let ls_tail = log1mexp(&s_mass.log()?, TAIL_FLOOR)?;
    let pt = host_tensor(pt, &[n_units, k], dt, &dev)?;
    let t_tail = host_tensor(t_tail, &[n_units], dt, &dev)?;
    // Σ_c [−Σ_g P log p − T log S] + Σ_c [Σ_g P log P + T log T] (the constant, on the host).
    let cross = ((pt * ls)?.sum(D::Minus1)? + (t_tail * ls_tail)?)?;
    let n = normalizer.unwrap_or(n_units as f64);
    let loss = cross
        .sum_all()?
        .affine(-1.0, constant)?
        .affine(temperature * temperature / n, 0.0)?;
    let teacher_mass = Tensor::new(teacher_mass, &dev)?;
    let figures = KdFigures::pending(&loss, &[&teacher_mass, &s_mass.sum_all()?], n_units as f64)?;
    Ok((loss, figures))
}

/// The gold hybrid (NeMo gold / xtoken, TRL GOLD).
///
/// A chunk with exactly one student and one teacher position whose student target maps exactly
/// (one-hot W row) to the teacher target is *matched*: forward KL over the teacher's top-k ids
/// that have an exact student counterpart (K'), both sides renormalised over K'. Every other
/// chunk (or a matched one with empty K') is *unmatched*: L1 between the teacher's top-k
/// probabilities and the student's k largest probabilities, both sorted descending, taken at
/// the chunk's first positions (the two models have seen the same text there).
/// `loss = τ²·(matched_weight·Σ KL + unmatched_weight·Σ L1) / N`, N = chunks with both sides.
#[allow(clippy::too_many_arguments)]
pub fn gold_loss(
    student_logits: &Tensor,
    batch: &XTokenBatch,
    proj: &Projection,
    matched_weight: f64,
    unmatched_weight: f64,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let normalizer = normalizer.map(Normalizer::get);
    let temperature = temperature.get();
    let z = student_view(student_logits, batch, proj.student_vocab())?;
    let (dt, dev) = (z.dtype(), z.device().clone());
    batch.check_topk()?;
    let (b, ts, tt, k) = (batch.batch, batch.student_len, batch.teacher_len, batch.k);
    batch.check_len("student_targets", &batch.student_targets, b * ts)?;
    batch.check_len("teacher_targets", &batch.teacher_targets, b * tt)?;
    let vs = proj.student_vocab();
    if k > vs {
        return Err(LossError::input(
            "k",
            format!("k = {k} > student vocab {vs}"),
        ));
    }
    let chunks = batch.chunks()?;
    if chunks.is_empty() {
        return zero_loss(dt, &dev);
    }

    // 1. Host: split chunks into matched (gather indices + teacher log-probs over K') and
    //    unmatched (student row + sorted teacher probabilities).
    let (mut m_idx, mut m_pen, mut m_lt) = (Vec::new(), Vec::new(), Vec::new());
    let (mut u_rows, mut u_pt) = (Vec::new(), Vec::new());
    let mut teacher_mass = 0.0;
    for c in &chunks {
        let (t, a) = (c.student[0], c.teacher[0]);
        let (ids, lps) = batch.topk_row(c.b, a, proj.teacher_vocab())?;
        teacher_mass += lps.iter().map(|l| l.exp()).sum::<f64>();
        let s_tok = batch.student_targets[c.b * ts + t];
        let u_tok = batch.teacher_targets[c.b * tt + a];
        let one_to_one = c.student.len() == 1 && c.teacher.len() == 1;
        let mapped: Vec<Option<u32>> = ids
            .iter()
            .map(|&u| proj.exact_student(u as usize))
            .collect();
        if gold_matched(proj, one_to_one, s_tok, u_tok) && mapped.iter().any(Option::is_some) {
            let row = ((c.b * ts + t) * vs) as u64;
            let pen: Vec<f64> = mapped
                .iter()
                .map(|m| if m.is_some() { 0.0 } else { PAD_PENALTY })
                .collect();
            // Teacher log-probs renormalised over K' (host, f64).
            let shifted: Vec<f64> = lps.iter().zip(&pen).map(|(l, p)| l + p).collect();
            let mx = shifted.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + shifted.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
            m_lt.extend(shifted.iter().map(|x| x - lse));
            m_idx.extend(mapped.iter().map(|m| row + m.unwrap_or(0) as u64));
            m_pen.extend(pen);
        } else {
            u_rows.push((c.b * ts + t) as u32);
            let mut pt: Vec<f64> = lps.iter().map(|l| l.exp()).collect();
            pt.sort_by(|x, y| y.total_cmp(x));
            u_pt.extend(pt);
        }
    }
    let (n_m, n_u) = (m_idx.len() / k, u_rows.len());
    let zt = z.affine(1.0 / temperature, 0.0)?;
    let mut total = Tensor::zeros((), dt, &dev)?;

    // 2. Matched: KL(T‖S) over K' from the gathered student logits.
    if n_m > 0 {
        let zk = zt
            .flatten_all()?
            .index_select(&index_tensor(m_idx, zt.elem_count(), &dev)?, 0)?
            .reshape((n_m, k))?;
        let zk = (zk + host_tensor(m_pen, &[n_m, k], dt, &dev)?)?;
        let lp_s = zk.broadcast_sub(&logsumexp_last(&zk)?.unsqueeze(1)?)?;
        let lp_t = host_tensor(m_lt, &[n_m, k], dt, &dev)?;
        let kl = (lp_t.exp()? * (&lp_t - lp_s)?)?.sum_all()?;
        total = (total + kl.affine(matched_weight, 0.0)?)?;
    }
    // 3. Unmatched: L1 between sorted top-k probabilities.
    if n_u > 0 {
        let rows = Tensor::from_vec(u_rows, n_u, &dev)?;
        let p = softmax_last(&zt.reshape((b * ts, vs))?.index_select(&rows, 0)?)?;
        let ps = p.gather(&topk_indices(&p, k)?, 1)?;
        let pt = host_tensor(u_pt, &[n_u, k], dt, &dev)?;
        let l1 = (pt - ps)?.abs()?.sum_all()?;
        total = (total + l1.affine(unmatched_weight, 0.0)?)?;
    }
    let n = normalizer.unwrap_or(chunks.len() as f64);
    let loss = total.affine(temperature * temperature / n, 0.0)?;
    let teacher_mass = Tensor::new(teacher_mass, &dev)?;
    let figures = KdFigures::pending(&loss, &[&teacher_mass], chunks.len() as f64)?;
    Ok((loss, figures))
}

/// Gold's matched-chunk rule, shared by the top-k and whole-distribution forms: one student and
/// one teacher position, and the student's target maps exactly (a one-hot W row) to the
/// teacher's target.
pub fn gold_matched(
    proj: &Projection,
    one_to_one: bool,
    student_target: u32,
    teacher_target: u32,
) -> bool {
    one_to_one && proj.exact_teacher(student_target as usize) == Some(teacher_target)
}

/// Counts of (matched, unmatched) chunks the gold loss uses (for logs and tests).
pub fn gold_split(batch: &XTokenBatch, proj: &Projection) -> Result<(usize, usize)> {
    let (b, ts, tt) = (batch.batch, batch.student_len, batch.teacher_len);
    batch.check_topk()?;
    batch.check_len("student_targets", &batch.student_targets, b * ts)?;
    batch.check_len("teacher_targets", &batch.teacher_targets, b * tt)?;
    let chunks = batch.chunks()?;
    let mut matched = 0;
    for c in &chunks {
        let (t, a) = (c.student[0], c.teacher[0]);
        let s_tok = batch.student_targets[c.b * ts + t];
        let u_tok = batch.teacher_targets[c.b * tt + a];
        let (ids, _) = batch.topk_row(c.b, a, proj.teacher_vocab())?;
        let one_to_one = c.student.len() == 1 && c.teacher.len() == 1;
        if gold_matched(proj, one_to_one, s_tok, u_tok)
            && ids
                .iter()
                .any(|&u| proj.exact_student(u as usize).is_some())
        {
            matched += 1;
        }
    }
    Ok((matched, chunks.len() - matched))
}

#[cfg(test)]
pub(crate) mod tests;
