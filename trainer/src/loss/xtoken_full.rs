//! Cross-tokenizer losses over the teacher's **whole** distribution (issue 32): the `first_kl`,
//! P-KL and gold of [`super::xtoken`] with the teacher's top-k replaced by its full log-softmax
//! at each chunk's anchor (from its hidden states and head, [`super::full_vocab`]). Pure tensor
//! math: the caller gathers the chunks' rows on both sides. P-KL and gold follow `first_kl`.
//!
//! Per chunk `c`, with `f(u)` the first student token of teacher token `u`'s re-tokenisation
//! ([`Projection::teacher_first`]) and `G = {f(u)}` the student tokens that start some teacher
//! token:
//!
//! ```text
//! P(g) = Σ_{u : f(u) = g} p_T(u)          over every teacher id u (no top-k set)
//! T    = Σ_{u : f(u) = ∅} p_T(u)          teacher mass no student token starts (floored at 1e-6)
//! S    = Σ_{g ∈ G} p_S(g),  p_S = softmax(z_S / τ)   (the student's mass inside G)
//! D_c  = Σ_g P(g) (ln P(g) − ln p_S(g)) + T (ln T − ln(1 − S))      (1 − S floored at 1e-6)
//! loss = τ² Σ_c D_c / N
//! ```
//!
//! This is exactly `first_kl` with `k` = the teacher's vocabulary (every teacher id in the
//! "top-k", the tail bucket holding only unspellable tokens), which the tests check, so the two
//! transports train the same objective where the top-k one is exact. The gradient is candle's
//! autograd through the student's log-softmax: `[C, V_s]` per call, so callers pass chunks of
//! rows (a head piece's chunks).

use std::sync::Arc;

use candle_core::{DType, Tensor, D};
use rayon::prelude::*;
use xdistill_kernels::SparseColumns;

use super::full_vocab::{teacher_log_softmax_chunk, TeacherHead};
use super::stable::{log1mexp, log_softmax_last, TAIL_FLOOR};
use super::topk::descending_order;
use super::xtoken::gold_matched;
use super::{
    compute_dtype, Anchor, KdFigures, KdMetrics, LossError, Normalizer, Projection, Result,
    TailMode, Temperature, XTokenBatch,
};

/// The row count of `student_logits`, which must be `[rows, V]` with `V ≥` the student
/// vocabulary `vs` (padded head columns past it are ignored by every loss here).
fn student_rows(student_logits: &Tensor, vs: usize) -> Result<usize> {
    match *student_logits.dims() {
        [rows, v] if v >= vs => Ok(rows),
        [_, v] => Err(LossError::input(
            "student_logits",
            format!("{v} columns for a student vocabulary of {vs}"),
        )),
        ref d => Err(LossError::input(
            "student_logits",
            format!("must be [rows, V], got {d:?}"),
        )),
    }
}

/// First-token KL of the student rows `student_logits [C, V]` (`V ≥` the projection's student
/// vocabulary; padded columns are ignored) against the teacher's full log-probs
/// `teacher_logprobs [C, V_t]` (`log_softmax(z_T / τ)` at each chunk's anchor, `V_t` the
/// projection's teacher vocabulary; no gradient), divided by `normalizer` (else C).
pub fn first_kl_full(
    student_logits: &Tensor,
    teacher_logprobs: &Tensor,
    proj: &Projection,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let temperature = temperature.get();
    let normalizer = normalizer.map(Normalizer::get);
    let (vs, vt) = (proj.student_vocab(), proj.teacher_vocab());
    let c = student_rows(student_logits, vs)?;
    if teacher_logprobs.dims() != [c, vt] {
        return Err(LossError::input(
            "teacher_logprobs",
            format!(
                "must be [{c}, {vt}] (one row per chunk, the teacher's whole vocabulary), got {:?}",
                teacher_logprobs.dims()
            ),
        ));
    }
    if !proj.has_teacher_first() {
        return Err(LossError::input(
            "projection",
            "first_kl needs the teacher → student first-token map (Projection::with_teacher_first)",
        ));
    }
    let dt = compute_dtype(student_logits);
    let dev = student_logits.device().clone();
    if c == 0 {
        let zero = Tensor::zeros((), dt, &dev)?;
        return Ok((zero, KdMetrics::default().into()));
    }

    // 1. Host: G (the student tokens that start some teacher token) in order of first use, the
    //    column in G of each teacher id that has a first student token, the ids that have none.
    let mut col_of = vec![u32::MAX; vs];
    let (mut g_ids, mut mapped_u, mut mapped_col, mut unmapped_u) =
        (vec![], vec![], vec![], vec![]);
    for u in 0..vt {
        match proj.teacher_first(u) {
            Some(g) => {
                let col = &mut col_of[g as usize];
                if *col == u32::MAX {
                    *col = g_ids.len() as u32;
                    g_ids.push(g);
                }
                mapped_u.push(u as u32);
                mapped_col.push(*col);
            }
            None => unmapped_u.push(u as u32),
        }
    }
    let m = g_ids.len();

    // 2. Teacher side (constant): P [C, |G|] grouped by first token, the tail T [C].
    let pt = teacher_logprobs.detach().to_dtype(dt)?.exp()?; // [C, V_t]
    let p = if mapped_u.is_empty() {
        Tensor::zeros((c, 0), dt, &dev)?
    } else {
        let n = mapped_u.len();
        let src = pt.index_select(&Tensor::from_vec(mapped_u, n, &dev)?, 1)?;
        Tensor::zeros((c, m), dt, &dev)?.index_add(
            &Tensor::from_vec(mapped_col, n, &dev)?,
            &src,
            1,
        )?
    };
    let tail = if unmapped_u.is_empty() {
        Tensor::zeros(c, dt, &dev)?
    } else {
        let n = unmapped_u.len();
        pt.index_select(&Tensor::from_vec(unmapped_u, n, &dev)?, 1)?
            .sum(D::Minus1)?
    };
    let tail = tail.maximum(TAIL_FLOOR)?;
    // Σ P ln P + T ln T, with 0 ln 0 = 0 (P is 0 exactly where no teacher id maps).
    let tiny = if dt == DType::F64 { 1e-300 } else { 1e-30 };
    let constant = ((&p * p.maximum(tiny)?.log()?)?.sum(D::Minus1)? + (&tail * tail.log()?)?)?; // [C]

    // 3. Student side: ln p_S at G only ([C, |G|]: no [C, V_s] log-softmax on the CPU), the
    //    mass outside G.
    let z = student_logits.narrow(1, 0, vs)?.to_dtype(dt)?;
    let z = if temperature == 1.0 {
        z
    } else {
        z.affine(1.0 / temperature, 0.0)?
    };
    let ids = Tensor::from_vec(g_ids.repeat(c), (c, m), &dev)?;
    let ls = xdistill_kernels::gather_log_softmax(&z, &ids)?; // [C, |G|]
    let s_in = ls.exp()?.sum(D::Minus1)?; // [C]
    let ls_tail = log1mexp(&s_in.log()?, TAIL_FLOOR)?;
    let cross = ((&p * &ls)?.sum(D::Minus1)? + (&tail * ls_tail)?)?; // [C]

    let n = normalizer.unwrap_or(c as f64);
    let inv = if n > 0.0 { 1.0 / n } else { 0.0 };
    let loss = (constant - cross)?
        .sum_all()?
        .affine(temperature * temperature * inv, 0.0)?;
    let figures = KdFigures::pending(&loss, &[&p.sum_all()?, &s_in.sum_all()?], c as f64)?;
    Ok((loss, figures))
}

/// `Q_c + Q_EPS` keeps `log Q` finite where no student token spells a teacher token (as the
/// top-k P-KL does).
const Q_EPS: f64 = 1e-10;

/// Chunk-level projected KL (NeMo's P-KL) over the teacher's whole vocabulary.
///
/// `student_logits [N, V]`: every student position of the chunks (`V ≥` the projection's
/// student vocabulary), `chunk_of_row[i]` the chunk of row `i` (`0..C`, every chunk with at
/// least one row); `teacher_logprobs [C, V_t]`: `log_softmax(z_T / τ)` at each chunk's anchor
/// (no gradient). With `q_t = Wᵀ softmax(z_S,t / τ)` over all `V_t` teacher ids and
/// `Q_c = mean_{t ∈ c} q_t + 1e-10`:
///
/// - `Renormalize` (NeMo's): `D_c = Σ_u p_T(u) (lp_T(u) − ln Q̂_c(u))`, `Q̂ = Q / Σ Q`;
/// - `Ignore`: the same with `Q` itself;
/// - `Bucket`: `Ignore`'s sum plus `T (ln T − ln(1 − Σ Q))` for the teacher mass `T = 1 − Σ p_T`
///   left over (≈ 0 over the whole vocabulary; both floored at 1e-6), as the top-k form;
///
/// `loss = τ² Σ_c D_c / N`. This is [`super::pkl_loss`] with every teacher id in K.
#[allow(clippy::too_many_arguments)]
pub fn pkl_full(
    student_logits: &Tensor,
    chunk_of_row: &[u32],
    teacher_logprobs: &Tensor,
    proj: &Projection,
    tail: TailMode,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let temperature = temperature.get();
    let normalizer = normalizer.map(Normalizer::get);
    let (vs, vt) = (proj.student_vocab(), proj.teacher_vocab());
    let n = student_rows(student_logits, vs)?;
    if chunk_of_row.len() != n {
        return Err(LossError::input(
            "chunk_of_row",
            format!("{} chunk ids for {n} student rows", chunk_of_row.len()),
        ));
    }
    let c = teacher_logprobs.dim(0)?;
    if teacher_logprobs.dims() != [c, vt] {
        return Err(LossError::input(
            "teacher_logprobs",
            format!("must be [C, {vt}], got {:?}", teacher_logprobs.dims()),
        ));
    }
    let mut rows_per_chunk = vec![0usize; c];
    for &k in chunk_of_row {
        match rows_per_chunk.get_mut(k as usize) {
            Some(r) => *r += 1,
            None => {
                return Err(LossError::input(
                    "chunk_of_row",
                    format!("chunk {k} of {c} chunks"),
                ))
            }
        }
    }
    if let Some(e) = rows_per_chunk.iter().position(|&r| r == 0) {
        return Err(LossError::input(
            "chunk_of_row",
            format!("chunk {e} has no student row"),
        ));
    }
    let dt = compute_dtype(student_logits);
    let dev = student_logits.device().clone();
    if c == 0 {
        return Ok((Tensor::zeros((), dt, &dev)?, KdMetrics::default().into()));
    }

    // 1. W by teacher id (CSC) over the student ids U with a non-empty row, each entry's
    //    student id as its column in U.
    let mut col_of = vec![u32::MAX; vs];
    let mut u_ids = vec![];
    for (s_id, col) in col_of.iter_mut().enumerate() {
        if !proj.row(s_id).0.is_empty() {
            *col = u_ids.len() as u32;
            u_ids.push(s_id as u32);
        }
    }
    let (mut ptr, mut rows, mut wts) = (Vec::with_capacity(vt + 1), vec![], vec![]);
    ptr.push(0);
    for u in 0..vt {
        let (students, weights) = proj.column(u);
        rows.extend(students.iter().map(|&s| col_of[s as usize]));
        wts.extend_from_slice(weights);
        ptr.push(rows.len());
    }

    // 2. The chunks' mean student distribution P̄ [C, |U|] (rows weighted 1/|c|, added per chunk),
    //    p_S gathered at U only (no [N, V_s] softmax on the CPU); Q = P̄ W over every teacher id.
    let q = if rows.is_empty() {
        Tensor::zeros((c, vt), dt, &dev)?
    } else {
        let z = student_logits.narrow(1, 0, vs)?.to_dtype(dt)?;
        let z = if temperature == 1.0 {
            z
        } else {
            z.affine(1.0 / temperature, 0.0)?
        };
        let m = u_ids.len();
        let w_proj = Arc::new(SparseColumns::new(m, ptr, rows, wts)?);
        let ids = Tensor::from_vec(u_ids.repeat(n), (n, m), &dev)?;
        let p = xdistill_kernels::gather_log_softmax(&z, &ids)?.exp()?; // [N, |U|]
        let w: Vec<f64> = chunk_of_row
            .iter()
            .map(|&k| 1.0 / rows_per_chunk[k as usize] as f64)
            .collect();
        let w = Tensor::from_vec(w, (n, 1), &dev)?.to_dtype(dt)?;
        let rows = Tensor::from_vec(chunk_of_row.to_vec(), n, &dev)?;
        let mean = Tensor::zeros((c, m), dt, &dev)?.index_add(&rows, &p.broadcast_mul(&w)?, 0)?;
        xdistill_kernels::sparse_matmul(&mean, &w_proj)? // [C, V_t]
    };
    let q = q.affine(1.0, Q_EPS)?;
    let q_mass = q.sum_keepdim(D::Minus1)?; // [C, 1]
    let log_q = match tail {
        TailMode::Renormalize => q.broadcast_div(&q_mass)?.log()?,
        TailMode::Bucket | TailMode::Ignore => q.log()?,
    };

    // 3. Σ_u p_T (lp_T − ln Q) per chunk (+ the tail entry), τ² / N.
    let l = teacher_logprobs.detach().to_dtype(dt)?;
    let mut per_chunk = (l.exp()? * (&l - log_q)?)?.sum(D::Minus1)?;
    if tail == TailMode::Bucket {
        let lt_tail = log1mexp(&super::stable::logsumexp_last(&l)?, TAIL_FLOOR)?;
        let ls_tail = log1mexp(&q_mass.log()?.squeeze(D::Minus1)?, TAIL_FLOOR)?;
        per_chunk = (per_chunk + (lt_tail.exp()? * (&lt_tail - ls_tail)?)?)?;
    }
    let nrm = normalizer.unwrap_or(c as f64);
    let inv = if nrm > 0.0 { 1.0 / nrm } else { 0.0 };
    let loss = per_chunk
        .sum_all()?
        .affine(temperature * temperature * inv, 0.0)?;
    let figures = KdFigures::pending(
        &loss,
        &[&l.exp()?.sum_all()?, &q_mass.detach().sum_all()?],
        c as f64,
    )?;
    Ok((loss, figures))
}

/// The gold hybrid ([`super::gold_loss`]) over the teacher's whole distribution.
///
/// `student_logits [C, V]`: each chunk's first student position (`V ≥` the projection's student
/// vocabulary; padded columns are ignored); `teacher_logprobs [C, V_t]`: `log_softmax(z_T / τ)`
/// at its first teacher position (no gradient); `matched[c]`: chunk `c` has one position on each
/// side and the student's target maps exactly to the teacher's
/// ([`super::xtoken::gold_matched`]). With K' = every teacher id with an exact student
/// counterpart:
///
/// - matched (K' non-empty): `KL(T' ‖ S')` over K', both sides renormalised over K';
/// - unmatched: ULD, `Σ_r |p_T↓(r) − p_S↓(r)|` over both whole distributions sorted
///   descending, the shorter padded with zeros (`max(V_s, V_t)` ranks);
///
/// `loss = τ² (matched_weight Σ KL + unmatched_weight Σ L1) / N`. Equal to
/// [`super::gold_loss`] with `k = V_t` when `V_s = V_t`; with more student ids, ULD here also
/// counts the student's mass past rank `V_t`. The sort runs on the host (candle's CUDA arg-sort
/// stops at 8,192 columns) and its permutation is gathered on the device, so the gradient flows
/// through the sorted values as in the top-k form.
#[allow(clippy::too_many_arguments)]
pub fn gold_full(
    student_logits: &Tensor,
    teacher_logprobs: &Tensor,
    matched: &[bool],
    proj: &Projection,
    matched_weight: f64,
    unmatched_weight: f64,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let temperature = temperature.get();
    let normalizer = normalizer.map(Normalizer::get);
    let (vs, vt) = (proj.student_vocab(), proj.teacher_vocab());
    let c = student_rows(student_logits, vs)?;
    if teacher_logprobs.dims() != [c, vt] || matched.len() != c {
        return Err(LossError::input(
            "teacher_logprobs",
            format!(
                "must be [{c}, {vt}] with {c} matched flags (one per chunk), got {:?} and {}",
                teacher_logprobs.dims(),
                matched.len()
            ),
        ));
    }
    let dt = compute_dtype(student_logits);
    let dev = student_logits.device().clone();
    let mut total = Tensor::zeros((), dt, &dev)?;
    if c == 0 {
        return Ok((total, KdMetrics::default().into()));
    }
    // K' as (teacher id, its student counterpart); empty K' leaves every chunk unmatched.
    let (kt, ks): (Vec<u32>, Vec<u32>) = (0..vt)
        .filter_map(|u| proj.exact_student(u).map(|s| (u as u32, s)))
        .unzip();
    let is_matched = |i: usize| matched[i] && !kt.is_empty();
    let (m_rows, u_rows): (Vec<u32>, Vec<u32>) = {
        let (m, u): (Vec<usize>, Vec<usize>) = (0..c).partition(|&i| is_matched(i));
        (
            m.into_iter().map(|i| i as u32).collect(),
            u.into_iter().map(|i| i as u32).collect(),
        )
    };
    let z = student_logits
        .narrow(1, 0, vs)?
        .to_dtype(dt)?
        .affine(1.0 / temperature, 0.0)?; // [C, V_s]
    let lt = teacher_logprobs.detach().to_dtype(dt)?; // [C, V_t]
    let rows_of = |t: &Tensor, rows: &[u32]| -> Result<Tensor> {
        Ok(t.index_select(&Tensor::from_vec(rows.to_vec(), rows.len(), &dev)?, 0)?)
    };

    // 1. Matched: KL(T' ‖ S') over K', both sides renormalised there.
    if !m_rows.is_empty() {
        let n = kt.len();
        let ls = log_softmax_last(
            &rows_of(&z, &m_rows)?.index_select(&Tensor::from_vec(ks, n, &dev)?, 1)?,
        )?;
        let l = log_softmax_last(
            &rows_of(&lt, &m_rows)?.index_select(&Tensor::from_vec(kt, n, &dev)?, 1)?,
        )?;
        let kl = (l.exp()? * (&l - ls)?)?.sum_all()?;
        total = (total + kl.affine(matched_weight, 0.0)?)?;
    }
    // 2. Unmatched: L1 between both sorted distributions over the first r = min(V_s, V_t)
    //    ranks, plus the longer side's mass past them (the teacher's is a constant).
    if !u_rows.is_empty() {
        let n_u = u_rows.len();
        let r = vs.min(vt);
        let p = super::stable::softmax_last(&rows_of(&z, &u_rows)?)?; // [n_u, V_s]
        let order = descending_order(&p.detach())?
            .narrow(1, 0, r)?
            .contiguous()?;
        let ps = p.gather(&order, 1)?; // [n_u, r]: the student's r largest, descending
        let (mut pt, mut teacher_past) = (Vec::with_capacity(n_u * r), 0.0);
        for row in descending_probs(&rows_of(&lt, &u_rows)?)?.chunks(vt) {
            pt.extend_from_slice(&row[..r]);
            teacher_past += row[r..].iter().sum::<f64>();
        }
        let pt = Tensor::from_vec(pt, (n_u, r), &dev)?.to_dtype(dt)?;
        let mut l1 = (pt - &ps)?.abs()?.sum_all()?;
        if vs > r {
            // The student's mass past rank r, Σ_rows (1 − Σ ps): as a function of the logits
            // the same as summing that tail, without gathering it.
            l1 = (l1 + ps.sum_all()?.affine(-1.0, n_u as f64)?)?;
        }
        total = (total + l1.affine(unmatched_weight, unmatched_weight * teacher_past)?)?;
    }
    let nrm = normalizer.unwrap_or(c as f64);
    let inv = if nrm > 0.0 { 1.0 / nrm } else { 0.0 };
    let loss = total.affine(temperature * temperature * inv, 0.0)?;
    let figures = KdFigures::pending(&loss, &[], c as f64)?;
    Ok((loss, figures))
}

/// `exp` of each row of log-probs `[N, V]`, sorted descending, on the host in f64, row-major.
fn descending_probs(logprobs: &Tensor) -> Result<Vec<f64>> {
    let (_, v) = logprobs.dims2()?;
    let mut host: Vec<f64> = logprobs
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .into_iter()
        .map(f64::exp)
        .collect();
    if v > 0 {
        host.par_chunks_mut(v)
            .for_each(|row| row.sort_unstable_by(|a, b| b.total_cmp(a)));
    }
    Ok(host)
}

/// The teacher's final hidden states, read at a (batch row, teacher position) of a chunk batch:
/// where the full-vocabulary chunk losses find the teacher at each chunk's anchor.
pub trait TeacherStates {
    /// Appends the `[H]` hidden state at teacher position `pos` of batch row `row` to `out`.
    fn append_row(&self, row: usize, pos: usize, out: &mut Vec<f32>) -> Result<()>;
}

/// Cross-tokenizer inputs over the teacher's whole distribution: the aligned chunks, the
/// projection, the teacher's head and where its hidden states are read.
#[derive(Clone, Copy)]
pub struct XTokenFull<'a> {
    pub batch: &'a XTokenBatch,
    pub projection: &'a Projection,
    pub head: &'a TeacherHead,
    pub states: &'a dyn TeacherStates,
}

impl std::fmt::Debug for XTokenFull<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XTokenFull")
            .field("batch", &(self.batch.batch, self.batch.student_len))
            .field("teacher_vocab", &self.head.vocab())
            .finish_non_exhaustive()
    }
}

/// Which whole-distribution chunk loss [`chunk_loss`] computes (chosen by [`super::kd_loss`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FullChunkLoss {
    FirstKl,
    Pkl {
        anchor: Anchor,
        tail: TailMode,
    },
    Gold {
        matched_weight: f64,
        unmatched_weight: f64,
    },
}

/// One aligned chunk of a (sub-)batch: its row, its student positions (in order) and its first
/// and last teacher positions.
#[derive(Debug, Clone)]
struct ChunkSpan {
    row: usize,
    student: Vec<usize>,
    teacher: (usize, usize),
}

/// The chunks of `x` with both sides non-empty, in row and chunk order.
fn chunk_spans(x: &XTokenBatch) -> Vec<ChunkSpan> {
    let (ts, tt) = (x.student_len, x.teacher_len);
    let mut out = vec![];
    for row in 0..x.batch {
        let n = x.num_chunks[row];
        let mut student: Vec<Vec<usize>> = vec![vec![]; n];
        let mut teacher: Vec<Option<(usize, usize)>> = vec![None; n];
        for p in 0..ts {
            if let Ok(c) = usize::try_from(x.student_chunk[row * ts + p]) {
                student[c].push(p);
            }
        }
        for p in 0..tt {
            if let Ok(c) = usize::try_from(x.teacher_chunk[row * tt + p]) {
                let e = teacher[c].get_or_insert((p, p));
                e.1 = p;
            }
        }
        for (s, t) in student.into_iter().zip(teacher) {
            if let (false, Some(teacher)) = (s.is_empty(), t) {
                out.push(ChunkSpan {
                    row,
                    student: s,
                    teacher,
                });
            }
        }
    }
    out
}

/// Gold's matched flag of each chunk ([`gold_matched`]): one position on each side, the
/// student's target mapping exactly to the teacher's.
fn gold_flags(x: &XTokenBatch, chunks: &[ChunkSpan], proj: &Projection) -> Vec<bool> {
    let (ts, tt) = (x.student_len, x.teacher_len);
    chunks
        .iter()
        .map(|c| {
            let one_to_one = c.student.len() == 1 && c.teacher.0 == c.teacher.1;
            let s = x.student_targets[c.row * ts + c.student[0]];
            let u = x.teacher_targets[c.row * tt + c.teacher.0];
            gold_matched(proj, one_to_one, s, u)
        })
        .collect()
}

/// The teacher's log-probs `[C, V_t]` at each chunk's anchor teacher position `at(c)`, its head
/// applied to the hidden states there, in the student logits' compute dtype.
fn anchor_log_probs(
    x: &XTokenFull,
    logits: &Tensor,
    chunks: &[ChunkSpan],
    at: impl Fn(&ChunkSpan) -> usize,
    temperature: Temperature,
) -> Result<Tensor> {
    let dt = compute_dtype(logits);
    let n = chunks.len();
    if n == 0 {
        return Ok(Tensor::zeros((0, x.head.vocab()), dt, logits.device())?);
    }
    let hsz = x.head.hidden_size();
    let mut hid = Vec::with_capacity(n * hsz);
    for c in chunks {
        x.states.append_row(c.row, at(c), &mut hid)?;
    }
    let hidden = Tensor::from_vec(hid, (n, hsz), logits.device())?.to_dtype(dt)?;
    teacher_log_softmax_chunk(x.head, &hidden, temperature)
}

/// The whole-distribution chunk loss `form` of `logits [nb, sl, V]` (the student rows of
/// `x.batch`) against the teacher's full log-softmax at each chunk's anchor: `first_kl` and gold
/// read each chunk's first student row, P-KL all of them. Divided by `normalizer` (else the
/// chunk count).
pub fn chunk_loss(
    logits: &Tensor,
    x: XTokenFull,
    form: FullChunkLoss,
    temperature: Temperature,
    normalizer: Option<Normalizer>,
) -> Result<(Tensor, KdFigures)> {
    let chunks = chunk_spans(x.batch);
    let (nb, sl, v) = logits.dims3()?;
    let pkl = matches!(form, FullChunkLoss::Pkl { .. });
    // The student rows the loss reads, and (P-KL) the chunk of each.
    let (rows, chunk_of_row): (Vec<u32>, Vec<u32>) = if pkl {
        chunks
            .iter()
            .enumerate()
            .flat_map(|(i, c)| {
                c.student
                    .iter()
                    .map(move |&p| ((c.row * sl + p) as u32, i as u32))
            })
            .unzip()
    } else {
        chunks
            .iter()
            .map(|c| ((c.row * sl + c.student[0]) as u32, 0))
            .unzip()
    };
    let last = matches!(
        form,
        FullChunkLoss::Pkl {
            anchor: Anchor::Last,
            ..
        }
    );
    let at = |c: &ChunkSpan| if last { c.teacher.1 } else { c.teacher.0 };
    let teacher = anchor_log_probs(&x, logits, &chunks, at, temperature)?;
    let n = rows.len();
    let idx = Tensor::from_vec(rows, n, logits.device())?;
    let student = logits.reshape((nb * sl, v))?.index_select(&idx, 0)?; // [N, V]
    match form {
        FullChunkLoss::FirstKl => {
            first_kl_full(&student, &teacher, x.projection, temperature, normalizer)
        }
        FullChunkLoss::Pkl { tail, .. } => pkl_full(
            &student,
            &chunk_of_row,
            &teacher,
            x.projection,
            tail,
            temperature,
            normalizer,
        ),
        FullChunkLoss::Gold {
            matched_weight,
            unmatched_weight,
        } => {
            let matched = gold_flags(x.batch, &chunks, x.projection);
            gold_full(
                &student,
                &teacher,
                &matched,
                x.projection,
                matched_weight,
                unmatched_weight,
                temperature,
                normalizer,
            )
        }
    }
}

#[cfg(test)]
mod tests;
