//! Times the linear layers' f32 CPU matmul `x [1, T, in] · Wᵀ` (`W [out, in]`) in the
//! shapes a teacher runs, candle_nn's `Linear` (candle's gemm) against [`matmul_nt`] (the
//! blocked kernel inference uses, at the SIMD level in use): warm (one weight, in cache) and
//! cold (a round of 12 different weights, more than the L3 holds, as a forward through many
//! layers reads them).
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p xdistill-shared --example matmul_speed`
use candle_core::{Device, Module, Tensor};
use std::time::Instant;
use xdistill_cpu_kernels::matmul::matmul_nt;

/// Best wall time of `reps` runs of `f`, after one warm-up run.
fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

// The allocator of every xdistill binary: jemalloc with transparent huge pages.
xdistill_shared::global_allocator!();

fn main() -> anyhow::Result<()> {
    // `matmul_nt` runs at every SIMD level (`$XDISTILL_SIMD` caps it).
    println!(
        "SIMD level: {}",
        xdistill_cpu_kernels::simd::Simd::current().name()
    );
    let dev = Device::Cpu;
    println!("rows × in → out | warm: candle, matmul_nt | cold: candle, matmul_nt (GFLOP/s)");
    for (t, i, o) in [
        (127usize, 1024usize, 1024usize),
        (127, 1024, 3072),
        (127, 3072, 1024),
        (512, 1024, 3072),
        (32, 1024, 3072),
        (127, 128, 256),
        (127, 256, 128),
    ] {
        let x = Tensor::randn(0f32, 1.0, (1, t, i), &dev)?;
        let ws = (0..12)
            .map(|_| Tensor::randn(0f32, 0.02, (o, i), &dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let lins: Vec<_> = ws
            .iter()
            .map(|w| candle_nn::Linear::new(w.clone(), None))
            .collect();
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let wv = ws
            .iter()
            .map(|w| w.flatten_all()?.to_vec1::<f32>())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let gflop = 2.0 * (t * i * o) as f64 / 1e9;
        let candle = |n: usize| {
            let s = best_of(3, || {
                for l in &lins[..n] {
                    l.forward(&x).expect("candle matmul");
                }
            });
            gflop * n as f64 / s
        };
        let ours = |n: usize| {
            let s = best_of(3, || {
                for w in &wv[..n] {
                    matmul_nt(&xs, w, i, o);
                }
            });
            gflop * n as f64 / s
        };
        println!(
            "{t} × {i} → {o} | warm: {:6.1}, {:6.1} | cold: {:6.1}, {:6.1}",
            candle(1),
            ours(1),
            candle(12),
            ours(12)
        );
    }
    Ok(())
}
