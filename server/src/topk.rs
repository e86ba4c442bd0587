//! Per-position top-k, target log-prob and logsumexp of logit rows on the host ([`score_rows`]),
//! the choice between that and the device path ([`TopkPath`]; the device path itself is
//! `worker.rs`'s `score_on_device`), and the next-token helpers built on the same row maths.

use rayon::prelude::*;
use std::cmp::Ordering;
use xdistill_shared::protocol::{SequenceScores, ValuesKind};

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
fn desc(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// `e^x` for `x ≤ 0` in f32, branch-free so that it vectorises; relative error below 3e-7
/// (checked against f64 in the tests). Inputs below -87 return `e^-87` (negligible in a sum).
#[inline(always)]
fn exp_nonpos(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting it rounds to integer
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = if x < -87.0 { -87.0 } else { x };
    // 1. x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite, two-part ln2).
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    // The integer n sits in the low mantissa bits of t (no float-to-int conversion needed).
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // 2. e^r by its Taylor polynomial of degree 7 (truncation error < 1e-8 on that interval).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 3. Scale by 2^n through the exponent bits (n >= -126, so the result is normal).
    p * f32::from_bits((ni.wrapping_add(127) as u32) << 23)
}

/// Lanes of the vectorisable reductions.
const LANES: usize = 8;
/// Elements per block: small enough to stay in L1 between the passes over it.
const BLOCK: usize = 2048;
/// Elements per segment of the candidate scan.
const SEGMENT: usize = 64;

#[inline(always)]
fn block_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = it
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for a in acc {
        m = m.max(a);
    }
    m
}

/// `Σ e^{(x - m)·scale}` over a block of at most [`BLOCK`] values. The exponentials are written
/// to a scratch array first (a plain map loop, which the compiler vectorises), then summed in
/// f32 lanes (each lane sums ≤ 256 terms ≤ 1) and the lanes in f64.
#[inline(always)]
fn block_sum_exp(x: &[f32], m: f32, scale: f32) -> f64 {
    let mut e = [0f32; BLOCK];
    let e = &mut e[..x.len().min(BLOCK)];
    for (o, &v) in e.iter_mut().zip(x) {
        *o = exp_nonpos((v - m) * scale);
    }
    let mut acc = [0f32; LANES];
    let mut it = e.chunks_exact(LANES);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    let rest: f64 = it.remainder().iter().map(|&v| v as f64).sum();
    acc.iter().map(|&a| a as f64).sum::<f64>() + rest
}

/// Where [`score_row`] writes one row's results.
struct RowSlots<'a> {
    /// `[k]` top ids and values.
    ids: &'a mut [u32],
    vals: &'a mut [f32],
    /// `[m]` log-probs at the row's candidate ids.
    cand_lp: &'a mut [f32],
}

/// Per-row scalars computed by [`score_row`].
struct RowStats {
    target_lp: f32,
    lse: f32,
    /// 0 when ranks were not asked for.
    rank: u32,
}

/// The instruction set the host scoring pass runs with, chosen once at start-up from what the
/// CPU has (the build itself stays portable: baseline x86-64). Ordered narrow to wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    Baseline,
    Avx2,
    Avx512,
}

impl Simd {
    /// The widest level this CPU supports.
    pub fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return Simd::Avx512;
            }
            if avx2 {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    }

    /// The level in use (detected on first use).
    pub fn current() -> Simd {
        static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *LEVEL.get_or_init(Simd::detect)
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Avx512 => "avx512",
            Simd::Avx2 => "avx2",
            Simd::Baseline => "baseline",
        }
    }
}

/// Scores of one logit row. `row`: [width] of which the first `valid` are real tokens (the rest
/// is LM-head padding: excluded from the softmax and never returned). `cands`: [m] ids whose
/// log-probs are written to `out.cand_lp`. `buf` is scratch space.
///
/// Runs [`score_row_body`] compiled for the CPU's widest [`Simd`] level. Every level computes
/// the same arithmetic in the same order (no fused multiply-adds are introduced, the lane sums
/// are fixed at [`LANES`]), so the answers are bit-identical whichever runs.
fn score_row(
    row: &[f32],
    valid: usize,
    ids: (u32, &[u32]),
    p: &ScoreParams,
    buf: &mut Vec<(f32, u32)>,
    out: RowSlots<'_>,
) -> RowStats {
    score_row_at(Simd::current(), row, valid, ids, p, buf, out)
}

/// [`score_row`] at `level`, or at the CPU's widest level when it lacks `level` (tests compare
/// the levels).
#[allow(clippy::too_many_arguments)]
fn score_row_at(
    level: Simd,
    row: &[f32],
    valid: usize,
    ids: (u32, &[u32]),
    p: &ScoreParams,
    buf: &mut Vec<(f32, u32)>,
    out: RowSlots<'_>,
) -> RowStats {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: never above `Simd::current()`, the level whose features the CPU has.
        match level.min(Simd::current()) {
            Simd::Avx512 => return unsafe { score_row_avx512(row, valid, ids, p, buf, out) },
            Simd::Avx2 => return unsafe { score_row_avx2(row, valid, ids, p, buf, out) },
            Simd::Baseline => {}
        }
    }
    let _ = level;
    score_row_body(row, valid, ids, p, buf, out)
}

/// [`score_row_body`] compiled with the given target features.
macro_rules! score_row_with {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(
            row: &[f32],
            valid: usize,
            ids: (u32, &[u32]),
            p: &ScoreParams,
            buf: &mut Vec<(f32, u32)>,
            out: RowSlots<'_>,
        ) -> RowStats {
            score_row_body(row, valid, ids, p, buf, out)
        }
    };
}
score_row_with!(score_row_avx2, "avx2,fma");
score_row_with!(score_row_avx512, "avx512f,avx2,fma");

#[inline(always)]
fn score_row_body(
    row: &[f32],
    valid: usize,
    (target, cands): (u32, &[u32]),
    p: &ScoreParams,
    buf: &mut Vec<(f32, u32)>,
    out: RowSlots<'_>,
) -> RowStats {
    let row = &row[..valid];
    let inv_t = 1.0 / p.temperature as f64;
    let scale = inv_t as f32;
    let k = p.k.min(valid);
    // Candidates are pruned back to k whenever the buffer reaches this size.
    let prune_at = (4 * k).max(256);
    // One pass over L1-sized blocks: running max with rescaled exp-sum (online logsumexp), and
    // top-k candidates above a running threshold (the k-th best value seen so far; a later equal
    // value loses the tie to the earlier, smaller id, so it may be skipped). With k = 0 no
    // candidate is ever above the threshold of +inf.
    let mut m = f32::NEG_INFINITY;
    let mut sum = 0f64;
    let mut thr = if k == 0 {
        f32::INFINITY
    } else {
        f32::NEG_INFINITY
    };
    buf.clear();
    for (b, block) in row.chunks(BLOCK).enumerate() {
        let bm = block_max(block);
        if bm > m {
            if sum > 0.0 {
                sum *= ((m as f64 - bm as f64) * inv_t).exp();
            }
            m = bm;
        }
        sum += block_sum_exp(block, m, scale);
        if bm > thr {
            // Segments whose (vectorised) max is not above the threshold hold no candidate.
            for (s, seg) in block.chunks(SEGMENT).enumerate() {
                if block_max(seg) <= thr {
                    continue;
                }
                let base = (b * BLOCK + s * SEGMENT) as u32;
                for (j, &x) in seg.iter().enumerate() {
                    if x > thr {
                        buf.push((x, base + j as u32));
                        if buf.len() >= prune_at {
                            buf.select_nth_unstable_by(k - 1, desc);
                            buf.truncate(k);
                            thr = buf[k - 1].0;
                        }
                    }
                }
            }
        }
    }
    let lse = m as f64 * inv_t + sum.ln();
    if buf.len() > k {
        buf.select_nth_unstable_by(k - 1, desc);
        buf.truncate(k);
    }
    buf.sort_unstable_by(desc);
    // Values in f64 before the final rounding.
    let logprob = |x: f32| (x as f64 * inv_t - lse) as f32;
    let value = |x: f32| -> f32 {
        match p.values {
            ValuesKind::Logprobs => logprob(x),
            ValuesKind::Logits => (x as f64 * inv_t) as f32,
        }
    };
    for (j, &(x, id)) in buf.iter().enumerate() {
        out.ids[j] = id;
        out.vals[j] = value(x);
    }
    for (o, &c) in out.cand_lp.iter_mut().zip(cands) {
        *o = row
            .get(c as usize)
            .map_or(f32::NEG_INFINITY, |&x| logprob(x));
    }
    let zt = row.get(target as usize).copied();
    let rank = match (p.ranks, zt) {
        (false, _) => 0,
        (true, None) => valid as u32,
        (true, Some(zt)) => match buf.iter().position(|e| e.1 == target) {
            Some(j) => j as u32 + 1,
            None => rank_of(row, zt),
        },
    };
    RowStats {
        target_lp: zt.map_or(f32::NEG_INFINITY, logprob),
        lse: lse as f32,
        rank,
    }
}

/// 1-based rank of the value `zt` in `row`, ties ranked last: `#{v : row[v] >= zt}` (vLLM's
/// convention for a token outside the returned top k).
pub fn rank_of(row: &[f32], zt: f32) -> u32 {
    row.iter().map(|&x| (x >= zt) as u32).sum()
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
    let rows = targets.len();
    let width = layout.width;
    debug_assert_eq!(logits.len(), rows * width);
    debug_assert_eq!(cands.ids.len(), rows * cands.m);
    let valid = layout.valid.min(width);
    let (k, m) = (p.k, cands.m);
    // Output buffers with at least one column per row, so that `par_chunks_mut` works for
    // k = 0 / m = 0 too; the extra column is dropped below.
    let (kk, mm) = (k.max(1), m.max(1));
    let mut ids_buf = vec![0u32; rows * kk];
    let mut vals_buf = vec![0f32; rows * kk];
    let mut cand_buf = vec![0f32; rows * mm];
    let cand_ids = |r: usize| &cands.ids[r * m..(r + 1) * m];
    // Per row: (logits, target, candidate ids) in; (ids, values, candidate log-probs) out.
    let mut stats: Vec<RowStats> = Vec::with_capacity(rows);
    logits
        .par_chunks(width)
        .zip(targets.par_iter())
        .zip(ids_buf.par_chunks_mut(kk))
        .zip(vals_buf.par_chunks_mut(kk))
        .zip(cand_buf.par_chunks_mut(mm))
        .enumerate()
        .map_init(
            || Vec::with_capacity((4 * k).max(256) + 1),
            |buf, (r, ((((row, &target), ids), vals), cand_lp))| {
                let slots = RowSlots {
                    ids: &mut ids[..k],
                    vals: &mut vals[..k],
                    cand_lp: &mut cand_lp[..m],
                };
                score_row(row, valid, (target, cand_ids(r)), p, buf, slots)
            },
        )
        .collect_into_vec(&mut stats);
    if k == 0 {
        (ids_buf, vals_buf) = (Vec::new(), Vec::new());
    }
    SequenceScores {
        rows,
        k,
        topk_ids: ids_buf,
        topk_values: vals_buf,
        target_logprobs: stats.iter().map(|s| s.target_lp).collect(),
        logsumexp: stats.iter().map(|s| s.lse).collect(),
        m,
        ids_logprobs: if m == 0 { Vec::new() } else { cand_buf },
        target_ranks: if p.ranks {
            stats.iter().map(|s| s.rank).collect()
        } else {
            Vec::new()
        },
        next_token: None,
    }
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

    #[test]
    fn fast_exp_matches_f64() {
        let mut worst = 0f64;
        let mut x = -90.0f32;
        while x <= 0.0 {
            let want = (x as f64).max(-87.0).exp();
            let got = exp_nonpos(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.000_37;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
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

    /// Every SIMD level gives the same bits (the levels differ in instruction width only), for
    /// top-k, candidates, ranks and logsumexp; levels the CPU lacks fall back to one it has.
    #[test]
    fn simd_levels_agree_bit_for_bit() {
        let (rows, width, valid) = (6, 5000, 4990);
        let logits = pseudo_logits(rows, width);
        let mut p = ScoreParams::native(17, 0.7, ValuesKind::Logprobs);
        p.ranks = true;
        let cands: Vec<u32> = vec![3, 4_000, 4_995, 17];
        // Per row: ids, value bits, candidate log-prob bits, logsumexp, target, rank.
        type RowBits = (Vec<u32>, Vec<u32>, Vec<u32>, u32, u32, u32);
        let run = |level: Simd| -> Vec<RowBits> {
            let mut buf = Vec::new();
            (0..rows)
                .map(|r| {
                    let (mut ids, mut vals, mut lp) = (vec![0; 17], vec![0.0; 17], vec![0.0; 4]);
                    let st = score_row_at(
                        level,
                        &logits[r * width..(r + 1) * width],
                        valid,
                        (r as u32 * 7, &cands),
                        &p,
                        &mut buf,
                        RowSlots {
                            ids: &mut ids,
                            vals: &mut vals,
                            cand_lp: &mut lp,
                        },
                    );
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    (
                        ids,
                        bits(&vals),
                        bits(&lp),
                        st.lse.to_bits(),
                        st.target_lp.to_bits(),
                        st.rank,
                    )
                })
                .collect()
        };
        let base = run(Simd::Baseline);
        for level in [Simd::Avx2, Simd::Avx512] {
            assert!(run(level) == base, "{level:?} differs from the baseline");
        }
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
            acc += block_max(std::hint::black_box(row)) as f64;
        }
        println!(
            "max: {:.2} ns per logit",
            t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
        );
        let t0 = std::time::Instant::now();
        for _ in 0..50 {
            for b in std::hint::black_box(row).chunks(BLOCK) {
                acc += block_sum_exp(b, 6.0, 1.0);
            }
        }
        println!(
            "sum_exp: {:.2} ns per logit ({acc})",
            t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
        );
        let mut buf = Vec::new();
        let (mut ids, mut vals) = (vec![0; 64], vec![0.0; 64]);
        println!("this CPU: {}", Simd::detect().name());
        for round in 0..2 {
            for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
                let t0 = std::time::Instant::now();
                for _ in 0..50 {
                    let slots = RowSlots {
                        ids: &mut ids,
                        vals: &mut vals,
                        cand_lp: &mut [],
                    };
                    score_row_at(
                        level,
                        std::hint::black_box(row),
                        width,
                        (0, &[]),
                        &p,
                        &mut buf,
                        slots,
                    );
                }
                println!(
                    "round {round}: score_row ({}): {:.2} ns per logit",
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
