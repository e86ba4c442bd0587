//! `x · Wᵀ` in f32 on the CPU for inference: the linear layers' matmul (`W` `[out, in]` as
//! Hugging Face stores it) and the micro-kernel the teacher's fused LM head shares.
//!
//! Rows of `x` go in panels of [`NP`] (transposed once to `[in, NP]`); an [`MR`] × [`NP`]
//! register-blocked micro-kernel reads `MR` rows of `W` in place (no packed copy). Each dot
//! product is summed in blocks of [`KB`] inputs: one fused multiply-add per input, in order,
//! into a fresh sum per block, and the blocks' sums added in order ([`dot_blocked`] is the
//! scalar form). A single running f32 sum over K = 576..1536 inputs loses about 3× more than
//! the blocked order (issue 49), which costs one add per block. A row's result depends only on
//! that row — not on its neighbours, the batch size or the thread count — which keeps the
//! teacher's answers batch-invariant by construction. AVX-512 and AVX2 run hand-written
//! kernels (the same bits), baseline x86-64 a portable one without fused multiply-adds (its own
//! bits, the same order).

use crate::simd::Simd;
use rayon::prelude::*;

/// Rows of `x` per panel: two 16-lane vectors.
pub const NP: usize = 32;
/// Rows of `W` per micro-tile: `MR × 2` accumulators stay in registers.
pub const MR: usize = 8;
/// Panels per job: each tile of `W` (or of the LM head), once in cache, serves this many panels.
pub const GROUP: usize = 4;
/// Inputs per block of a dot product: each block is summed from zero, then added to the total.
pub const KB: usize = 64;

/// Whether this CPU runs the hand-written kernels (AVX-512F): the LM head's needs them;
/// [`matmul_nt`] runs at every level.
pub fn available() -> bool {
    Simd::current() == Simd::Avx512
}

/// `Σ_j w[j] · x[j]` in the kernels' order: fused multiply-adds in order within each block of
/// [`KB`], the blocks' sums added in order (the AVX-512 and AVX2 kernels' bits); `fused:
/// false` rounds each product first (the baseline kernel's bits).
pub fn dot_blocked(w: &[f32], x: &[f32], fused: bool) -> f32 {
    let mut total = 0f32;
    for (b, (wb, xb)) in w.chunks(KB).zip(x.chunks(KB)).enumerate() {
        let s = wb.iter().zip(xb).fold(
            0f32,
            |s, (&w, &x)| {
                if fused {
                    w.mul_add(x, s)
                } else {
                    w * x + s
                }
            },
        );
        total = if b == 0 { s } else { total + s };
    }
    total
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

/// The micro-tiles' contract, checked once per tile (the unsafe kernels read through raw
/// pointers after it): `at` holds a panel's `k` inputs, `out` an `[MR, NP]` tile, and every
/// row of `w` they read is whole. With `k = 0` the tile is zeros and there is nothing to sum.
#[inline(always)]
fn tile_has_work(at: &[f32], w: &[f32], rows: &[usize; MR], k: usize, out: &mut [f32]) -> bool {
    assert!(at.len() >= k * NP && out.len() >= MR * NP);
    assert!(rows.iter().all(|&r| (r + 1) * k <= w.len()));
    if k == 0 {
        out[..MR * NP].fill(0.0);
    }
    k > 0
}

/// `out[r, p] = Σ_j w[rows[r], j] · at[j, p]` for `MR` rows of `w` and a panel's `NP` rows
/// (`at`: `[k, NP]`, `out`: `[MR, NP]`), in [`dot_blocked`]'s order (blocks of [`KB`]).
///
/// # Safety
/// The CPU must have AVX-512F ([`available`]); call it from a function compiled with
/// `#[target_feature(enable = "avx512f")]` so that it is inlined there.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn micro_tile(at: &[f32], w: &[f32], rows: [usize; MR], k: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    if !tile_has_work(at, w, &rows, k, out) {
        return;
    }
    let wr: [*const f32; MR] = rows.map(|r| w.as_ptr().add(r * k));
    let a = at.as_ptr();
    let o = out.as_mut_ptr();
    // The blocks' running sums stay in `out` (in L1): 16 zmm accumulators per block, plus
    // one load, add and store each per block.
    for j0 in (0..k).step_by(KB) {
        let mut acc = [_mm512_setzero_ps(); 2 * MR];
        for j in j0..(j0 + KB).min(k) {
            let a0 = _mm512_loadu_ps(a.add(j * NP));
            let a1 = _mm512_loadu_ps(a.add(j * NP + 16));
            for r in 0..MR {
                let b = _mm512_set1_ps(*wr[r].add(j));
                acc[2 * r] = _mm512_fmadd_ps(b, a0, acc[2 * r]);
                acc[2 * r + 1] = _mm512_fmadd_ps(b, a1, acc[2 * r + 1]);
            }
        }
        // acc[i] holds out[i·16 .. i·16 + 16] (row i / 2, lanes (i % 2)·16 ..).
        for (i, &v) in acc.iter().enumerate() {
            let p = o.add(i * 16);
            let v = if j0 == 0 {
                v
            } else {
                _mm512_add_ps(_mm512_loadu_ps(p), v)
            };
            _mm512_storeu_ps(p, v);
        }
    }
}

/// [`micro_tile`] for AVX2 with FMA, in the same order (the same bits): two rows of `w` at a
/// time against the panel's four 8-lane vectors, eight accumulators held in registers (as many
/// as two FMA pipes of latency 4 keep busy), block by block so that the panel's block stays in
/// L1. Written out because the portable form, compiled for AVX2, kept its accumulators on the
/// stack: 30–39 GFLOP/s on 2 Zen cores where candle's gemm ran at 84–125 (2026-12-04).
///
/// # Safety
/// The CPU must have AVX2 and FMA; call it from a function compiled with
/// `#[target_feature(enable = "avx2,fma")]` so that it is inlined there.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn micro_tile_avx2(at: &[f32], w: &[f32], rows: [usize; MR], k: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    if !tile_has_work(at, w, &rows, k, out) {
        return;
    }
    let a = at.as_ptr();
    let o = out.as_mut_ptr();
    for j0 in (0..k).step_by(KB) {
        let j1 = (j0 + KB).min(k);
        for pair in 0..MR / 2 {
            let w0 = w.as_ptr().add(rows[2 * pair] * k);
            let w1 = w.as_ptr().add(rows[2 * pair + 1] * k);
            // acc[v]: row 2·pair at panel rows 8v..8v + 8; acc[4 + v]: row 2·pair + 1.
            let mut acc = [_mm256_setzero_ps(); 8];
            for j in j0..j1 {
                let col = a.add(j * NP);
                let b0 = _mm256_broadcast_ss(&*w0.add(j));
                let b1 = _mm256_broadcast_ss(&*w1.add(j));
                for v in 0..4 {
                    let x = _mm256_loadu_ps(col.add(8 * v));
                    acc[v] = _mm256_fmadd_ps(b0, x, acc[v]);
                    acc[4 + v] = _mm256_fmadd_ps(b1, x, acc[4 + v]);
                }
            }
            // The two rows are adjacent in `out` ([MR, NP]): acc[i] is out[2·pair·NP + 8i ..].
            let dst = o.add(2 * pair * NP);
            for (i, &v) in acc.iter().enumerate() {
                let p = dst.add(8 * i);
                let v = if j0 == 0 {
                    v
                } else {
                    _mm256_add_ps(_mm256_loadu_ps(p), v)
                };
                _mm256_storeu_ps(p, v);
            }
        }
    }
}

/// [`micro_tile`] in portable Rust for baseline x86-64 (and other targets): a rounded product
/// and an add per input (no fused multiply-add there), in the same order. Two rows of `w` at a
/// time against half a panel ([`HALF`] rows): 32 accumulators, eight SSE registers, so that
/// they stay in registers (a whole panel's 64 spilled to the stack), block by block so that
/// the panel's block stays in L1.
#[inline(always)]
fn portable_tile(at: &[f32], w: &[f32], rows: [usize; MR], k: usize, out: &mut [f32]) {
    if !tile_has_work(at, w, &rows, k, out) {
        return;
    }
    for j0 in (0..k).step_by(KB) {
        let j1 = (j0 + KB).min(k);
        let cols = &at[j0 * NP..j1 * NP];
        for pair in 0..MR / 2 {
            let (r0, r1) = (rows[2 * pair], rows[2 * pair + 1]);
            let (w0, w1) = (&w[r0 * k + j0..r0 * k + j1], &w[r1 * k + j0..r1 * k + j1]);
            for h in (0..NP).step_by(HALF) {
                let mut acc = [[0f32; HALF]; 2];
                for ((&b0, &b1), col) in w0.iter().zip(w1).zip(cols.chunks_exact(NP)) {
                    let col: &[f32; HALF] = col[h..h + HALF].try_into().expect("HALF lanes");
                    for p in 0..HALF {
                        acc[0][p] += b0 * col[p];
                        acc[1][p] += b1 * col[p];
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    let at = (2 * pair + i) * NP + h;
                    for (d, &v) in out[at..at + HALF].iter_mut().zip(a) {
                        *d = if j0 == 0 { v } else { *d + v };
                    }
                }
            }
        }
    }
}

/// Panel rows per pass of [`portable_tile`].
const HALF: usize = NP / 2;

/// `x · wᵀ`: `x` `[n, k]`, `w` `[o, k]`, both row-major → `[n, o]`, at the SIMD level in use
/// ([`Simd::current`]). Jobs are (tile of `w`'s rows × group of panels), in parallel.
pub fn matmul_nt(x: &[f32], w: &[f32], k: usize, o: usize) -> Vec<f32> {
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
    let level = Simd::current();
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
        // SAFETY: jobs write disjoint rectangles of `out` (their own columns of their own
        // panels' rows), which outlives them; `run_job` never runs above `level`.
        unsafe { run_job(level, &job, d.0) }
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

/// Writes `out[r, c]` for the job's rows `r` and columns `c`, with the kernel of `level`.
///
/// # Safety
/// `out` is `[n, o]` and no other thread writes the job's rectangle.
unsafe fn run_job(level: Simd, j: &Job<'_>, out: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn avx512(j: &Job<'_>, out: *mut f32) {
            // SAFETY: this function runs only with AVX-512F (below).
            job_body(j, out, |at, w, rows, k, t| unsafe {
                micro_tile(at, w, rows, k, t)
            })
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(j: &Job<'_>, out: *mut f32) {
            // A closure, not a function item: a closure is compiled with this function's
            // features, so the tile's intrinsics are inlined here; a function item would be
            // called through a `Fn::call` shim compiled without them (out-of-line intrinsics,
            // or `fmaf` calls, 50x slower, whenever the shim was not inlined).
            // SAFETY: this function runs only with AVX2 and FMA (below).
            job_body(j, out, |at, w, rows, k, t| unsafe {
                micro_tile_avx2(at, w, rows, k, t)
            })
        }
        // SAFETY: never above `Simd::current()`, the level whose features the CPU has.
        match level.min(Simd::current()) {
            Simd::Avx512 => return avx512(j, out),
            Simd::Avx2 => return avx2(j, out),
            Simd::Baseline => {}
        }
    }
    let _ = level;
    // The function item itself: at the baseline level there are no features for a shim to lose.
    job_body(j, out, portable_tile)
}

/// [`run_job`]'s loops around a micro-tile kernel `tile(at, w, rows, k, out)`.
#[inline(always)]
unsafe fn job_body(
    j: &Job<'_>,
    out: *mut f32,
    tile_fn: impl Fn(&[f32], &[f32], [usize; MR], usize, &mut [f32]),
) {
    let (k, last) = (j.k, j.o - 1);
    let mut tile = [0f32; MR * NP];
    for q in j.panels.clone() {
        let at = &j.at[q * k * NP..(q + 1) * k * NP];
        let real = (j.n - q * NP).min(NP);
        for c0 in j.cols.clone().step_by(MR) {
            let rows: [usize; MR] = std::array::from_fn(|r| (c0 + r).min(last));
            tile_fn(at, j.w, rows, k, &mut tile);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lcg_noise as noise;

    /// The bits the kernel of the level in use gives: fused multiply-adds from AVX2 up.
    fn fused() -> bool {
        Simd::current() >= Simd::Avx2
    }

    /// Against an f64 naive loop, over shapes with partial panels, partial micro-tiles,
    /// partial blocks of K and tiles, every tile width; each row's bits equal that row computed
    /// alone and [`dot_blocked`] exactly, at the SIMD level in use.
    #[test]
    fn matmul_nt_matches_f64_and_rows_are_independent() {
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
                    let want = dot_blocked(wc, xr, fused());
                    let g = got[r * o + c];
                    assert_eq!(g.to_bits(), want.to_bits(), "({n}, {k}, {o}) [{r}, {c}]");
                    let scale: f64 = xr.iter().zip(wc).map(|(&a, &b)| (a * b).abs() as f64).sum();
                    assert!((g as f64 - exact).abs() <= k as f64 * f32::EPSILON as f64 * scale);
                }
            }
        }
    }

    /// Issue 49: on a real-size layer (SmolLM2-135M's `down_proj`, K = 1536; weights and
    /// inputs with a common offset, as a trained layer's correlated products have), the error
    /// against an f64 naive loop stays below what one running f32 sum over K gives.
    #[test]
    fn matmul_nt_is_accurate_on_a_real_size_layer() {
        let (n, k, o) = (32usize, 1536usize, 192usize);
        let x: Vec<f32> = noise(11, n * k, 2.0).iter().map(|v| v + 0.3).collect();
        let w: Vec<f32> = noise(12, o * k, 0.1).iter().map(|v| v + 0.01).collect();
        let got = matmul_nt(&x, &w, k, o);
        let (mut err, mut seq_err, mut size) = (0f64, 0f64, 0f64);
        for r in 0..n {
            for c in 0..o {
                let (xr, wc) = (&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]);
                let exact: f64 = xr.iter().zip(wc).map(|(&a, &b)| a as f64 * b as f64).sum();
                let seq = wc.iter().zip(xr).fold(0f32, |s, (&b, &a)| b.mul_add(a, s));
                err = err.max((got[r * o + c] as f64 - exact).abs());
                seq_err = seq_err.max((seq as f64 - exact).abs());
                size = size.max(exact.abs());
            }
        }
        eprintln!("worst error {err:.3e}, one running sum {seq_err:.3e}, |y| up to {size:.2}");
        assert!(
            err < 4e-6,
            "worst error {err:.3e} (a running sum: {seq_err:.3e})"
        );
    }
}
