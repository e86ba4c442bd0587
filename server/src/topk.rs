//! Per-position top-k, target log-prob and logsumexp of logit rows on the host: folded in a
//! vocabulary tile at a time as the fused LM head produces them ([`RowFolds`]) or from whole
//! rows ([`score_rows`]); the choice between the host and the device path ([`TopkPath`]; the
//! device path itself is `worker.rs`'s `score_on_device`) and between the fused and the full LM
//! head ([`LmHead`]); and the next-token helpers built on the same row maths.

mod head;

pub use head::HeadTiming;
use rayon::prelude::*;
use std::cmp::Ordering;
use xdistill_shared::protocol::{SequenceScores, ValuesKind};
use xdistill_shared::simd::{self, Simd};
use xdistill_shared::simd_dispatch;

/// Where the scores of logit rows are computed (`--topk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TopkPath {
    /// On the model's device for a GPU, on the host for the CPU.
    #[default]
    Auto,
    /// On the model's device with tensor ops (only `[N, k]` results leave it); on the CPU this
    /// is the GPU code path run on the CPU, for checks.
    Device,
    /// Logits copied to the host, scored by [`score_rows`].
    Host,
}

impl TopkPath {
    /// Whether scoring runs on `device` (true) or on the host.
    pub fn on_device(self, device: &candle_core::Device) -> bool {
        match self {
            TopkPath::Auto => !device.is_cpu(),
            TopkPath::Device => true,
            TopkPath::Host => false,
        }
    }
}

/// How the host path turns hidden states into scores (`--lm-head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LmHead {
    /// Logits a vocabulary tile at a time, each tile folded into the rows' running scores
    /// while it is in cache: `[N, V]` is never materialised and LM-head padding columns are
    /// never computed. With AVX-512 and an f32 head the server's kernel makes and folds the
    /// tiles ([`RowFolds::fold_head`]); otherwise candle's matmul makes tiles of
    /// [`RowFolds::TILE`] columns (and requests for ranks fall back to `full`).
    #[default]
    Fused,
    /// The `[N, V]` logits of a chunk of positions, then [`score_rows`] over them.
    Full,
}

/// What a request asks for, shared by all its sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreParams {
    /// Top entries per row (0: only target log-probs and logsumexps).
    pub k: usize,
    pub temperature: f32,
    pub values: ValuesKind,
    /// Also report each target's rank over the vocabulary (vLLM's `rank`).
    pub ranks: bool,
    /// Score one row past the last token and choose the next token from it (the compatible
    /// routes' `max_tokens: 1`).
    pub next: Option<NextToken>,
}

impl ScoreParams {
    /// The native route's parameters: no ranks, no next token.
    pub fn native(k: usize, temperature: f32, values: ValuesKind) -> ScoreParams {
        ScoreParams {
            k,
            temperature,
            values,
            ranks: false,
            next: None,
        }
    }
}

/// How the token after a sequence is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NextToken {
    /// The most likely token (the lowest id among equal maxima).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, reproducible from the seed.
    Sample { seed: u64 },
}

/// Layout of logit rows: `width` columns, of which the first `valid` are real tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    pub width: usize,
    pub valid: usize,
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
/// multiple of [`BLOCK`] columns gives the same bits as folding the whole row.
pub struct RowFolds<'a> {
    params: ScoreParams,
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

    /// Running scores of `targets.len()` rows, for logits folded in a tile at a time; `None`
    /// when ranks are asked for (a rank counts over the whole row: those rows are scored from
    /// materialised logits by [`score_rows`]).
    pub fn tiled(
        layout: RowLayout,
        targets: &'a [u32],
        cands: CandidateRows<'a>,
        p: &ScoreParams,
    ) -> Option<RowFolds<'a>> {
        (!p.ranks).then(|| RowFolds::new(layout, targets, cands, p))
    }

    /// Running scores of `targets.len()` rows for [`RowFolds::fold_head`] (ranks included).
    pub fn for_head(
        layout: RowLayout,
        targets: &'a [u32],
        cands: CandidateRows<'a>,
        p: &ScoreParams,
    ) -> RowFolds<'a> {
        RowFolds::new(layout, targets, cands, p)
    }

    /// Whether this CPU runs [`RowFolds::fold_head`] (AVX-512).
    pub fn head_kernel_available() -> bool {
        head::available()
    }

    /// Folds in every valid column of the logits `hidden · headᵀ`, computed here by the
    /// AVX-512 LM-head kernel a tile at a time (`head.rs`): `hidden` `[rows, h]`, `head`
    /// `[≥ valid, h]`, row-major. Only when [`RowFolds::head_kernel_available`] and no tile
    /// was folded yet. Returns where its time went.
    pub fn fold_head(&mut self, hidden: &[f32], head: &[f32], h: usize) -> HeadTiming {
        debug_assert_eq!(self.next_col, 0, "fold_head folds every column");
        head::fold_head(self, hidden, head, h)
    }

    fn new(
        layout: RowLayout,
        targets: &'a [u32],
        cands: CandidateRows<'a>,
        p: &ScoreParams,
    ) -> RowFolds<'a> {
        debug_assert_eq!(cands.ids.len(), targets.len() * cands.m);
        let valid = layout.valid.min(layout.width);
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
    pub fn finish(self) -> SequenceScores {
        self.finish_with(None)
    }

    /// The scores; `full` ([rows, width], the whole logits) ranks targets outside the top k
    /// (without it, ranks come from the kernel's counts: tiles never ask for ranks).
    fn finish_with(self, full: Option<(&[f32], usize)>) -> SequenceScores {
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
        SequenceScores {
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
            next_token: None,
        }
    }
}

/// Scores logit rows. `logits`: [rows, width] row-major; `targets`: [rows], the actual next
/// token of each row; `cands`: [rows, m] candidate ids. `p.k` must be ≤ `layout.valid`.
pub fn score_rows(
    logits: &[f32],
    layout: RowLayout,
    targets: &[u32],
    cands: CandidateRows<'_>,
    p: &ScoreParams,
) -> SequenceScores {
    score_rows_at(Simd::current(), logits, layout, (targets, cands), p)
}

/// [`score_rows`] with the fold at `level`.
fn score_rows_at(
    level: Simd,
    logits: &[f32],
    layout: RowLayout,
    (targets, cands): (&[u32], CandidateRows<'_>),
    p: &ScoreParams,
) -> SequenceScores {
    debug_assert_eq!(logits.len(), targets.len() * layout.width);
    let mut folds = RowFolds::new(layout, targets, cands, p);
    folds.level = level;
    folds.fold(logits, 0..layout.width);
    folds.finish_with(Some((logits, layout.width)))
}

/// The first non-finite value among the scores a client receives: `(row, field)`.
///
/// Every returned value is finite for finite logits and a temperature whose scaled logits fit
/// an f32: ids are below the valid vocabulary (validation), so a log-prob is at least
/// `-(max - min) / τ - ln V`, never -inf. A non-finite value is therefore an error, never an answer.
pub fn first_non_finite(s: &SequenceScores) -> Option<(usize, &'static str)> {
    let per_row = |v: &[f32], width: usize| -> Option<usize> {
        let i = v.iter().position(|x| !x.is_finite())?;
        Some(i / width.max(1))
    };
    let checks: [(&[f32], usize, &'static str); 4] = [
        (&s.logsumexp, 1, "logsumexp"),
        (&s.target_logprobs, 1, "target_logprobs"),
        (&s.topk_values, s.k, "topk_values"),
        (&s.ids_logprobs, s.m, "ids_logprobs"),
    ];
    checks
        .iter()
        .filter_map(|&(v, w, name)| per_row(v, w).map(|r| (r, name)))
        .min_by_key(|&(r, _)| r)
}

/// Why the scores of logit row `row` (its valid columns) at `position` are not finite: the
/// model's logits themselves, or (logits finite) a temperature so small that `z / τ` or its
/// spread overflows an f32.
pub fn non_finite_cause(row: &[f32], temperature: f32, position: usize, field: &str) -> String {
    match row.iter().position(|x| !x.is_finite()) {
        Some(id) => format!(
            "the model's logits are not finite (logit of id {id} at position {position} is {})",
            row[id]
        ),
        None => format!(
            "temperature {temperature:?} overflows the scaled logits \
             (non-finite {field} at position {position})"
        ),
    }
}

/// The token after a sequence, from its last logit row `row` [valid]: the first maximum
/// (greedy), or a draw from `softmax(row / temperature)` by the inverse CDF of a uniform made
/// from `seed` (SplitMix64), summed in f64.
pub fn choose_next(row: &[f32], temperature: f32, how: NextToken) -> u32 {
    let first_max = || {
        let mut best = 0usize;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        best as u32
    };
    match how {
        NextToken::Greedy => first_max(),
        NextToken::Sample { seed } => {
            let inv_t = 1.0 / temperature as f64;
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let total: f64 = row.iter().map(|&x| ((x as f64 - m) * inv_t).exp()).sum();
            let u = unit_uniform(seed) * total;
            let mut acc = 0.0;
            for (i, &x) in row.iter().enumerate() {
                acc += ((x as f64 - m) * inv_t).exp();
                if acc > u {
                    return i as u32;
                }
            }
            first_max() // u within rounding of the total
        }
    }
}

/// A uniform in `[0, 1)` from a seed: one SplitMix64 step, 53 bits.
fn unit_uniform(seed: u64) -> f64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: CandidateRows<'static> = CandidateRows { ids: &[], m: 0 };

    /// The packed key orders candidates as `desc` does (total order of the values, smaller id
    /// first among equal ones) and gives back the value's bits and the id.
    #[test]
    fn packed_candidates_order_as_pairs() {
        let values = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.25,
            2.25,
            f32::MAX,
            f32::INFINITY,
        ];
        let mut pairs = Vec::new();
        for (i, &x) in values.iter().enumerate() {
            for id in [0u32, 7, 7 + i as u32, u32::MAX] {
                pairs.push((x, id));
            }
        }
        for a in &pairs {
            let ca = Cand::new(a.0, a.1);
            assert_eq!((ca.x().to_bits(), ca.id()), (a.0.to_bits(), a.1));
            for b in &pairs {
                let cb = Cand::new(b.0, b.1);
                assert_eq!(best_first(&ca, &cb), desc(a, b), "{a:?} vs {b:?}");
            }
        }
    }

    /// `kth_best` gives the k-th of a full sort (ties by smaller id) while the row holds k or
    /// more candidates, keeps exactly the best k and raises the threshold to it; a later seed
    /// over those k plus newcomers still matches the sort of everything pushed.
    #[test]
    fn kth_best_matches_a_sort_and_keeps_the_best_k() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for (k, n) in [(1usize, 1usize), (3, 2), (5, 40), (64, 300), (64, 64)] {
            let p = ScoreParams::native(k, 1.0, ValuesKind::Logprobs);
            let targets = [0u32];
            let mut f = RowFolds::new(layout(1000, 1000), &targets, NONE, &p);
            let row = &mut f.rows[0];
            let mut all: Vec<(f32, u32)> = Vec::new();
            for round in 0..2 {
                for i in 0..n {
                    // Values from few levels, so that ties are common.
                    let x = (next() % 17) as f32 * 0.5 - 4.0;
                    let id = (round * n + i) as u32;
                    all.push((x, id));
                    row.buf.push(Cand::new(x, id));
                }
                all.sort_by(desc);
                let got = row.kth_best(k);
                if all.len() < k {
                    assert_eq!(got, f32::NEG_INFINITY, "fewer than k: the threshold");
                    continue;
                }
                assert_eq!(got.to_bits(), all[k - 1].0.to_bits(), "k {k}, n {n}");
                assert_eq!(row.thr.to_bits(), got.to_bits());
                let mut kept: Vec<(f32, u32)> = row.buf.iter().map(|c| (c.x(), c.id())).collect();
                kept.sort_by(desc);
                assert_eq!(kept, all[..k], "the best k, ties to the smaller id");
            }
        }
    }

    fn layout(width: usize, valid: usize) -> RowLayout {
        RowLayout { width, valid }
    }

    /// Reference in f64 with a full sort (independent of the partial selection above).
    fn reference(row: &[f32], valid: usize, t: f64) -> (Vec<(usize, f64)>, f64) {
        let y: Vec<f64> = row[..valid].iter().map(|&x| x as f64 / t).collect();
        let m = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + y.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let mut all: Vec<(usize, f64)> = y.iter().map(|&v| v - lse).enumerate().collect();
        all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
        (all, lse)
    }

    fn pseudo_logits(rows: usize, width: usize) -> Vec<f32> {
        let mut s = 7u64;
        (0..rows * width)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
            })
            .collect()
    }

    #[test]
    fn matches_f64_reference_and_masks_padding() {
        let (rows, width, valid) = (5, 300, 290);
        let mut logits = pseudo_logits(rows, width);
        // Padded LM-head rows with huge logits must neither appear nor count in the softmax.
        for r in 0..rows {
            for c in valid..width {
                logits[r * width + c] = 1e4;
            }
        }
        let targets = [0u32, 7, 289, 100, 5];
        for t in [1.0f32, 0.7, 2.5] {
            let p = ScoreParams::native(17, t, ValuesKind::Logprobs);
            let s = score_rows(&logits, layout(width, valid), &targets, NONE, &p);
            s.check_shapes().unwrap();
            for r in 0..rows {
                let (all, lse) = reference(&logits[r * width..(r + 1) * width], valid, t as f64);
                assert!((s.logsumexp[r] as f64 - lse).abs() < 1e-5 * lse.abs().max(1.0));
                let got = s.ids_row(r).iter().zip(s.values_row(r));
                for ((&id, &v), want) in got.zip(&all[..p.k]) {
                    assert_eq!(id as usize, want.0);
                    assert!((v as f64 - want.1).abs() < 1e-5);
                }
                let tl = all.iter().find(|e| e.0 == targets[r] as usize).unwrap().1;
                assert!((s.target_logprobs[r] as f64 - tl).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn logits_mode_and_ties() {
        let row = vec![1.0f32, 3.0, 3.0, -2.0, 3.0];
        let p = ScoreParams::native(3, 2.0, ValuesKind::Logits);
        let s = score_rows(&row, layout(5, 5), &[3], NONE, &p);
        // Equal values come in ascending id order.
        assert_eq!(s.topk_ids, vec![1, 2, 4]);
        assert_eq!(s.topk_values, vec![1.5, 1.5, 1.5]);
        // lse of [0.5, 1.5, 1.5, -1, 1.5], computed by hand in f64.
        let lse = (0.5f64.exp() + 3.0 * 1.5f64.exp() + (-1.0f64).exp()).ln();
        assert!((s.logsumexp[0] as f64 - lse).abs() < 1e-6);
        assert!((s.target_logprobs[0] as f64 - (-1.0 - lse)).abs() < 1e-6);
    }

    /// Many rows, k larger than a block's worth of pruning, and rows with long runs of equal
    /// values: the one-pass selection equals a full sort.
    #[test]
    fn one_pass_selection_equals_full_sort() {
        let (rows, width) = (4, 5000);
        let mut logits = pseudo_logits(rows, width);
        for v in logits[width..2 * width].iter_mut() {
            *v = (*v * 2.0).round(); // many exact ties
        }
        for k in [1, 64, 300] {
            let p = ScoreParams::native(k, 1.0, ValuesKind::Logits);
            let s = score_rows(&logits, layout(width, width), &[0; 4], NONE, &p);
            for r in 0..rows {
                let row = &logits[r * width..(r + 1) * width];
                let mut all: Vec<(f32, u32)> = row
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| (x, i as u32))
                    .collect();
                all.sort_by(desc);
                let want: Vec<u32> = all[..k].iter().map(|e| e.1).collect();
                assert_eq!(s.ids_row(r), want.as_slice(), "row {r} k {k}");
            }
        }
    }

    /// Bits of every score and rank, for bit-for-bit comparisons.
    fn bits(s: &SequenceScores) -> Vec<u32> {
        [s.bits(), s.target_ranks.clone()].concat()
    }

    /// Every SIMD level gives the same bits (the levels differ in instruction width only), for
    /// top-k, candidates, ranks and logsumexp; levels the CPU lacks fall back to one it has.
    #[test]
    fn simd_levels_agree_bit_for_bit() {
        let (rows, width, valid) = (6, 5000, 4990);
        let logits = pseudo_logits(rows, width);
        let mut p = ScoreParams::native(17, 0.7, ValuesKind::Logprobs);
        p.ranks = true;
        let targets: Vec<u32> = (0..rows as u32).map(|r| r * 7).collect();
        let cands: Vec<u32> = [3, 4_000, 4_995, 17].repeat(rows);
        let cands = CandidateRows { ids: &cands, m: 4 };
        let run = |level: Simd| {
            bits(&score_rows_at(
                level,
                &logits,
                layout(width, valid),
                (&targets, cands),
                &p,
            ))
        };
        let base = run(Simd::Baseline);
        for level in [Simd::Avx2, Simd::Avx512] {
            assert!(run(level) == base, "{level:?} differs from the baseline");
        }
    }

    /// The fused LM head's contract: folding the logits a tile at a time (padding columns in
    /// the last tiles, targets and candidates in any tile, ties, temperature, both value kinds,
    /// k = 0) gives the same bits as scoring the whole rows, and ranks refuse the tiled path.
    #[test]
    fn tiles_fold_to_the_same_bits_as_whole_rows() {
        let (rows, width, valid) = (5, 3 * RowFolds::TILE + 700, 3 * RowFolds::TILE + 300);
        let mut logits = pseudo_logits(rows, width);
        // Ties across tile borders: equal maxima in the first and the last tile of row 1.
        logits[width + 5] = 40.0;
        logits[width + 3 * RowFolds::TILE + 10] = 40.0;
        let targets: Vec<u32> = vec![0, 2 * RowFolds::TILE as u32 + 3, 1, valid as u32 - 1, 9];
        let cands: Vec<u32> = [5, RowFolds::TILE as u32, valid as u32 - 1].repeat(rows);
        let cands = CandidateRows { ids: &cands, m: 3 };
        for (k, t, values) in [
            (8, 1.0, ValuesKind::Logprobs),
            (64, 0.6, ValuesKind::Logits),
            (0, 2.0, ValuesKind::Logprobs),
        ] {
            let p = ScoreParams::native(k, t, values);
            let whole = score_rows(&logits, layout(width, valid), &targets, cands, &p);
            let mut folds =
                RowFolds::tiled(layout(width, valid), &targets, cands, &p).expect("no ranks asked");
            for c0 in (0..width).step_by(RowFolds::TILE) {
                let c1 = (c0 + RowFolds::TILE).min(width);
                let tile: Vec<f32> = (0..rows)
                    .flat_map(|r| logits[r * width + c0..r * width + c1].to_vec())
                    .collect();
                folds.fold(&tile, c0..c1);
            }
            let tiled = folds.finish();
            assert_eq!(bits(&tiled), bits(&whole), "k {k} t {t}");
            if k > 0 {
                assert_eq!(&tiled.ids_row(1)[..2], &[5, 3 * RowFolds::TILE as u32 + 10]);
            }
        }
        let mut p = ScoreParams::native(8, 1.0, ValuesKind::Logprobs);
        p.ranks = true;
        assert!(RowFolds::tiled(layout(width, valid), &targets, cands, &p).is_none());
    }

    /// Speed figure, not a check: `cargo test --release -p xdistill-server --lib topk_speed --
    /// --ignored --nocapture`.
    #[test]
    #[ignore]
    fn topk_speed() {
        let (rows, width) = (64, 151_936);
        let logits = pseudo_logits(rows, width);
        let p = ScoreParams::native(64, 1.0, ValuesKind::Logprobs);
        let targets = vec![0u32; rows];
        for _ in 0..3 {
            let t0 = std::time::Instant::now();
            let s = score_rows(&logits, layout(width, 151_669), &targets, NONE, &p);
            let dt = t0.elapsed().as_secs_f64();
            println!(
                "{:.2} ms per row, {:.2} ns per logit ({} threads)",
                dt * 1e3 / rows as f64,
                dt * 1e9 / (rows * width) as f64,
                rayon::current_num_threads()
            );
            assert_eq!(s.rows, rows);
        }
        let row = &logits[..width];
        let t0 = std::time::Instant::now();
        let mut acc = 0.0;
        for _ in 0..50 {
            acc += simd::max(std::hint::black_box(row)) as f64;
        }
        println!(
            "max: {:.2} ns per logit",
            t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
        );
        let t0 = std::time::Instant::now();
        for _ in 0..50 {
            for b in std::hint::black_box(row).chunks(BLOCK) {
                acc += simd::sum_exp2(b, 6.0, std::f32::consts::LOG2_E);
            }
        }
        println!(
            "sum_exp: {:.2} ns per logit ({acc})",
            t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
        );
        println!("this CPU: {}", Simd::detect().name());
        let one = NONE;
        for round in 0..2 {
            for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
                let t0 = std::time::Instant::now();
                for _ in 0..50 {
                    let s = score_rows_at(
                        level,
                        std::hint::black_box(row),
                        layout(width, width),
                        (&[0], one),
                        &p,
                    );
                    assert_eq!(s.rows, 1);
                }
                println!(
                    "round {round}: one row ({}): {:.2} ns per logit",
                    level.name(),
                    t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
                );
            }
        }
    }

    #[test]
    fn k_equal_to_vocab_and_zero_rows() {
        let row = vec![0.0f32, 1.0, 2.0];
        let p = ScoreParams::native(3, 1.0, ValuesKind::Logprobs);
        let s = score_rows(&row, layout(3, 3), &[0], NONE, &p);
        assert_eq!(s.topk_ids, vec![2, 1, 0]);
        let total: f64 = s.topk_values.iter().map(|&v| (v as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        let e = score_rows(&[], layout(3, 3), &[], NONE, &p);
        assert_eq!(e.rows, 0);
        e.check_shapes().unwrap();
    }

    /// Version-2 outputs against the f64 reference: k = 0, candidate-id log-probs (padding ids
    /// give -inf), and ranks (a target inside the top k gets its position, one outside it the
    /// count of values >= its own).
    #[test]
    fn k_zero_candidates_and_ranks() {
        let (rows, width, valid) = (3, 400, 390);
        let logits = pseudo_logits(rows, width);
        let targets = [5u32, 77, 389];
        let cands: Vec<u32> = vec![1, 2, 3, 389, 0, 10, 20, 30, 40, 50, 60, 70];
        let c = CandidateRows { ids: &cands, m: 4 };
        for k in [0usize, 1, 50] {
            let p = ScoreParams {
                ranks: true,
                ..ScoreParams::native(k, 0.8, ValuesKind::Logprobs)
            };
            let s = score_rows(&logits, layout(width, valid), &targets, c, &p);
            s.check_shapes().unwrap();
            assert_eq!((s.k, s.m, s.target_ranks.len()), (k, 4, rows));
            for r in 0..rows {
                let row = &logits[r * width..(r + 1) * width];
                let (all, lse) = reference(row, valid, 0.8);
                let lp = |id: usize| row[id] as f64 / 0.8 - lse;
                assert!((s.logsumexp[r] as f64 - lse).abs() < 1e-5);
                assert!((s.target_logprobs[r] as f64 - lp(targets[r] as usize)).abs() < 1e-5);
                for (j, &id) in cands[r * 4..(r + 1) * 4].iter().enumerate() {
                    let got = s.ids_logprobs_row(r)[j] as f64;
                    assert!((got - lp(id as usize)).abs() < 1e-5, "row {r} cand {j}");
                }
                // Rank from the full f64 sort (distinct values: no ties).
                let pos = all.iter().position(|e| e.0 == targets[r] as usize).unwrap();
                assert_eq!(s.target_ranks[r] as usize, pos + 1, "row {r} k {k}");
            }
        }
    }

    #[test]
    fn ranks_put_ties_last_outside_the_top_k() {
        // Target 3 ties with ids 1 and 2 (value 3.0) but loses the tie order: with k = 1 it is
        // outside the top k, and its rank counts every value >= its own.
        let row = vec![1.0f32, 3.0, 3.0, 3.0, 4.0];
        let p = ScoreParams {
            ranks: true,
            ..ScoreParams::native(1, 1.0, ValuesKind::Logprobs)
        };
        let s = score_rows(&row, layout(5, 5), &[3], NONE, &p);
        assert_eq!(s.topk_ids, vec![4]);
        assert_eq!(s.target_ranks, vec![4]);
        let p3 = ScoreParams { k: 4, ..p };
        let s = score_rows(&row, layout(5, 5), &[3], NONE, &p3);
        assert_eq!(s.topk_ids, vec![4, 1, 2, 3]);
        assert_eq!(s.target_ranks, vec![4]);
        assert_eq!(rank_of(&row, 4.0), 1);
    }

    /// Non-finite scores are found and blamed on their cause: at τ = 1e-37 the logits ±30
    /// scale to ±3e38 (finite) but their spread to -6e38 (an f32 -inf log-prob); at 1e-45 the
    /// scale itself is infinite (NaN everywhere); a NaN logit is the model's.
    #[test]
    fn non_finite_scores_are_found_with_their_cause() {
        let row = vec![30.0f32, -30.0, 0.0];
        let ok = score_rows(
            &row,
            layout(3, 3),
            &[1],
            NONE,
            &ScoreParams::native(3, 1.0, ValuesKind::Logprobs),
        );
        assert_eq!(first_non_finite(&ok), None);
        let p = ScoreParams::native(1, 1e-37, ValuesKind::Logprobs);
        let s = score_rows(&row, layout(3, 3), &[1], NONE, &p);
        assert!(s.logsumexp[0].is_finite() && s.topk_values[0].is_finite());
        assert_eq!(first_non_finite(&s), Some((0, "target_logprobs")));
        assert_eq!(
            non_finite_cause(&row, 1e-37, 5, "target_logprobs"),
            "temperature 1e-37 overflows the scaled logits (non-finite target_logprobs at position 5)"
        );
        let p = ScoreParams::native(2, 1e-45, ValuesKind::Logits);
        let s = score_rows(
            &[row.clone(), row.clone()].concat(),
            layout(3, 3),
            &[0, 2],
            NONE,
            &p,
        );
        assert_eq!(first_non_finite(&s), Some((0, "logsumexp")));
        let nan = vec![1.0f32, f32::NAN, 0.0];
        let s = score_rows(
            &nan,
            layout(3, 3),
            &[0],
            NONE,
            &ScoreParams::native(1, 1.0, ValuesKind::Logprobs),
        );
        assert_eq!(first_non_finite(&s).map(|e| e.0), Some(0));
        assert!(non_finite_cause(&nan, 1.0, 0, "logsumexp").contains("logits are not finite"));
    }

    #[test]
    fn greedy_is_the_first_maximum() {
        assert_eq!(
            choose_next(&[0.0, 2.0, 1.0, 2.0], 1.0, NextToken::Greedy),
            1
        );
    }

    /// Seeded draws are reproducible and follow softmax(z / τ): empirical frequencies over
    /// 20,000 seeds against the f64 probabilities (5 standard errors).
    #[test]
    fn sampling_follows_the_tempered_softmax() {
        let row = [0.0f32, 1.0, -1.0, 0.5];
        let t = 0.7f32;
        let mut counts = [0usize; 4];
        let n = 20_000;
        for seed in 0..n as u64 {
            counts[choose_next(&row, t, NextToken::Sample { seed }) as usize] += 1;
        }
        let w: Vec<f64> = row.iter().map(|&x| (x as f64 / t as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = w[i] / total;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            let f = c as f64 / n as f64;
            assert!((f - p).abs() < 5.0 * se, "id {i}: {f} vs {p}");
        }
        let s = NextToken::Sample { seed: 42 };
        assert_eq!(choose_next(&row, t, s), choose_next(&row, t, s));
    }
}
