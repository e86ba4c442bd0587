//! Scores of logit rows on the host — the teacher's host scoring path: per-position top-k,
//! target log-prob, logsumexp, candidate log-probs and ranks, folded in a vocabulary tile at a
//! time as the fused LM head produces them ([`RowFolds`]; with AVX2 or AVX-512 the head kernel in `fused_head`
//! makes and folds the tiles itself) or from whole rows ([`score_rows`]). `xdistill_shared::topk`
//! is the device path; both answer the same [`RowQuery`].
//!
//! It lives here, not in the server, because it is the teacher's hot loop: this crate is
//! compiled optimised in every profile (the workspace's `[profile.dev.package]`), so the
//! teachers that tests start score at full speed.

mod fused_head;

use crate::simd::{self, Simd};
use crate::simd_dispatch;
pub use fused_head::HeadTiming;
use rayon::prelude::*;
use std::cmp::Ordering;

/// What a row's top-k values are. Its wire form is its name (`"logprobs"`, `"logits"`): the
/// protocol's `values` field (`xdistill_shared::protocol` re-exports it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ValuesKind {
    /// `log_softmax(logits / temperature)` over the full (unpadded) vocabulary.
    #[default]
    Logprobs,
    /// `logits / temperature`.
    Logits,
}

impl ValuesKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ValuesKind::Logprobs => "logprobs",
            ValuesKind::Logits => "logits",
        }
    }
}

/// Deserialised from its name only: a string, never a variant index (MessagePack could
/// otherwise give one) or bytes.
impl<'de> serde::Deserialize<'de> for ValuesKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = ValuesKind;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ValuesKind, E> {
                match s {
                    "logprobs" => Ok(ValuesKind::Logprobs),
                    "logits" => Ok(ValuesKind::Logits),
                    other => Err(E::unknown_variant(other, &["logprobs", "logits"])),
                }
            }
        }
        d.deserialize_any(Name)
    }
}

/// What to compute for each row (the host folds here and the device top-k of
/// `xdistill_shared::topk` answer the same query).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowQuery {
    /// Top entries per row (0: none, only the target log-prob and logsumexp).
    pub k: usize,
    /// Logits are divided by it (> 0).
    pub temperature: f32,
    /// Real tokens: the first `valid` columns (the rest is LM-head padding).
    pub valid: usize,
    pub values: ValuesKind,
    /// Also count each target's 1-based rank over the valid vocabulary (ties ranked last).
    pub ranks: bool,
}

impl RowQuery {
    /// Top `k` of the first `valid` columns at `temperature`, as `values`; no ranks.
    pub fn new(k: usize, temperature: f32, values: ValuesKind, valid: usize) -> RowQuery {
        RowQuery {
            k,
            temperature,
            valid,
            values,
            ranks: false,
        }
    }
}

/// The scores of a run of rows (`xdistill_shared::protocol::SequenceScores` takes its fields).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RowScores {
    pub rows: usize,
    pub k: usize,
    /// `[rows, k]`, best first (ties by ascending id).
    pub topk_ids: Vec<u32>,
    /// `[rows, k]`: log-probs or scaled logits, as asked.
    pub topk_values: Vec<f32>,
    /// `[rows]`.
    pub target_logprobs: Vec<f32>,
    /// `[rows]`: logsumexp of `logits / temperature` over the valid vocabulary.
    pub logsumexp: Vec<f32>,
    /// Candidate ids per row (0 when none were asked for).
    pub m: usize,
    /// `[rows, m]`: log-probs at the candidate ids.
    pub ids_logprobs: Vec<f32>,
    /// `[rows]` when ranks were asked for, else empty: each target's 1-based rank over the valid
    /// vocabulary (ties ranked last).
    pub target_ranks: Vec<u32>,
}

impl RowScores {
    /// Row `r` of the top-k ids, `[k]`.
    pub fn ids_row(&self, r: usize) -> &[u32] {
        &self.topk_ids[r * self.k..(r + 1) * self.k]
    }

    /// Row `r` of the top-k values, `[k]`.
    pub fn values_row(&self, r: usize) -> &[f32] {
        &self.topk_values[r * self.k..(r + 1) * self.k]
    }

    /// Row `r` of the candidate-id log-probs, `[m]`.
    pub fn ids_logprobs_row(&self, r: usize) -> &[f32] {
        &self.ids_logprobs[r * self.m..(r + 1) * self.m]
    }

    /// Every field's length agrees with `rows`, `k` and `m`.
    #[cfg(test)]
    fn check_shapes(&self) -> Result<(), String> {
        let lens = [
            self.topk_ids.len(),
            self.topk_values.len(),
            self.target_logprobs.len(),
            self.logsumexp.len(),
            self.ids_logprobs.len(),
        ];
        let (rk, r, rm) = (self.rows * self.k, self.rows, self.rows * self.m);
        if lens != [rk, rk, r, r, rm] {
            return Err(format!(
                "rows {r} k {} m {}: lengths {lens:?}",
                self.k, self.m
            ));
        }
        Ok(())
    }
}

/// Candidate ids of a run of rows, `[rows, m]` row-major (`m = 0`: none).
#[derive(Debug, Clone, Copy, Default)]
pub struct CandidateRows<'a> {
    pub ids: &'a [u32],
    pub m: usize,
}

impl<'a> CandidateRows<'a> {
    /// Rows `r0..r1` of these candidates.
    pub fn rows(&self, r0: usize, r1: usize) -> CandidateRows<'a> {
        CandidateRows {
            ids: &self.ids[r0 * self.m..r1 * self.m],
            m: self.m,
        }
    }
}

/// Descending by value, ascending id among equal values (deterministic tie order).
#[cfg(test)]
fn desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// A top-k candidate `(logit, id)` packed so that a greater key is a better candidate: the
/// logit's total order (`f32::total_cmp`) in the high half, the id reversed in the low half (a
/// smaller id wins a tie). Selecting and sorting `u64`s is branch-free where comparing pairs
/// was not (2.6× faster per prune).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cand(u64);

impl Cand {
    fn new(x: f32, id: u32) -> Cand {
        let b = x.to_bits();
        let ordered = if b >> 31 == 1 { !b } else { b | 1 << 31 };
        Cand((ordered as u64) << 32 | !id as u64)
    }

    fn x(self) -> f32 {
        let o = (self.0 >> 32) as u32;
        f32::from_bits(if o >> 31 == 1 { o & !(1 << 31) } else { !o })
    }

    fn id(self) -> u32 {
        !(self.0 as u32)
    }
}

/// Best first.
fn best_first(a: &Cand, b: &Cand) -> Ordering {
    b.cmp(a)
}

/// Elements per block (`simd::sum_exp2` calls): small enough to stay in L1 between the passes
/// over it, and each f32 lane adds 128 terms.
const BLOCK: usize = 2048;
/// Elements per segment of the candidate scan.
const SEGMENT: usize = 64;

/// The per-pass constants of [`RowFolds`], derived once from the request.
#[derive(Debug, Clone, Copy)]
struct FoldParams {
    /// Top entries kept: `p.k` capped at the valid vocabulary.
    k: usize,
    /// Candidates are pruned back to k whenever a row's buffer reaches this size.
    prune_at: usize,
    inv_t: f64,
    /// `log2(e) / τ`: scales `x - max` for [`exp2_nonpos`].
    scale2: f32,
}

/// One row's running scores while its logits arrive a block at a time, in column order.
#[derive(Debug, Clone)]
struct RowFold {
    /// Online logsumexp: the running max and `Σ e^{(x - m)/τ}` relative to it.
    m: f32,
    sum: f64,
    /// The k-th best value seen so far once `buf` was first pruned (+inf with k = 0, so that
    /// nothing enters; a later equal value loses the tie to the earlier, smaller id, so it may
    /// be skipped).
    thr: f32,
    /// Top-k candidates above `thr`.
    buf: Vec<Cand>,
    /// The target's logit, once its column was seen (`None` for an id past the valid columns).
    target: Option<f32>,
    /// `[m]` logits of the row's candidate ids, once seen (-inf until then).
    cands: Vec<f32>,
    /// Logits ≥ the target's, counted by the LM-head kernel when ranks are asked for.
    ge: u32,
}

impl RowFold {
    /// Keeps the best `k` candidates (`k ≥ 1`, in no particular order).
    fn prune(&mut self, k: usize) {
        if self.buf.len() > k {
            self.buf.select_nth_unstable_by(k - 1, best_first);
            self.buf.truncate(k);
        }
    }

    /// Adds a candidate above the threshold; once `prune_at` are held, keeps the best k and
    /// raises the threshold to the k-th (returns true then).
    #[inline]
    fn push_candidate(&mut self, x: f32, id: u32, fp: &FoldParams) -> bool {
        self.buf.push(Cand::new(x, id));
        if self.buf.len() < fp.prune_at {
            return false;
        }
        self.prune(fp.k);
        self.thr = self.buf[fp.k - 1].x();
        true
    }

    /// The exact k-th best value among the candidates (the threshold when there are fewer).
    /// Keeps only the best k (those below can no longer enter) and raises the threshold to it,
    /// so that the next call selects among k plus the newcomers.
    fn kth_best(&mut self, k: usize) -> f32 {
        if k == 0 || self.buf.len() < k {
            return self.thr;
        }
        self.buf.select_nth_unstable_by(k - 1, best_first);
        self.buf.truncate(k);
        self.thr = self.thr.max(self.buf[k - 1].x());
        self.buf[k - 1].x()
    }

    /// Adds the scores of another run of the same row's columns (disjoint from this one's).
    fn merge(&mut self, o: RowFold, fp: &FoldParams) {
        let m = self.m.max(o.m);
        // Relative to the common max; a zero sum stays zero (its max may be -inf), a NaN stays.
        let rescale = |mi: f32, s: f64| {
            if s == 0.0 {
                0.0
            } else {
                s * ((mi as f64 - m as f64) * fp.inv_t).exp()
            }
        };
        self.sum = rescale(self.m, self.sum) + rescale(o.m, o.sum);
        self.m = m;
        // Either threshold bounds the k-th best from below: a candidate under it cannot enter
        // (one equal to it may, by a smaller id). Pruning raises it for the next merge.
        self.thr = self.thr.max(o.thr);
        let thr = self.thr;
        self.buf.extend(o.buf.into_iter().filter(|c| c.x() >= thr));
        if self.buf.len() >= fp.prune_at {
            self.prune(fp.k);
            self.thr = self.buf[fp.k - 1].x();
        }
        self.target = self.target.or(o.target);
        for (a, b) in self.cands.iter_mut().zip(o.cands) {
            if b != f32::NEG_INFINITY {
                *a = b;
            }
        }
        self.ge += o.ge;
    }
}

// `fold_at(level, …)`: [`fold_body`] compiled for `level`, or for the CPU's widest level when it
// lacks `level`. Every level computes the same arithmetic in the same order (no fused
// multiply-adds, lane counts fixed at [`simd::LANES`]), so the answers are
// bit-identical whichever runs.
simd_dispatch!(fn fold_at(st: &mut RowFold, cols: &[f32], col0: usize, fp: &FoldParams) = fold_body);

/// One pass over L1-sized blocks: the running max with a rescaled exp-sum (online
/// logsumexp), and top-k candidates above the running threshold. Segments whose (vectorised)
/// max is not above the threshold hold no candidate and are skipped.
#[inline(always)]
fn fold_body(st: &mut RowFold, cols: &[f32], col0: usize, fp: &FoldParams) {
    for (b, block) in cols.chunks(BLOCK).enumerate() {
        let bm = simd::max(block);
        if bm > st.m {
            if st.sum > 0.0 {
                st.sum *= ((st.m as f64 - bm as f64) * fp.inv_t).exp();
            }
            st.m = bm;
        }
        st.sum += simd::sum_exp2(block, st.m, fp.scale2);
        if bm <= st.thr {
            continue;
        }
        for (s, seg) in block.chunks(SEGMENT).enumerate() {
            if simd::max(seg) <= st.thr {
                continue;
            }
            let base = (col0 + b * BLOCK + s * SEGMENT) as u32;
            for (j, &x) in seg.iter().enumerate() {
                if x > st.thr {
                    st.push_candidate(x, base + j as u32, fp);
                }
            }
        }
    }
}

/// 1-based rank of the value `zt` in `row`, ties ranked last: `#{v : row[v] >= zt}` (vLLM's
/// convention for a token outside the returned top k).
pub fn rank_of(row: &[f32], zt: f32) -> u32 {
    row.iter().map(|&x| (x >= zt) as u32).sum()
}

/// Scores of a run of rows whose logits arrive a vocabulary tile at a time (the fused LM
/// head) or all at once ([`score_rows`]): each tile is folded into per-row running scores, so
/// the `[rows, V]` logits never need to exist together. Folding a row's columns in tiles of a
/// multiple of `BLOCK` columns gives the same bits as folding the whole row.
pub struct RowFolds<'a> {
    params: RowQuery,
    fp: FoldParams,
    valid: usize,
    targets: &'a [u32],
    cands: CandidateRows<'a>,
    rows: Vec<RowFold>,
    /// The first column not folded yet (tiles come in order).
    next_col: usize,
    level: Simd,
}

impl<'a> RowFolds<'a> {
    /// Columns per tile of [`RowFolds::fold`] (the last tile may be shorter): one fold block.
    pub const TILE: usize = BLOCK;

    /// Running scores of `targets.len()` rows of `width` columns (the first `q.valid` real),
    /// for logits folded in a tile at a time; `None`
    /// when ranks are asked for (a rank counts over the whole row: those rows are scored from
    /// materialised logits by [`score_rows`]).
    pub fn tiled(
        width: usize,
        targets: &'a [u32],
        cands: CandidateRows<'a>,
        p: &RowQuery,
    ) -> Option<RowFolds<'a>> {
        (!p.ranks).then(|| RowFolds::new(width, targets, cands, p))
    }

    /// Running scores of `targets.len()` rows for [`RowFolds::fold_head`] (ranks included).
    pub fn for_head(
        width: usize,
        targets: &'a [u32],
        cands: CandidateRows<'a>,
        p: &RowQuery,
    ) -> RowFolds<'a> {
        RowFolds::new(width, targets, cands, p)
    }

    /// Whether this CPU runs [`RowFolds::fold_head`] (AVX-512, or AVX2 with FMA).
    pub fn head_kernel_available() -> bool {
        fused_head::available()
    }

    /// Folds in every valid column of the logits `hidden · headᵀ`, computed here by the
    /// LM-head kernel a tile at a time (`fused_head.rs`): `hidden` `[rows, h]`, `head`
    /// `[≥ valid, h]`, row-major. Only when [`RowFolds::head_kernel_available`] and no tile
    /// was folded yet. Returns where its time went.
    pub fn fold_head(&mut self, hidden: &[f32], head: &[f32], h: usize) -> HeadTiming {
        debug_assert_eq!(self.next_col, 0, "fold_head folds every column");
        fused_head::fold_head(self, hidden, head, h)
    }

    fn new(
        width: usize,
        targets: &'a [u32],
        cands: CandidateRows<'a>,
        p: &RowQuery,
    ) -> RowFolds<'a> {
        debug_assert_eq!(cands.ids.len(), targets.len() * cands.m);
        let valid = p.valid.min(width);
        let k = p.k.min(valid);
        let inv_t = 1.0 / p.temperature as f64;
        let fp = FoldParams {
            k,
            prune_at: (4 * k).max(256),
            inv_t,
            scale2: (inv_t * std::f64::consts::LOG2_E) as f32,
        };
        let empty = RowFold {
            m: f32::NEG_INFINITY,
            sum: 0.0,
            thr: if k == 0 {
                f32::INFINITY
            } else {
                f32::NEG_INFINITY
            },
            buf: Vec::with_capacity(fp.prune_at + 1),
            target: None,
            cands: vec![f32::NEG_INFINITY; cands.m],
            ge: 0,
        };
        RowFolds {
            params: *p,
            fp,
            valid,
            targets,
            cands,
            rows: vec![empty; targets.len()],
            next_col: 0,
            level: Simd::current(),
        }
    }

    /// Folds in the logits of columns `cols` of every row: `tile` is `[rows, cols.len()]`
    /// row-major. Tiles come in column order, each starting at a multiple of
    /// [`RowFolds::TILE`]; columns past the valid vocabulary (LM-head padding) are skipped.
    pub fn fold(&mut self, tile: &[f32], cols: std::ops::Range<usize>) {
        let width = cols.len();
        debug_assert_eq!(cols.start, self.next_col, "tiles must come in column order");
        debug_assert_eq!(cols.start % BLOCK, 0, "a tile must start on a fold block");
        debug_assert_eq!(tile.len(), self.rows.len() * width);
        self.next_col = cols.end;
        let col0 = cols.start;
        let n = self.valid.saturating_sub(col0).min(width);
        if n == 0 || width == 0 {
            return;
        }
        let (fp, level, m) = (self.fp, self.level, self.cands.m);
        let cand_ids = self.cands.ids;
        let in_tile = |id: u32| (id as usize).checked_sub(col0).filter(|&j| j < n);
        self.rows
            .par_iter_mut()
            .zip(tile.par_chunks(width))
            .zip(self.targets.par_iter())
            .enumerate()
            .for_each(|(r, ((st, row), &target))| {
                let row = &row[..n];
                fold_at(level, st, row, col0, &fp);
                if let Some(j) = in_tile(target) {
                    st.target = Some(row[j]);
                }
                for (l, &c) in st.cands.iter_mut().zip(&cand_ids[r * m..(r + 1) * m]) {
                    if let Some(j) = in_tile(c) {
                        *l = row[j];
                    }
                }
            });
    }

    /// The scores, once every tile was folded.
    pub fn finish(self) -> RowScores {
        self.finish_with(None)
    }

    /// The scores; `full` ([rows, width], the whole logits) ranks targets outside the top k
    /// (without it, ranks come from the kernel's counts: tiles never ask for ranks).
    fn finish_with(self, full: Option<(&[f32], usize)>) -> RowScores {
        debug_assert!(
            self.next_col >= self.valid,
            "every valid column must be folded"
        );
        let p = self.params;
        let (rows, k, m, valid) = (self.rows.len(), p.k, self.cands.m, self.valid);
        let inv_t = self.fp.inv_t;
        // Output buffers with at least one column per row, so that `par_chunks_mut` works for
        // k = 0 / m = 0 too; the extra column is dropped below.
        let (kk, mm) = (k.max(1), m.max(1));
        let mut ids_buf = vec![0u32; rows * kk];
        let mut vals_buf = vec![0f32; rows * kk];
        let mut cand_buf = vec![0f32; rows * mm];
        let mut stats: Vec<(f32, f32, u32)> = Vec::with_capacity(rows);
        let fk = self.fp.k;
        self.rows
            .into_par_iter()
            .zip(self.targets.par_iter())
            .zip(ids_buf.par_chunks_mut(kk))
            .zip(vals_buf.par_chunks_mut(kk))
            .zip(cand_buf.par_chunks_mut(mm))
            .enumerate()
            .map(|(r, ((((mut st, &target), ids), vals), cand_lp))| {
                let lse = st.m as f64 * inv_t + st.sum.ln();
                if fk > 0 {
                    st.prune(fk);
                }
                st.buf.sort_unstable_by(best_first);
                // Values in f64 before the final rounding.
                let logprob = |x: f32| (x as f64 * inv_t - lse) as f32;
                for (j, (x, id)) in st.buf.iter().map(|c| (c.x(), c.id())).enumerate() {
                    ids[j] = id;
                    vals[j] = match p.values {
                        ValuesKind::Logprobs => logprob(x),
                        ValuesKind::Logits => (x as f64 * inv_t) as f32,
                    };
                }
                for (o, &x) in cand_lp[..m].iter_mut().zip(&st.cands) {
                    *o = logprob(x);
                }
                let rank = match (p.ranks, st.target) {
                    (false, _) => 0,
                    (true, None) => valid as u32,
                    (true, Some(zt)) => match st.buf.iter().position(|c| c.id() == target) {
                        Some(j) => j as u32 + 1,
                        // Without the whole rows, the LM-head kernel counted them.
                        None => full.map_or(st.ge, |(logits, width)| {
                            rank_of(&logits[r * width..r * width + valid], zt)
                        }),
                    },
                };
                let target_lp = st.target.map_or(f32::NEG_INFINITY, logprob);
                (target_lp, lse as f32, rank)
            })
            .collect_into_vec(&mut stats);
        if k == 0 {
            (ids_buf, vals_buf) = (Vec::new(), Vec::new());
        }
        RowScores {
            rows,
            k,
            topk_ids: ids_buf,
            topk_values: vals_buf,
            target_logprobs: stats.iter().map(|s| s.0).collect(),
            logsumexp: stats.iter().map(|s| s.1).collect(),
            m,
            ids_logprobs: if m == 0 { Vec::new() } else { cand_buf },
            target_ranks: if p.ranks {
                stats.iter().map(|s| s.2).collect()
            } else {
                Vec::new()
            },
        }
    }
}

/// Scores logit rows. `logits`: [rows, width] row-major; `targets`: \[rows\], the actual next
/// token of each row; `cands`: [rows, m] candidate ids. `p.k` must be ≤ `p.valid`.
pub fn score_rows(
    logits: &[f32],
    width: usize,
    targets: &[u32],
    cands: CandidateRows<'_>,
    p: &RowQuery,
) -> RowScores {
    score_rows_at(Simd::current(), logits, width, (targets, cands), p)
}

/// [`score_rows`] with the fold at `level`.
fn score_rows_at(
    level: Simd,
    logits: &[f32],
    width: usize,
    (targets, cands): (&[u32], CandidateRows<'_>),
    p: &RowQuery,
) -> RowScores {
    debug_assert_eq!(logits.len(), targets.len() * width);
    let mut folds = RowFolds::new(width, targets, cands, p);
    folds.level = level;
    folds.fold(logits, 0..width);
    folds.finish_with(Some((logits, width)))
}

#[cfg(test)]
mod tests;
