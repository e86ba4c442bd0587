//! Vectorisable f32 row passes, run at the CPU's widest [`Simd`] level (the same bits at every
//! level: no fused multiply-adds, fixed lane counts).

use xdistill_cpu_kernels::simd::{self, exp_nonpos, Simd};
use xdistill_cpu_kernels::simd_dispatch;

/// Values per f32 partial sum of [`sum_exp`] (each lane then adds ≤ 128 terms ≤ 1).
const BLOCK: usize = 2048;

/// The largest value of `x` (NaNs ignored; -inf for an empty row).
pub fn max(x: &[f32]) -> f32 {
    max_at(Simd::current(), x)
}

/// `Σ e^{x_i − m}` for `m ≥ max(x)`: f32 lanes within a block of `BLOCK`, f64 across.
pub fn sum_exp(x: &[f32], m: f32) -> f64 {
    sum_exp_at(Simd::current(), x, m)
}

/// `out_i = scale · e^{x_i − shift}` for `shift ≥ max(x)`.
pub fn exp_scaled(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    exp_scaled_at(Simd::current(), x, shift, scale, out)
}

simd_dispatch!(pub(crate) fn max_at(x: &[f32]) -> f32 = max_body);
simd_dispatch!(pub(crate) fn sum_exp_at(x: &[f32], m: f32) -> f64 = sum_exp_body);
simd_dispatch!(pub(crate) fn exp_scaled_at(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) = exp_scaled_body);

#[inline(always)]
fn max_body(x: &[f32]) -> f32 {
    simd::max(x)
}

#[inline(always)]
fn sum_exp_body(x: &[f32], m: f32) -> f64 {
    x.chunks(BLOCK)
        .map(|block| simd::sum_exp2(block, m, std::f32::consts::LOG2_E))
        .sum()
}

#[inline(always)]
fn exp_scaled_body(x: &[f32], shift: f32, scale: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp_nonpos(v - shift) * scale;
    }
}

#[cfg(test)]
mod tests {
    use crate::gather::row_lse;
    use crate::vmath;
    use rayon::prelude::*;

    /// Speed figure, not a check: the f32 row passes of the fused log-softmax (forward: max +
    /// Σexp; backward: the softmax write) against the scalar libm loops they replaced, side by
    /// side. `cargo test --release -p xdistill-kernels --lib kernel_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn kernel_speed() {
        let (rows, v) = (64, 151_669);
        let x: Vec<f32> = (0..rows * v)
            .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 500.0) - 12.0)
            .collect();
        let mut out = vec![0f32; x.len()];
        let per = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e9 / (rows * v) as f64;
        println!(
            "SIMD level: {}",
            xdistill_cpu_kernels::simd::Simd::current().name()
        );
        for round in 0..2 {
            let t = std::time::Instant::now();
            let old: f64 = x
                .par_chunks(v)
                .map(|r| {
                    let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let s: f64 = r.iter().map(|&y| (y - m).exp() as f64).sum();
                    m as f64 + s.ln()
                })
                .sum();
            let old_t = per(t);
            let t = std::time::Instant::now();
            let new: f64 = x.par_chunks(v).map(row_lse::<f32>).sum();
            let new_t = per(t);
            println!(
                "round {round}: logsumexp  libm {old_t:.2} ns/logit, vectorised {new_t:.2} ({:.1e})",
                (old - new).abs() / old.abs()
            );
            let t = std::time::Instant::now();
            out.par_chunks_mut(v)
                .zip(x.par_chunks(v))
                .for_each(|(o, r)| {
                    for (o, &y) in o.iter_mut().zip(r) {
                        *o = (y - 8.0).exp() * -0.5;
                    }
                });
            let old_t = per(t);
            let t = std::time::Instant::now();
            out.par_chunks_mut(v)
                .zip(x.par_chunks(v))
                .for_each(|(o, r)| vmath::exp_scaled(r, 8.0, -0.5, o));
            println!(
                "round {round}: softmax write  libm {old_t:.2} ns/logit, vectorised {:.2}",
                per(t)
            );
        }
    }

    /// The vectorised f32 passes against f64 sums, and the same bits at every SIMD level.
    #[test]
    fn vmath_matches_f64_at_every_level() {
        use xdistill_cpu_kernels::simd::Simd;
        // A vocabulary-sized row with a remainder past the lanes and blocks.
        let x: Vec<f32> = (0..151_669)
            .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 500.0) - 12.0)
            .collect();
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: f64 = x.iter().map(|&v| (v as f64 - m as f64).exp()).sum();
        let mut out = vec![0f32; x.len()];
        let mut outs = Vec::new();
        for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
            assert_eq!(vmath::max_at(level, &x), m);
            let got = vmath::sum_exp_at(level, &x, m);
            assert!(
                (got / want - 1.0).abs() < 1e-6,
                "{level:?}: {got} vs {want}"
            );
            assert_eq!(
                got.to_bits(),
                vmath::sum_exp_at(Simd::Baseline, &x, m).to_bits()
            );
            vmath::exp_scaled_at(level, &x, m + 0.5, -3.0, &mut out);
            for (&o, &v) in out.iter().zip(&x).step_by(97) {
                let w = -3.0 * (v as f64 - (m + 0.5) as f64).exp();
                assert!((o as f64 / w - 1.0).abs() < 2e-6, "{level:?}: {o} vs {w}");
            }
            outs.push(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        assert!(outs.windows(2).all(|w| w[0] == w[1]), "levels differ");
        assert_eq!(vmath::max(&[]), f32::NEG_INFINITY);
    }
}
