//! `x · Wᵀ` in f32 on AVX-512 for inference: the linear layers' matmul (`W` `[out, in]` as
//! Hugging Face stores it) and the micro-kernel the teacher's fused LM head shares.
//!
//! Rows of `x` go in panels of [`NP`] (transposed once to `[in, NP]`); an [`MR`] × [`NP`]
//! register-blocked micro-kernel (16 zmm accumulators) reads `MR` rows of `W` in place (no
//! packed copy) and sums each dot product with one fused multiply-add per input unit, in order.
//! So a row's result depends only on that row — not on its neighbours, the batch size or the
//! thread count — which keeps the teacher's answers batch-invariant by construction.

use crate::simd::Simd;
use rayon::prelude::*;

/// Rows of `x` per panel: two 16-lane vectors.
pub const NP: usize = 32;
/// Rows of `W` per micro-tile: `MR × 2` accumulators stay in registers.
pub const MR: usize = 8;
/// Panels per job: each tile of `W` (or of the LM head), once in cache, serves this many panels.
pub const GROUP: usize = 4;

/// Whether this CPU runs the kernels (AVX-512F).
pub fn available() -> bool {
    Simd::current() == Simd::Avx512
}

/// Rows of `W` per tile for input size `k`: the tile (`rows × k` f32) stays in L2 beside a
/// panel.
pub fn tile_rows(k: usize) -> usize {
    match k {
        0..=512 => 128,
        513..=2048 => 64,
        _ => 32,
    }
}

/// The rows `[n, k]` of `x` as panels `[panels, k, NP]`, zeros past the last row.
pub fn transpose_panels(x: &[f32], k: usize, panels: usize) -> Vec<f32> {
    let mut at = vec![0f32; panels * k * NP];
    for (r, row) in x.chunks_exact(k).enumerate() {
        let base = (r / NP) * k * NP + r % NP;
        for (j, &v) in row.iter().enumerate() {
            at[base + j * NP] = v;
        }
    }
    at
}

/// `out[r, p] = Σ_j w[rows[r], j] · at[j, p]` for `MR` rows of `w` and a panel's `NP` rows
/// (`at`: `[k, NP]`, `out`: `[MR, NP]`), one fused multiply-add per `j` in order.
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]); call it from a function compiled with
/// `#[target_feature(enable = "avx512f")]` so that it is inlined there.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn micro_tile(at: &[f32], w: &[f32], rows: [usize; MR], k: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(at.len() >= k * NP && out.len() >= MR * NP);
    assert!(rows.iter().all(|&r| (r + 1) * k <= w.len()));
    let wr: [*const f32; MR] = rows.map(|r| w.as_ptr().add(r * k));
    let a = at.as_ptr();
    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    for j in 0..k {
        let a0 = _mm512_loadu_ps(a.add(j * NP));
        let a1 = _mm512_loadu_ps(a.add(j * NP + 16));
        for r in 0..MR {
            let b = _mm512_set1_ps(*wr[r].add(j));
            acc[2 * r] = _mm512_fmadd_ps(b, a0, acc[2 * r]);
            acc[2 * r + 1] = _mm512_fmadd_ps(b, a1, acc[2 * r + 1]);
        }
    }
    let o = out.as_mut_ptr();
    for (r, pair) in acc.chunks_exact(2).enumerate() {
        _mm512_storeu_ps(o.add(r * NP), pair[0]);
        _mm512_storeu_ps(o.add(r * NP + 16), pair[1]);
    }
}

/// `x · wᵀ`: `x` `[n, k]`, `w` `[o, k]`, both row-major → `[n, o]`. Call only when
/// [`available`]. Jobs are (tile of `w`'s rows × group of panels), in parallel.
pub fn matmul_nt(x: &[f32], w: &[f32], k: usize, o: usize) -> Vec<f32> {
    assert!(available(), "the matmul kernel needs AVX-512");
    assert!(k > 0 && x.len().is_multiple_of(k), "x is [n, k]");
    assert_eq!(w.len(), o * k, "w is [o, k]");
    let n = x.len() / k;
    let mut out = vec![0f32; n * o];
    if n == 0 || o == 0 {
        return out;
    }
    let panels = n.div_ceil(NP);
    let at = transpose_panels(x, k, panels);
    let vt = tile_rows(k);
    let jobs: Vec<(usize, usize)> = (0..o.div_ceil(vt))
        .flat_map(|t| (0..panels.div_ceil(GROUP)).map(move |g| (t * vt, g * GROUP)))
        .collect();
    let dst = Dst(out.as_mut_ptr());
    jobs.par_iter().for_each(|&(v0, q0)| {
        let d = &dst;
        let job = Job {
            at: &at,
            w,
            k,
            o,
            n,
            cols: v0..(v0 + vt).min(o),
            panels: q0..(q0 + GROUP).min(panels),
        };
        // SAFETY: AVX-512F was checked above; jobs write disjoint rectangles of `out`
        // (their own columns of their own panels' rows), which outlives them.
        unsafe { run_job(&job, d.0) }
    });
    out
}

/// The output buffer, written by the jobs in disjoint rectangles.
struct Dst(*mut f32);
// SAFETY: each job writes only its own rectangle (see `matmul_nt`).
unsafe impl Sync for Dst {}

/// One job of [`matmul_nt`]: columns `cols` (rows of `w`) for the rows of `panels`.
struct Job<'a> {
    at: &'a [f32],
    w: &'a [f32],
    k: usize,
    o: usize,
    n: usize,
    cols: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
}

/// The L2 size the prefetch is planned for: 1 MiB a core on Zen 4, 1–2 MiB on recent Intel
/// server cores.
const L2_BYTES: usize = 1 << 20;

/// Whether a job may bring the next tile of `W` (`rows × k`) into L2 beside the current tile
/// and its group's panels: all three within half the L2 (true at k = 128 and 256; at
/// k = 1024, two tiles and four panels would fill it and push the panels out).
pub fn next_tile_fits_l2(rows: usize, k: usize) -> bool {
    (2 * rows + GROUP * NP) * k * std::mem::size_of::<f32>() <= L2_BYTES / 2
}

/// Asks the L2 for rows `rows` of `w` (`[_, k]` row-major) ahead of their first use, a cache
/// line at a time. The LM-head kernel reads each tile of the head from memory with its first
/// panel, eight rows at once, which the hardware prefetcher follows only after each row's
/// first misses (H = 128: the head's matmul 84% → 97% of the FMA peak, without the fold).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch_rows(w: &[f32], rows: std::ops::Range<usize>, k: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    for r in rows {
        for line in w[r * k..(r + 1) * k].chunks(16) {
            // SAFETY: a prefetch only hints the cache; the address is inside `w`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr() as *const i8) };
        }
    }
}

/// Writes `out[r, c]` for the job's rows `r` and columns `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn run_job(j: &Job<'_>, out: *mut f32) {
    let (k, last) = (j.k, j.o - 1);
    let mut tile = [0f32; MR * NP];
    for q in j.panels.clone() {
        let at = &j.at[q * k * NP..(q + 1) * k * NP];
        let real = (j.n - q * NP).min(NP);
        for c0 in j.cols.clone().step_by(MR) {
            let rows: [usize; MR] = std::array::from_fn(|r| (c0 + r).min(last));
            micro_tile(at, j.w, rows, k, &mut tile);
            // [MR, NP] → rows q·NP + p, columns c0 + r.
            let width = (j.cols.end - c0).min(MR);
            for p in 0..real {
                let row = out.add((q * NP + p) * j.o + c0);
                for r in 0..width {
                    *row.add(r) = tile[r * NP + p];
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn run_job(_: &Job<'_>, _: *mut f32) {
    unreachable!("`available()` is false off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::lcg_noise as noise;

    /// Against an f64 naive loop, over shapes with partial panels, partial micro-tiles and
    /// tiles, every tile width; each row's bits equal that row computed alone and the in-order
    /// f32 fused multiply-adds exactly.
    #[test]
    fn matmul_nt_matches_f64_and_rows_are_independent() {
        if !available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        for (n, k, o) in [
            (1, 1, 1),
            (5, 16, 9),
            (33, 37, 130),
            (70, 128, 256),
            (131, 600, 67),
            (40, 2100, 41),
        ] {
            let x = noise(n as u64, n * k, 2.0);
            let w = noise(k as u64 + 7, o * k, 2.0 / (k as f32).sqrt());
            let got = matmul_nt(&x, &w, k, o);
            assert_eq!(got.len(), n * o);
            for r in 0..n {
                let alone = matmul_nt(&x[r * k..(r + 1) * k], &w, k, o);
                assert_eq!(&got[r * o..(r + 1) * o], &alone[..], "row {r} of {n}");
                for c in 0..o {
                    let (xr, wc) = (&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]);
                    let exact: f64 = xr.iter().zip(wc).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let fma = wc.iter().zip(xr).fold(0f32, |s, (&b, &a)| b.mul_add(a, s));
                    let g = got[r * o + c];
                    assert_eq!(g.to_bits(), fma.to_bits(), "({n}, {k}, {o}) [{r}, {c}]");
                    let scale: f64 = xr.iter().zip(wc).map(|(&a, &b)| (a * b).abs() as f64).sum();
                    assert!((g as f64 - exact).abs() <= k as f64 * f32::EPSILON as f64 * scale);
                }
            }
        }
    }
}
