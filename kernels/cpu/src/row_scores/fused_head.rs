//! The fused LM head on AVX-512 and on AVX2 with FMA: the logits `hidden · headᵀ` of a panel
//! of 32 positions are computed a vocabulary tile at a time into an L1-sized buffer and folded
//! into the panel's running scores before the next tile overwrites it, so that `[N, V]` never
//! exists and each logit is read once, from L1, right after it is made.
//!
//! The tile is laid out `[vocab, position]`: every vector (16 lanes on AVX-512, 8 on AVX2)
//! holds one vocabulary id's logits for as many positions, so the fold is vertical (lane =
//! position) — running max, exp-sum and top-k threshold per lane, no horizontal reductions.
//! The head is read in place (`[V, H]` row-major, no packed copy); the panel's hidden states
//! are transposed once (`[H, 32]`).
//!
//! A position's scores do not depend on its neighbours, the chunking, the thread count or the
//! level: its lane computes the same operations in the same order whatever else is in the
//! panel and whichever vector width carries it (the two levels give the same bits), and the
//! vocabulary is folded in [`SEGMENTS`] fixed segments merged in order.

use super::{FoldParams, RowFold, RowFolds};
use crate::matmul::{self, transpose_panels, GROUP, MR, NP};
use crate::simd::Simd;
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Fixed vocabulary segments, folded independently (in parallel) and merged in order. The first
/// runs alone, the others in waves seeded by the segments before them (see [`fold_head`]); 16
/// of them divide evenly among 2, 4, 8 or 16 threads.
const SEGMENTS: usize = 17;
/// Segment boundaries are multiples of this (the widest tile).
const ALIGN: usize = 128;

/// Where the kernel's time goes.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeadTiming {
    /// Computing logits (the LM head's matmul): CPU time, summed over threads.
    pub matmul: Duration,
    /// Folding them into the scores: CPU time, summed over threads.
    pub fold: Duration,
    /// Merging the segments' scores and seeding the next wave between the parallel jobs: wall
    /// time (scoring work, none of it matmul).
    pub merge: Duration,
}

impl HeadTiming {
    /// The kernel's `wall` time as `(forward, scoring)`: the parallel jobs' share in proportion
    /// to their own matmul and fold times, the merges all scoring.
    pub fn split(&self, wall: Duration) -> (Duration, Duration) {
        let jobs = wall.saturating_sub(self.merge);
        let total = (self.matmul + self.fold).as_secs_f64();
        let fold_share = if total > 0.0 {
            self.fold.as_secs_f64() / total
        } else {
            0.0
        };
        (
            jobs.mul_f64(1.0 - fold_share),
            jobs.mul_f64(fold_share) + self.merge,
        )
    }
}

/// Whether this CPU runs the kernel: AVX-512F, or AVX2 with FMA (at the level in use,
/// [`Simd::current`]).
pub fn available() -> bool {
    cfg!(target_arch = "x86_64") && Simd::current() >= Simd::Avx2
}

/// A target or candidate id of one lane, to be read from the tile holding its column.
#[derive(Debug, Clone, Copy)]
struct Pick {
    id: u32,
    lane: u8,
    /// Index into the row's candidates, or [`TARGET`].
    slot: u32,
}
const TARGET: u32 = u32::MAX;

/// Folds every valid column of `hidden · headᵀ` into `f`'s rows. `hidden`: `[rows, h]`;
/// `head`: `[≥ valid, h]`, both row-major f32. Call only when [`available`].
pub(super) fn fold_head(
    f: &mut RowFolds<'_>,
    hidden: &[f32],
    head: &[f32],
    h: usize,
) -> HeadTiming {
    let (n, valid) = (f.rows.len(), f.valid);
    let level = f.level.min(Simd::current());
    assert!(
        cfg!(target_arch = "x86_64") && level >= Simd::Avx2,
        "the LM-head kernel needs AVX2 with FMA, or AVX-512"
    );
    assert_eq!(hidden.len(), n * h, "hidden states are [rows, h]");
    assert!(head.len() >= valid * h, "the head has a row per valid id");
    f.next_col = f.next_col.max(valid);
    if n == 0 || valid == 0 || h == 0 {
        return HeadTiming::default();
    }
    let panels = n.div_ceil(NP);
    let at = transpose_panels(hidden, h, panels);
    let picks = panel_picks(f, panels);
    // For ranks, each row's target logit: the same fused multiply-adds in the same order as its
    // lane in the kernel, so the target counts itself among the logits ≥ it.
    let zt: Vec<f32> = (0..panels * NP)
        .map(|r| match (f.params.ranks, f.targets.get(r)) {
            (true, Some(&t)) if (t as usize) < valid => {
                let w = &head[t as usize * h..(t as usize + 1) * h];
                let a = &hidden[r * h..(r + 1) * h];
                matmul::dot_blocked(w, a, true)
            }
            _ => f32::NAN,
        })
        .collect();
    let seg_len = valid.div_ceil(SEGMENTS).next_multiple_of(ALIGN);
    let shared = Shared {
        level,
        at: &at,
        head,
        h,
        vt: matmul::tile_rows(h),
        n,
        fp: f.fp,
        ranks: f.params.ranks,
        picks: &picks,
        zt: &zt,
    };
    // Jobs: (group of panels, segment), each on fresh copies of its rows' states with the
    // given top-k thresholds, results in job order.
    let fresh = f.rows.clone();
    let run = |segs: std::ops::Range<usize>, group: usize, thr: &[f32]| {
        let jobs: Vec<(usize, usize)> = (0..panels.div_ceil(group))
            .flat_map(|g| segs.clone().map(move |s| (g * group, s)))
            .collect();
        let done: Vec<(usize, Vec<RowFold>, HeadTiming)> = jobs
            .par_iter()
            .map(|&(q0, s)| {
                let q1 = (q0 + group).min(panels);
                let rows = q0 * NP..(q1 * NP).min(n);
                let seg = s * seg_len..((s + 1) * seg_len).min(valid);
                let mut states = fresh[rows.clone()].to_vec();
                for (st, &t) in states.iter_mut().zip(&thr[rows]) {
                    st.thr = st.thr.max(t);
                }
                // SAFETY: `level` was checked above: the CPU has its features.
                let t = unsafe { run_job(&shared, q0..q1, seg, &mut states) };
                (q0, states, t)
            })
            .collect();
        done
    };
    // Segments run in waves, each from the exact k-th best value of every segment folded
    // before it: a later value equal to it has a larger id and loses the tie, so only values
    // above it can enter the top k. Against the bound of `d` segments a segment pushes about
    // k / d candidates, so the waves grow as the bound improves — as large as the segments
    // done so far, in whole rounds of jobs for the threads ([`wave_step`]). The first runs alone,
    // one job per panel. Waves change only which candidates are kept on the way, never the
    // results (the sums are merged in segment order whatever the waves). Between waves the
    // rows are merged and seeded panel by panel in parallel, each row's buffer cut to its best
    // k, so that the next seed selects among k plus the wave's newcomers.
    let mut timing = HeadTiming::default();
    let segments = valid.div_ceil(seg_len);
    let step = wave_step(rayon::current_num_threads(), panels.div_ceil(GROUP));
    let mut seed = vec![f32::NEG_INFINITY; n];
    let mut done = 0;
    while done < segments {
        let (wave, group) = match done {
            0 => (0..1, 1),
            d => (d..(d + d.next_multiple_of(step)).min(segments), GROUP),
        };
        done = wave.end;
        let results = run(wave, group, &seed);
        let m0 = Instant::now();
        let next = (done < segments).then_some(&mut seed[..]);
        let t = merge_wave(results, &mut f.rows, &f.fp, next);
        timing.matmul += t.matmul;
        timing.fold += t.fold;
        timing.merge += m0.elapsed();
    }
    timing
}

/// Merges a wave's results (in job order: groups of panels, each in segment order) into
/// `rows`, panels in parallel, each row's runs in segment order; then, for a next wave, writes
/// each row's k-th best value so far to `seed`. Returns the jobs' times.
fn merge_wave(
    done: Vec<(usize, Vec<RowFold>, HeadTiming)>,
    rows: &mut [RowFold],
    fp: &FoldParams,
    seed: Option<&mut [f32]>,
) -> HeadTiming {
    let mut timing = HeadTiming::default();
    // Each job's states (rows of panels q0, q0 + 1, …) cut into panels.
    let mut by_panel: Vec<Vec<Vec<RowFold>>> = vec![Vec::new(); rows.len().div_ceil(NP)];
    for (q0, states, t) in done {
        let mut states = states.into_iter();
        for runs in &mut by_panel[q0..] {
            let part: Vec<RowFold> = states.by_ref().take(NP).collect();
            if part.is_empty() {
                break;
            }
            runs.push(part);
        }
        timing.matmul += t.matmul;
        timing.fold += t.fold;
    }
    let merge = |rows: &mut [RowFold], runs: Vec<Vec<RowFold>>| {
        for states in runs {
            for (row, st) in rows.iter_mut().zip(states) {
                row.merge(st, fp);
            }
        }
    };
    let panels = rows.par_chunks_mut(NP).zip(by_panel);
    match seed {
        Some(seed) => panels
            .zip(seed.par_chunks_mut(NP))
            .for_each(|((rows, runs), seed)| {
                merge(rows, runs);
                for (s, row) in seed.iter_mut().zip(rows) {
                    *s = row.kth_best(fp.k);
                }
            }),
        None => panels.for_each(|(rows, runs)| merge(rows, runs)),
    }
    timing
}

/// Segments per wave step so that a wave's jobs (segments × groups of panels) come in whole
/// rounds for `threads`: `threads / gcd(threads, groups)`.
fn wave_step(threads: usize, groups: usize) -> usize {
    let (mut a, mut b) = (threads.max(1), groups.max(1));
    while b != 0 {
        (a, b) = (b, a % b);
    }
    threads.max(1) / a
}

/// Each panel's valid target and candidate ids, sorted by id.
fn panel_picks(f: &RowFolds<'_>, panels: usize) -> Vec<Vec<Pick>> {
    let (n, m) = (f.rows.len(), f.cands.m);
    (0..panels)
        .map(|q| {
            let mut v = Vec::new();
            for r in q * NP..((q + 1) * NP).min(n) {
                let lane = (r % NP) as u8;
                let cands = f.cands.ids[r * m..(r + 1) * m].iter().enumerate();
                let slots = [(TARGET, f.targets[r])].into_iter();
                for (slot, id) in slots.chain(cands.map(|(c, &id)| (c as u32, id))) {
                    v.push(Pick { id, lane, slot });
                }
            }
            v.retain(|p| (p.id as usize) < f.valid);
            v.sort_unstable_by_key(|p| p.id);
            v
        })
        .collect()
}

/// What every job reads.
struct Shared<'a> {
    /// The kernel's level: AVX-512 or AVX2 (the same bits).
    level: Simd,
    /// Transposed hidden states `[panels, h, NP]`.
    at: &'a [f32],
    head: &'a [f32],
    h: usize,
    /// Vocabulary rows per tile.
    vt: usize,
    /// Real rows (lanes past it are padding).
    n: usize,
    fp: FoldParams,
    ranks: bool,
    picks: &'a [Vec<Pick>],
    /// `[panels · NP]` target logits for ranks (NaN: none).
    zt: &'a [f32],
}

/// Candidates of one vector's lanes (16 or 8) before they are pushed: per tile row, the mask
/// of lanes above their threshold, and the rows with any.
struct Stage {
    masks: Vec<u16>,
    rows: Vec<u16>,
}

/// The running scores of one panel's lanes during a job.
struct Lanes {
    m: [f32; NP],
    sum: [f64; NP],
    thr: [f32; NP],
    ge: [u32; NP],
    /// Real rows among the lanes, one bit each.
    live: u32,
    /// The next of the panel's picks to read.
    cursor: usize,
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Folds vocabulary segment `seg` of panels `panels` into `states` (their rows, fresh), with
/// the kernels of `s.level`.
///
/// # Safety
/// The CPU has the features of `s.level` (AVX-512F, or AVX2 and FMA).
#[cfg(target_arch = "x86_64")]
unsafe fn run_job(
    s: &Shared<'_>,
    panels: std::ops::Range<usize>,
    seg: std::ops::Range<usize>,
    states: &mut [RowFold],
) -> HeadTiming {
    type Range = std::ops::Range<usize>;
    // Closures, not function items, so that the tiles' intrinsics are compiled with each
    // wrapper's features and inlined there (see `matmul::run_job`).
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn avx512(s: &Shared<'_>, p: Range, seg: Range, st: &mut [RowFold]) -> HeadTiming {
        // SAFETY: this function runs only with AVX-512F (below).
        job_body(
            s,
            (p, seg, st),
            |at, w, rows, h, t| unsafe { matmul::micro_tile(at, w, rows, h, t) },
            |s, l, st, tile, zt, stage| unsafe { fold_tile(s, l, st, tile, zt, stage) },
        )
    }
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(s: &Shared<'_>, p: Range, seg: Range, st: &mut [RowFold]) -> HeadTiming {
        // SAFETY: this function runs only with AVX2 and FMA (below).
        job_body(
            s,
            (p, seg, st),
            |at, w, rows, h, t| unsafe { matmul::micro_tile_avx2(at, w, rows, h, t) },
            |s, l, st, tile, zt, stage| unsafe { fold_tile_avx2(s, l, st, tile, zt, stage) },
        )
    }
    // SAFETY: the caller's contract: the CPU has `s.level`'s features.
    match s.level {
        Simd::Avx512 => avx512(s, panels, seg, states),
        Simd::Avx2 => avx2(s, panels, seg, states),
        Simd::Baseline => unreachable!("`fold_head` checked the level"),
    }
}

/// [`run_job`]'s loop, with the level's micro-tile (`tile_of`) and fold (`fold`) inlined.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn job_body(
    s: &Shared<'_>,
    (panels, seg, states): (
        std::ops::Range<usize>,
        std::ops::Range<usize>,
        &mut [RowFold],
    ),
    tile_of: impl Fn(&[f32], &[f32], [usize; MR], usize, &mut [f32]),
    fold: impl Fn(&Shared<'_>, &mut Lanes, &mut [RowFold], (&[f32], usize), &[f32], &mut Stage),
) -> HeadTiming {
    let (h, vt) = (s.h, s.vt);
    let mut lanes: Vec<Lanes> = panels
        .clone()
        .map(|q| {
            let real = s.n.saturating_sub(q * NP).min(NP);
            let i0 = (q - panels.start) * NP;
            let first = &states[i0];
            Lanes {
                m: [first.m; NP],
                sum: [first.sum; NP],
                thr: std::array::from_fn(|j| states.get(i0 + j).map_or(f32::INFINITY, |s| s.thr)),
                ge: [0; NP],
                live: if real == NP {
                    u32::MAX
                } else {
                    (1u32 << real) - 1
                },
                cursor: s.picks[q].partition_point(|p| (p.id as usize) < seg.start),
            }
        })
        .collect();
    // [vt + MR, NP]: the last micro-tile may write up to MR - 1 rows past the tile.
    let mut tile = vec![0f32; (vt + MR) * NP];
    let mut stage = Stage {
        masks: vec![0; vt],
        rows: vec![0; vt],
    };
    let mut timing = HeadTiming::default();
    let last = seg.end - 1;
    let prefetch = matmul::next_tile_fits_l2(vt, h);
    // Each step's end is the next one's start: two clock reads per (tile, panel).
    let mut t0 = Instant::now();
    for v0 in seg.clone().step_by(vt) {
        let vn = (v0 + vt).min(seg.end) - v0;
        for (i, q) in panels.clone().enumerate() {
            let at = &s.at[q * h * NP..(q + 1) * h * NP];
            for mv in (0..vn).step_by(MR) {
                let rows: [usize; MR] = std::array::from_fn(|r| (v0 + mv + r).min(last));
                tile_of(at, s.head, rows, h, &mut tile[mv * NP..(mv + MR) * NP]);
                // The first panel brings the next tile of the head to L2 meanwhile.
                if i == 0 && prefetch {
                    let next = (v0 + vt + mv).min(seg.end)..(v0 + vt + mv + MR).min(seg.end);
                    matmul::prefetch_rows(s.head, next, h);
                }
            }
            let t1 = Instant::now();
            let end = ((i + 1) * NP).min(states.len());
            let st = &mut states[i * NP..end];
            let zt = &s.zt[q * NP..(q + 1) * NP];
            fold(s, &mut lanes[i], st, (&tile[..vn * NP], v0), zt, &mut stage);
            read_picks(&mut lanes[i], st, &s.picks[q], &tile[..vn * NP], v0);
            let t2 = Instant::now();
            timing.matmul += t1 - t0;
            timing.fold += t2 - t1;
            t0 = t2;
        }
    }
    for (i, l) in lanes.iter().enumerate() {
        for (j, st) in states[i * NP..].iter_mut().take(NP).enumerate() {
            (st.m, st.sum, st.thr, st.ge) = (l.m[j], l.sum[j], l.thr[j], l.ge[j]);
        }
    }
    timing
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn run_job(
    _: &Shared<'_>,
    _: std::ops::Range<usize>,
    _: std::ops::Range<usize>,
    _: &mut [RowFold],
) -> HeadTiming {
    unreachable!("`available()` is false off x86-64")
}

/// Folds a tile `[vn, NP]` of logits (columns `v0..v0 + vn`) into one panel's lanes: per
/// 16-lane half, the tile's max (rescaling sums whose max rose), `Σ 2^{(x - m)·scale2}`, the
/// candidates above each lane's threshold and, with ranks, the count of logits ≥ the target's.
///
/// Compiled with AVX-512 itself (not only inlined into [`run_job`]) so that its `exp2` closure
/// inherits the features: a closure of a function without them got none, its intrinsics stayed
/// calls passing vectors through memory (5 % of the Rust tests' CPU samples, 2026-12-01), and a
/// dev-profile teacher scored 1.7x fewer positions a second (bench/README.md). Release builds
/// had inlined it anyway.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
unsafe fn fold_tile(
    s: &Shared<'_>,
    l: &mut Lanes,
    st: &mut [RowFold],
    (tile, v0): (&[f32], usize),
    zt: &[f32],
    stage: &mut Stage,
) {
    let fp = &s.fp;
    let vn = tile.len() / NP;
    let [c1, c2, c3, c4, c5] = crate::simd::EXP2_COEFFS.map(|c| _mm512_set1_ps(c));
    let (one, lo, s2) = (
        _mm512_set1_ps(1.0),
        _mm512_set1_ps(-126.0),
        _mm512_set1_ps(fp.scale2),
    );
    let t = tile.as_ptr();
    for o in [0, 16] {
        let live = (l.live >> o) as u16;
        if live == 0 {
            continue;
        }
        // The tile's max per lane (NaNs ignored: `max(x, acc)` keeps `acc` for a NaN `x`), in
        // four chains held in registers so that the max's latency is hidden.
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let (mut m0, mut m1, mut m2, mut m3) = (ninf, ninf, ninf, ninf);
        let mut v = 0;
        while v + 4 <= vn {
            m0 = _mm512_max_ps(_mm512_loadu_ps(t.add(v * NP + o)), m0);
            m1 = _mm512_max_ps(_mm512_loadu_ps(t.add((v + 1) * NP + o)), m1);
            m2 = _mm512_max_ps(_mm512_loadu_ps(t.add((v + 2) * NP + o)), m2);
            m3 = _mm512_max_ps(_mm512_loadu_ps(t.add((v + 3) * NP + o)), m3);
            v += 4;
        }
        while v < vn {
            m0 = _mm512_max_ps(_mm512_loadu_ps(t.add(v * NP + o)), m0);
            v += 1;
        }
        let mx = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
        let m_old = _mm512_loadu_ps(l.m.as_ptr().add(o));
        let m = _mm512_max_ps(mx, m_old);
        let rising = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, m_old) & live;
        _mm512_storeu_ps(l.m.as_mut_ptr().add(o), m);
        if rising != 0 {
            let old: [f32; 16] = std::mem::transmute(m_old);
            for i in bits(rising) {
                if l.sum[o + i] > 0.0 {
                    l.sum[o + i] *= ((old[i] as f64 - l.m[o + i] as f64) * fp.inv_t).exp();
                }
            }
        }
        // 2^t, t = (x - m)·scale2 ≥ -126 (`max(lo, t)` keeps a NaN t), as 2^n · p(t - n).
        let exp2 = |x: __m512| {
            let e = _mm512_max_ps(lo, _mm512_mul_ps(_mm512_sub_ps(x, m), s2));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(e);
            let f = _mm512_sub_ps(e, n);
            let mut p = _mm512_fmadd_ps(c5, f, c4);
            p = _mm512_fmadd_ps(p, f, c3);
            p = _mm512_fmadd_ps(p, f, c2);
            p = _mm512_fmadd_ps(p, f, c1);
            p = _mm512_fmadd_ps(p, f, one);
            _mm512_scalef_ps(p, n)
        };
        let mut acc = _mm512_setzero_ps();
        // Candidates, when some lane's tile max passes its threshold: the same loop records
        // each row's lanes above the (tile-start) thresholds — a mask per row and the list of
        // rows with any — branch-free, beside the exp's vector work; they are pushed after,
        // each checked against its lane's current threshold.
        let thr = _mm512_loadu_ps(l.thr.as_ptr().add(o));
        let mut hits = 0;
        if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(mx, thr) & live != 0 {
            for v in 0..vn {
                let x = _mm512_loadu_ps(t.add(v * NP + o));
                acc = _mm512_add_ps(acc, exp2(x));
                let hit = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, thr) & live;
                stage.masks[v] = hit;
                stage.rows[hits] = v as u16;
                hits += (hit != 0) as usize;
            }
        } else {
            for v in 0..vn {
                acc = _mm512_add_ps(acc, exp2(_mm512_loadu_ps(t.add(v * NP + o))));
            }
        }
        let acc: [f32; 16] = std::mem::transmute(acc);
        for i in bits(live) {
            l.sum[o + i] += acc[i] as f64;
        }
        for &v in &stage.rows[..hits] {
            let v = v as usize;
            for i in bits(stage.masks[v]) {
                let x = tile[v * NP + o + i];
                if x <= l.thr[o + i] {
                    continue;
                }
                let row = &mut st[o + i];
                if row.push_candidate(x, (v0 + v) as u32, fp) {
                    l.thr[o + i] = row.thr;
                }
            }
        }
        if s.ranks {
            let z = _mm512_loadu_ps(zt.as_ptr().add(o));
            let mut ge = _mm512_loadu_si512(l.ge.as_ptr().add(o) as *const _);
            let inc = _mm512_set1_epi32(1);
            for v in 0..vn {
                let x = _mm512_loadu_ps(t.add(v * NP + o));
                let k = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, z);
                ge = _mm512_mask_add_epi32(ge, k, ge, inc);
            }
            _mm512_storeu_si512(l.ge.as_mut_ptr().add(o) as *mut _, ge);
        }
    }
}

/// [`fold_tile`] on AVX2 with FMA, a quarter of the panel (8 lanes) at a time: the same
/// operations per lane in the same order, so the same bits. `2^n` is built in the exponent's
/// bits (n ≥ −126: a normal number) and multiplied in, the one rounding `scalef` makes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn fold_tile_avx2(
    s: &Shared<'_>,
    l: &mut Lanes,
    st: &mut [RowFold],
    (tile, v0): (&[f32], usize),
    zt: &[f32],
    stage: &mut Stage,
) {
    let fp = &s.fp;
    let vn = tile.len() / NP;
    let [c1, c2, c3, c4, c5] = crate::simd::EXP2_COEFFS.map(|c| _mm256_set1_ps(c));
    let (one, lo, s2) = (
        _mm256_set1_ps(1.0),
        _mm256_set1_ps(-126.0),
        _mm256_set1_ps(fp.scale2),
    );
    let bias = _mm256_set1_epi32(127);
    let t = tile.as_ptr();
    let lanes = |x: __m256| _mm256_movemask_ps(x) as u16;
    for o in [0, 8, 16, 24] {
        let live = ((l.live >> o) & 0xff) as u16;
        if live == 0 {
            continue;
        }
        // The tile's max per lane (NaNs ignored: `max(x, acc)` keeps `acc` for a NaN `x`).
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let (mut m0, mut m1, mut m2, mut m3) = (ninf, ninf, ninf, ninf);
        let mut v = 0;
        while v + 4 <= vn {
            m0 = _mm256_max_ps(_mm256_loadu_ps(t.add(v * NP + o)), m0);
            m1 = _mm256_max_ps(_mm256_loadu_ps(t.add((v + 1) * NP + o)), m1);
            m2 = _mm256_max_ps(_mm256_loadu_ps(t.add((v + 2) * NP + o)), m2);
            m3 = _mm256_max_ps(_mm256_loadu_ps(t.add((v + 3) * NP + o)), m3);
            v += 4;
        }
        while v < vn {
            m0 = _mm256_max_ps(_mm256_loadu_ps(t.add(v * NP + o)), m0);
            v += 1;
        }
        let mx = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
        let m_old = _mm256_loadu_ps(l.m.as_ptr().add(o));
        let m = _mm256_max_ps(mx, m_old);
        let rising = lanes(_mm256_cmp_ps::<_CMP_GT_OQ>(m, m_old)) & live;
        _mm256_storeu_ps(l.m.as_mut_ptr().add(o), m);
        if rising != 0 {
            let old: [f32; 8] = std::mem::transmute(m_old);
            for i in bits(rising) {
                if l.sum[o + i] > 0.0 {
                    l.sum[o + i] *= ((old[i] as f64 - l.m[o + i] as f64) * fp.inv_t).exp();
                }
            }
        }
        // 2^t, t = (x - m)·scale2 ≥ -126 (`max(lo, t)` keeps a NaN t), as 2^n · p(t - n).
        let exp2 = |x: __m256| {
            let e = _mm256_max_ps(lo, _mm256_mul_ps(_mm256_sub_ps(x, m), s2));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(e);
            let f = _mm256_sub_ps(e, n);
            let mut p = _mm256_fmadd_ps(c5, f, c4);
            p = _mm256_fmadd_ps(p, f, c3);
            p = _mm256_fmadd_ps(p, f, c2);
            p = _mm256_fmadd_ps(p, f, c1);
            p = _mm256_fmadd_ps(p, f, one);
            let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), bias));
            _mm256_mul_ps(p, _mm256_castsi256_ps(pow))
        };
        let mut acc = _mm256_setzero_ps();
        // Candidates as in `fold_tile`: masks per row and the rows with any, pushed after.
        let thr = _mm256_loadu_ps(l.thr.as_ptr().add(o));
        let mut hits = 0;
        if lanes(_mm256_cmp_ps::<_CMP_GT_OQ>(mx, thr)) & live != 0 {
            for v in 0..vn {
                let x = _mm256_loadu_ps(t.add(v * NP + o));
                acc = _mm256_add_ps(acc, exp2(x));
                let hit = lanes(_mm256_cmp_ps::<_CMP_GT_OQ>(x, thr)) & live;
                stage.masks[v] = hit;
                stage.rows[hits] = v as u16;
                hits += (hit != 0) as usize;
            }
        } else {
            for v in 0..vn {
                acc = _mm256_add_ps(acc, exp2(_mm256_loadu_ps(t.add(v * NP + o))));
            }
        }
        let acc: [f32; 8] = std::mem::transmute(acc);
        for i in bits(live) {
            l.sum[o + i] += acc[i] as f64;
        }
        for &v in &stage.rows[..hits] {
            let v = v as usize;
            for i in bits(stage.masks[v]) {
                let x = tile[v * NP + o + i];
                if x <= l.thr[o + i] {
                    continue;
                }
                let row = &mut st[o + i];
                if row.push_candidate(x, (v0 + v) as u32, fp) {
                    l.thr[o + i] = row.thr;
                }
            }
        }
        if s.ranks {
            // A lane's compare is all ones (−1) where x ≥ its target's logit: subtracted, +1.
            let z = _mm256_loadu_ps(zt.as_ptr().add(o));
            let ge_at = l.ge.as_mut_ptr().add(o) as *mut __m256i;
            let mut ge = _mm256_loadu_si256(ge_at);
            for v in 0..vn {
                let x = _mm256_loadu_ps(t.add(v * NP + o));
                let k = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(x, z));
                ge = _mm256_sub_epi32(ge, k);
            }
            _mm256_storeu_si256(ge_at, ge);
        }
    }
}

/// Reads the panel's targets and candidates whose columns are in this tile.
fn read_picks(l: &mut Lanes, st: &mut [RowFold], picks: &[Pick], tile: &[f32], v0: usize) {
    let end = v0 + tile.len() / NP;
    while let Some(p) = picks.get(l.cursor).filter(|p| (p.id as usize) < end) {
        let x = tile[(p.id as usize - v0) * NP + p.lane as usize];
        let row = &mut st[p.lane as usize];
        match p.slot {
            TARGET => row.target = Some(x),
            c => row.cands[c as usize] = x,
        }
        l.cursor += 1;
    }
}

/// The indices of the set bits of `mask`, lowest first.
fn bits(mut mask: u16) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (mask != 0).then(|| {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            i
        })
    })
}

#[cfg(test)]
mod tests;
