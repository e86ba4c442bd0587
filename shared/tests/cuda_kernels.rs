//! The project's own CUDA kernels (kernels/cuda) on the GPU against references on fresh random
//! inputs: the top-k selection against f64, the multi-tensor AdamW against the CPU kernel's
//! arithmetic (bit for bit), the sums of squares and the log-softmax against f64, the fused
//! layer ops (RMSNorm, RoPE, gated activation; `model::device_ops`) and their backward against
//! their CPU reference, the head's accumulating GEMM against its reference, the gradient
//! accumulation into f32 sums against a cast and an add (bit for bit), the packed forward's
//! blocked GEMM against f64 and for invariance, and whole passes
//! through them against the composed ops. CUDA builds only; the GPU check
//! runs them (`XDISTILL_TEST_DEVICE=cuda`, `scripts/gpu-check.sh` step 1c). The same kernels'
//! logic runs on the host in the default suite (kernels/cuda/emulate).

use crate::cudnn_attention::{gpu, rng};
use candle_core::{DType, Device, Tensor};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;
use xdistill_cuda_kernels::{topk_rows, TopkArgs};

/// What one row should give: ids and values of the top k (ties by ascending id), the target's
/// log-prob, the logsumexp (f64) and the target's rank, from `z = x / t` in f32 exactly as the
/// kernel computes it (so that the order, ties included, is the same) and f64 sums.
struct Want {
    ids: Vec<u32>,
    values: Vec<f64>,
    target_lp: f64,
    lse: f64,
    rank: u32,
}

fn want(x: &[f32], valid: usize, target: usize, k: usize, t: f32, logprobs: bool) -> Want {
    let z: Vec<f32> = x[..valid].iter().map(|&v| v / t).collect();
    let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + z.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    let mut order: Vec<u32> = (0..valid as u32).collect();
    order.sort_by(|&a, &b| z[b as usize].total_cmp(&z[a as usize]).then(a.cmp(&b)));
    order.truncate(k);
    let values = order
        .iter()
        .map(|&i| z[i as usize] as f64 - if logprobs { lse } else { 0.0 })
        .collect();
    let zt = z[target];
    Want {
        ids: order,
        values,
        target_lp: zt as f64 - lse,
        lse,
        rank: z.iter().filter(|&&v| v >= zt).count() as u32,
    }
}

/// How a test row's logits are drawn.
#[derive(Debug, Clone, Copy)]
enum Rows {
    /// Uniform in ±(3 + row): bf16 and f16 round them onto few values (ties).
    Spread,
    /// One value repeated: every key ties with the k-th, taken in id order.
    Flat,
    /// All negative (keys whose low bits are ones), a tenth equal to one value.
    Negative,
}

/// The selection kernel against the f64 reference: f32, bf16 (many ties) and f16 logits, Qwen3's
/// padded vocabulary and a small odd one, k from 0 to 4096, temperature 1 (the kernels without
/// the division, and bf16's skipped radix digits) and others, log-probs and logits, rows of one
/// value and of negative values; the same bits on a second run and for a row alone (batch
/// invariance).
#[test]
fn topk_rows_equals_the_f64_reference() {
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    // rows, V, valid, k, temperature, dtype, log-probs, logits
    let cases = [
        (
            7,
            151_936,
            151_669,
            64,
            1.0f32,
            DType::BF16,
            true,
            Rows::Spread,
        ),
        (
            5,
            151_936,
            151_669,
            4096,
            0.7,
            DType::BF16,
            true,
            Rows::Spread,
        ),
        (3, 1000, 997, 1, 1.0, DType::F32, true, Rows::Spread),
        (4, 1000, 997, 997, 2.0, DType::F32, false, Rows::Spread),
        (6, 32_000, 32_000, 0, 1.0, DType::F16, true, Rows::Spread),
        (9, 50_257, 50_257, 100, 1.3, DType::F16, false, Rows::Spread),
        (2, 4096, 3000, 2048, 1.0, DType::F32, true, Rows::Spread),
        (5, 20_000, 19_999, 300, 1.0, DType::F16, true, Rows::Spread),
        (3, 20_000, 20_000, 100, 1.0, DType::BF16, true, Rows::Flat),
        (
            3,
            20_000,
            19_999,
            900,
            1.0,
            DType::BF16,
            false,
            Rows::Negative,
        ),
        (
            3,
            20_000,
            20_000,
            700,
            1.7,
            DType::F32,
            true,
            Rows::Negative,
        ),
    ];
    for (n, v, valid, k, t, dt, logprobs, rows) in cases {
        let data: Vec<f32> = (0..n * v)
            .map(|i| match rows {
                Rows::Spread => rng.random_range(-1.0f32..1.0) * (3.0 + (i / v) as f32),
                Rows::Flat => 2.5 - 3.75 * ((i / v) % 2) as f32,
                Rows::Negative if i % v % 10 == 3 => -0.75 - (i / v) as f32,
                Rows::Negative => -rng.random_range(0.5f32..4.0),
            })
            .collect();
        let x = Tensor::from_vec(data, (n, v), &dev)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        // The values the kernel reads, as f32 on the host.
        let host: Vec<f32> = x
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..valid as u32)).collect();
        let tg = Tensor::new(targets.as_slice(), &dev).unwrap();
        let args = TopkArgs {
            k,
            valid,
            temperature: t,
            logprobs,
            ranks: true,
        };
        let t0 = Instant::now();
        let got = topk_rows(&x, &tg, args).unwrap();
        dev.synchronize().unwrap();
        let took = t0.elapsed();
        let ids: Vec<u32> = got.ids.flatten_all().unwrap().to_vec1().unwrap();
        let vals: Vec<f32> = got.values.flatten_all().unwrap().to_vec1().unwrap();
        let tlp: Vec<f32> = got.target_logprobs.to_vec1().unwrap();
        let lse: Vec<f32> = got.logsumexp.to_vec1().unwrap();
        let ranks: Vec<u32> = got.target_ranks.as_ref().unwrap().to_vec1().unwrap();
        let mut worst = 0f64;
        for r in 0..n {
            let w = want(
                &host[r * v..(r + 1) * v],
                valid,
                targets[r] as usize,
                k,
                t,
                logprobs,
            );
            let case = format!("{n}x{v} valid {valid} k {k} t {t} {dt:?} {rows:?} row {r}");
            assert_eq!(&ids[r * k..(r + 1) * k], w.ids.as_slice(), "{case}: ids");
            for (g, e) in vals[r * k..(r + 1) * k].iter().zip(&w.values) {
                worst = worst.max((*g as f64 - e).abs());
            }
            worst = worst.max((tlp[r] as f64 - w.target_lp).abs());
            worst = worst.max((lse[r] as f64 - w.lse).abs());
            assert_eq!(ranks[r], w.rank, "{case}: rank");
        }
        eprintln!(
            "{n}x{v} valid {valid} k {k} t {t} {dt:?} {rows:?}: worst abs error {worst:.2e}, {:.2} ms \
             (first call loads the module)",
            took.as_secs_f64() * 1e3
        );
        assert!(worst < 2e-5, "worst abs error {worst:.3e}");
        // Again, and the last row alone: the same bits.
        let again = topk_rows(&x, &tg, args).unwrap();
        let alone = topk_rows(
            &x.narrow(0, n - 1, 1).unwrap(),
            &tg.narrow(0, n - 1, 1).unwrap(),
            args,
        )
        .unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            if t.elem_count() == 0 {
                return Vec::new(); // k = 0: no ids or values (a zero-length copy is an error)
            }
            t.flatten_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|f| f.to_bits())
                .collect()
        };
        assert_eq!(bits(&again.values), bits(&got.values), "second run");
        assert_eq!(bits(&again.logsumexp), bits(&got.logsumexp), "second run");
        let last = |t: &Tensor, w: usize| bits(t)[(n - 1) * w..n * w].to_vec();
        assert_eq!(bits(&alone.values), last(&got.values, k), "a row alone");
        assert_eq!(bits(&alone.ids), last(&got.ids, k), "a row alone");
        assert_eq!(
            bits(&alone.logsumexp),
            last(&got.logsumexp, 1),
            "a row alone"
        );
    }
}

/// The selection kernel's time at a teacher's batch, for the GPU check's log (a figure, not a
/// test of speed): 4,096 rows of Qwen3's padded vocabulary in bf16 (normal logits, σ 2), k = 64,
/// at temperature 1 (no division; two radix digits) and 0.8, the median of 5 launches.
#[test]
fn topk_rows_time_at_a_teacher_batch() {
    let Some(dev) = gpu() else { return };
    let (n, v, valid) = (4096, 151_936, 151_669);
    let x = Tensor::randn(0f32, 2.0, (n, v), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let tg = Tensor::zeros(n, DType::U32, &dev).unwrap();
    for t in [1.0f32, 0.8] {
        let args = TopkArgs {
            k: 64,
            valid,
            temperature: t,
            logprobs: true,
            ranks: false,
        };
        topk_rows(&x, &tg, args).unwrap();
        dev.synchronize().unwrap();
        let mut ms: Vec<f64> = (0..5)
            .map(|_| {
                let t0 = Instant::now();
                topk_rows(&x, &tg, args).unwrap();
                dev.synchronize().unwrap();
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        eprintln!(
            "topk_rows {n} x {v} bf16, k 64, t {t}: median {:.2} ms ({:.0} rows/ms)",
            ms[2],
            n as f64 / ms[2]
        );
    }
}

/// Bad arguments are refused with a message, not launched.
#[test]
fn topk_rows_refuses_bad_arguments() {
    let Some(dev) = gpu() else { return };
    let x = Tensor::zeros((2, 100), DType::F32, &dev).unwrap();
    let tg = Tensor::zeros(2, DType::U32, &dev).unwrap();
    let args = |k, valid, temperature| TopkArgs {
        k,
        valid,
        temperature,
        logprobs: true,
        ranks: false,
    };
    for (a, what) in [
        (args(101, 100, 1.0), "k"),
        (args(5, 101, 1.0), "valid"),
        (args(5000, 100, 1.0), "k"),
        (args(5, 100, 0.0), "temperature"),
    ] {
        let e = topk_rows(&x, &tg, a).err().expect("refused").to_string();
        assert!(e.contains(what), "{e}");
    }
}

/// Random f32 values in `[-scale, scale)`.
fn values(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The multi-tensor AdamW against the CPU kernel's arithmetic (kernels/src/adamw.rs: each f32
/// operation rounded on its own, in its order): the same bits for every element, with and
/// without a clipping factor, for tensors of odd sizes (one element to two chunks and a bit),
/// with f32 gradients and with bf16 and f16 ones beside them (a step of one micro-batch hands
/// the compute copies' gradients over as they are: each widened exactly).
#[test]
fn multi_tensor_adamw_gives_the_cpu_kernels_bits() {
    use xdistill_cuda_kernels::{adamw_f32, AdamWHyper, AdamWTensor};
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    let sizes = [1usize, 1000, 70_000, 3, 131_073];
    // Without compute copies, then with bf16 and with f16 copies of the odd tensors: each the
    // updated parameter as `to_dtype` rounds it.
    for (grad_scale, copy_dtype, mixed_grads) in [
        (None, None, false),
        (Some(0.37), Some(DType::BF16), false),
        (None, Some(DType::F16), true),
        (Some(0.37), None, true),
    ] {
        // Tensor i's gradient: f32, or bf16 and f16 by i mod 3 where `mixed_grads`.
        let grad_dtype = |i: usize| match (mixed_grads, i % 3) {
            (true, 1) => DType::BF16,
            (true, 2) => DType::F16,
            _ => DType::F32,
        };
        let h = AdamWHyper {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            step: 3,
            grad_scale,
        };
        let host: Vec<[Vec<f32>; 4]> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v: Vec<f32> = values(&mut rng, n, 1e-5).iter().map(|x| x.abs()).collect();
                // The gradient as its dtype stores it, widened back: what the kernel reads.
                let g = Tensor::from_vec(values(&mut rng, n, 1e-2), n, &Device::Cpu)
                    .and_then(|g| g.to_dtype(grad_dtype(i))?.to_dtype(DType::F32)?.to_vec1())
                    .unwrap();
                [values(&mut rng, n, 1.0), g, values(&mut rng, n, 1e-3), v]
            })
            .collect();
        let on_dev: Vec<[Tensor; 4]> = host
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut d = t
                    .clone()
                    .map(|x| Tensor::from_vec(x.clone(), x.len(), &dev).unwrap());
                d[1] = d[1].to_dtype(grad_dtype(i)).unwrap();
                d
            })
            .collect();
        let copies: Vec<Option<Tensor>> = on_dev
            .iter()
            .enumerate()
            .map(|(i, [p, ..])| {
                let dt = copy_dtype.filter(|_| i % 2 == 1)?;
                Some(p.zeros_like().unwrap().to_dtype(dt).unwrap())
            })
            .collect();
        let tensors: Vec<AdamWTensor> = on_dev
            .iter()
            .zip(&copies)
            .enumerate()
            .map(|(i, ([p, g, m, v], copy))| AdamWTensor {
                param: p,
                grad: g,
                m,
                v,
                weight_decay: if i % 2 == 0 { 0.01 } else { 0.0 },
                copy: copy.as_ref(),
            })
            .collect();
        adamw_f32(&tensors, h).unwrap();
        for ((i, [p, ..]), copy) in on_dev.iter().enumerate().zip(&copies) {
            if let Some(c) = copy {
                let want = p.to_dtype(c.dtype()).unwrap().to_dtype(DType::F32).unwrap();
                let got = c.to_dtype(DType::F32).unwrap();
                let bits = |t: &Tensor| -> Vec<u32> {
                    t.to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect()
                };
                assert_eq!(bits(&got), bits(&want), "tensor {i}: {:?} copy", c.dtype());
            }
        }
        let t = h.step as i32;
        let (bc1, bc2) = (1.0 - h.beta1.powi(t), 1.0 - h.beta2.powi(t));
        let (b1, b2) = (h.beta1 as f32, h.beta2 as f32);
        let (ibc1, ibc2) = ((1.0 / bc1) as f32, (1.0 / bc2) as f32);
        let (lr, eps) = (h.lr as f32, h.eps as f32);
        for (i, ([p, g, m, v], got)) in host.iter().zip(&on_dev).enumerate() {
            let decay = (1.0 - h.lr * if i % 2 == 0 { 0.01 } else { 0.0 }) as f32;
            // The parameter, the gradient (unread) and the moments.
            let got: Vec<Vec<f32>> = got
                .iter()
                .map(|x| x.to_dtype(DType::F32).unwrap().to_vec1().unwrap())
                .collect();
            for j in 0..p.len() {
                let gj = match grad_scale {
                    Some(s) => g[j] * s as f32 + 0.0,
                    None => g[j],
                };
                let mj = b1 * m[j] + (1.0 - b1) * gj;
                let vj = b2 * v[j] + (1.0 - b2) * (gj * gj);
                let pj = p[j] * decay - lr * (mj * ibc1) / ((vj * ibc2).sqrt() + eps);
                let case = format!("scale {grad_scale:?} tensor {i} element {j}");
                assert_eq!(got[0][j].to_bits(), pj.to_bits(), "{case}: parameter");
                assert_eq!(got[2][j].to_bits(), mj.to_bits(), "{case}: m");
                assert_eq!(got[3][j].to_bits(), vj.to_bits(), "{case}: v");
            }
        }
        eprintln!(
            "AdamW scale {grad_scale:?} copies {copy_dtype:?} mixed gradients {mixed_grads}: {} \
             tensors, every bit equal",
            sizes.len()
        );
    }
}

/// The data-parallel exact sum on the device (`tree_sum.cu`) against the pairwise tree's
/// definition (split at the largest power of two below the count, in f32), bit for bit, for
/// 1 to 12 ranks and sizes across the grid's limit; a left fold differs (the test can fail).
#[test]
fn tree_sum_gives_the_pairwise_trees_bits() {
    let Some(dev) = gpu() else { return };
    let Device::Cuda(cuda) = &dev else { return };
    fn tree(leaves: &[&[f32]], i: usize) -> f32 {
        if leaves.len() == 1 {
            return leaves[0][i];
        }
        let split = leaves.len().next_power_of_two() / 2;
        tree(&leaves[..split], i) + tree(&leaves[split..], i)
    }
    let mut rng = rng();
    let mut fold_differs = false;
    for (world, n) in [
        (1, 5),
        (2, 1000),
        (3, 257),
        (5, 70_001),
        (8, 4096),
        (12, 33),
    ] {
        let host: Vec<f32> = (0..world * n)
            .map(|_| rng.random_range(-1.0f32..1.0) * 10f32.powi(rng.random_range(-4..5)))
            .collect();
        let parts = cuda.clone_htod(&host).unwrap();
        let mut out = cuda.alloc_zeros::<f32>(n).unwrap();
        xdistill_cuda_kernels::tree_sum_f32(cuda, &parts.slice(..), &mut out.slice_mut(..), world)
            .unwrap();
        let got: Vec<f32> = cuda.clone_dtoh(&out).unwrap();
        let leaves: Vec<&[f32]> = host.chunks(n).collect();
        for (i, g) in got.iter().enumerate() {
            let want = tree(&leaves, i);
            assert_eq!(g.to_bits(), want.to_bits(), "world {world} element {i}");
            let fold: f32 = leaves.iter().map(|l| l[i]).sum();
            fold_differs |= fold.to_bits() != want.to_bits();
        }
    }
    assert!(fold_differs, "a left fold gave the tree's bits everywhere");
}

/// The gradients' sums of squares in one launch against f64 sums: within 1e-12, the same bits
/// on a second run and for a tensor alone; bf16 and f16 tensors the bits of their f32 widening.
#[test]
fn multi_tensor_sum_of_squares_equals_f64() {
    use xdistill_cuda_kernels::sum_squares;
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    let host: Vec<Vec<f32>> = [5usize, 65_536, 200_003, 1]
        .iter()
        .map(|&n| values(&mut rng, n, 3.0))
        .collect();
    let t: Vec<Tensor> = host
        .iter()
        .map(|x| Tensor::from_vec(x.clone(), x.len(), &dev).unwrap())
        .collect();
    let refs: Vec<&Tensor> = t.iter().collect();
    let got = sum_squares(&refs).unwrap();
    for (x, g) in host.iter().zip(&got) {
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        assert!((g - want).abs() <= 1e-12 * want, "{g} vs {want}");
    }
    assert_eq!(sum_squares(&refs).unwrap(), got, "second run");
    assert_eq!(sum_squares(&[&t[2]]).unwrap()[0], got[2], "a tensor alone");
    for dt in [DType::BF16, DType::F16] {
        let narrow: Vec<Tensor> = t.iter().map(|x| x.to_dtype(dt).unwrap()).collect();
        let widened: Vec<Tensor> = narrow
            .iter()
            .map(|x| x.to_dtype(DType::F32).unwrap())
            .collect();
        let mixed: Vec<&Tensor> = [&narrow[0], &t[1], &narrow[2], &narrow[3]].into();
        let want: Vec<&Tensor> = [&widened[0], &t[1], &widened[2], &widened[3]].into();
        assert_eq!(
            sum_squares(&mixed).unwrap(),
            sum_squares(&want).unwrap(),
            "{dt:?} tensors against their f32 widening"
        );
    }
}

/// The CUDA log-softmax and its backward as candle ops (as xdistill_kernels::log_softmax
/// wraps them), for the test below.
struct LogSoftmax;
struct LogSoftmaxBwd;

impl candle_core::CustomOp1 for LogSoftmax {
    fn name(&self) -> &'static str {
        "test-log-softmax"
    }
    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("CUDA only")
    }
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        xdistill_cuda_kernels::log_softmax_f32(s, l)
    }
}

impl candle_core::CustomOp2 for LogSoftmaxBwd {
    fn name(&self) -> &'static str {
        "test-log-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("CUDA only")
    }
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &candle_core::Layout,
        y: &candle_core::CudaStorage,
        ly: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        xdistill_cuda_kernels::log_softmax_bwd_f32(g, lg, y, ly)
    }
}

/// The row-wise log-softmax and its backward `g − exp(y)·Σg` against f64, rows from 1 to
/// Qwen3's 151,936 columns; the backward relative to the row's largest gradient.
#[test]
fn log_softmax_and_its_backward_equal_f64() {
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    for (rows, dim) in [(3usize, 1usize), (2, 1000), (4, 4099), (2, 151_936)] {
        let x = values(&mut rng, rows * dim, 12.0);
        let g = values(&mut rng, rows * dim, 0.5);
        let xt = Tensor::from_vec(x.clone(), (rows, dim), &dev).unwrap();
        let gt = Tensor::from_vec(g.clone(), (rows, dim), &dev).unwrap();
        let y = xt.apply_op1_no_bwd(&LogSoftmax).unwrap();
        let gx = gt.apply_op2_no_bwd(&y, &LogSoftmaxBwd).unwrap();
        let (y, gx): (Vec<f32>, Vec<f32>) = (
            y.flatten_all().unwrap().to_vec1().unwrap(),
            gx.flatten_all().unwrap().to_vec1().unwrap(),
        );
        let (mut worst_y, mut worst_g) = (0f64, 0f64);
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let gr = &g[r * dim..(r + 1) * dim];
            let m = xr.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = m + xr.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            let sg: f64 = gr.iter().map(|&v| v as f64).sum();
            let want_g: Vec<f64> = (0..dim)
                .map(|i| gr[i] as f64 - (xr[i] as f64 - lse).exp() * sg)
                .collect();
            let scale = want_g.iter().fold(1f64, |a, b| a.max(b.abs()));
            for i in 0..dim {
                worst_y = worst_y.max((y[r * dim + i] as f64 - (xr[i] as f64 - lse)).abs());
                worst_g = worst_g.max((gx[r * dim + i] as f64 - want_g[i]).abs() / scale);
            }
        }
        eprintln!("log_softmax {rows} x {dim}: forward {worst_y:.2e}, backward {worst_g:.2e}");
        assert!(worst_y < 1e-5 && worst_g < 3e-6, "{worst_y:e} {worst_g:e}");
    }
}

/// `f` of `vars` (made trainable) and `consts`, in `dt` on `dev`: the output and the gradients
/// of `Σ y ∘ r` at each var (`r` drawn from `seed`), on the host as f64.
fn with_grads(
    vars: &[Tensor],
    consts: &[Tensor],
    dt: DType,
    dev: &Device,
    seed: u64,
    f: &dyn Fn(&[Tensor], &[Tensor]) -> Tensor,
) -> Vec<Vec<f64>> {
    use crate::cudnn_attention::{host, random};
    use candle_core::Var;
    let on = |t: &Tensor| t.to_dtype(dt).unwrap().to_device(dev).unwrap();
    let vars: Vec<Var> = vars
        .iter()
        .map(|t| Var::from_tensor(&on(t)).unwrap())
        .collect();
    let consts: Vec<Tensor> = consts.iter().map(on).collect();
    let inputs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&inputs, &consts);
    let mut seeded = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
    let r = random(&mut seeded, y.dims(), DType::F32, &Device::Cpu);
    let grads = (&y * on(&r))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut out = vec![host(&y)];
    out.extend(
        vars.iter()
            .map(|v| host(grads.get(v.as_tensor()).expect("a gradient"))),
    );
    out
}

/// The fused norm, RoPE and gated activation on the GPU against their CPU reference (f64
/// arithmetic, one rounding per output) on the same inputs: values and gradients at every input,
/// f32 and bf16, on the layouts the decoder hands them (hidden rows of 1000, q/k-norm rows of
/// 128, RoPE from a view of a wider tensor, per-row tables, partial rotary, both output
/// arrangements, the halves of a fused gate_up); a second GPU run gives the same bits.
#[test]
fn fused_layer_ops_equal_their_cpu_reference() {
    use crate::cudnn_attention::{random, rel_err};
    use xdistill_shared::model::device_ops::{gated_act, rms_norm, rope};
    use xdistill_shared::model::Activation;
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    let cpu = Device::Cpu;
    type Op = Box<dyn Fn(&[Tensor], &[Tensor]) -> Tensor>;
    let mut cases: Vec<(String, Vec<Tensor>, Vec<Tensor>, Op)> = Vec::new();
    for (shape, plus_one) in [
        (vec![3usize, 37, 1000], false),
        (vec![2, 41, 4, 128], false),
        (vec![3, 37, 1000], true),
    ] {
        let x = (random(&mut rng, &shape, DType::F32, &cpu) * 3.0).unwrap();
        let w = (random(&mut rng, &shape[shape.len() - 1..], DType::F32, &cpu) + 0.5).unwrap();
        cases.push((
            format!("rms_norm {shape:?} plus_one {plus_one}"),
            vec![x, w],
            vec![],
            Box::new(move |v, _| rms_norm(&v[0], &v[1], 1e-6, plus_one).unwrap()),
        ));
    }
    // (B, T, H, D, rotated pairs, per-row tables, a view of a wider tensor)
    for (b, t, h, d, half, per_row, view) in [
        (2usize, 41usize, 4usize, 128usize, 64usize, false, false),
        (2, 41, 4, 64, 32, true, true),
        (3, 17, 5, 96, 16, false, true),
    ] {
        let table: Vec<usize> = if per_row {
            vec![b, t, half]
        } else {
            vec![t, half]
        };
        let angle = (random(&mut rng, &table, DType::F32, &cpu) * 3.2).unwrap();
        let x = random(
            &mut rng,
            &[b, t, h, d + if view { 7 } else { 0 }],
            DType::F32,
            &cpu,
        );
        for heads_first in [true, false] {
            cases.push((
                format!("rope {b}x{t}x{h}x{d} rot {} per-row {per_row} view {view} heads-first {heads_first}", 2 * half),
                vec![x.clone()],
                vec![angle.cos().unwrap(), angle.sin().unwrap()],
                Box::new(move |v, c| {
                    let x = if view { v[0].narrow(3, 3, d).unwrap() } else { v[0].clone() };
                    rope(&x, &c[0], &c[1], heads_first).unwrap()
                }),
            ));
        }
    }
    for act in [Activation::Silu, Activation::GeluTanh, Activation::GeluErf] {
        let both = (random(&mut rng, &[3, 37, 2 * 301], DType::F32, &cpu) * 4.0).unwrap();
        cases.push((
            format!("gated {act:?} (fused gate_up)"),
            vec![both],
            vec![],
            Box::new(move |v, _| {
                let (g, u) = (
                    v[0].narrow(2, 0, 301).unwrap(),
                    v[0].narrow(2, 301, 301).unwrap(),
                );
                gated_act(&g, &u, act).unwrap()
            }),
        ));
    }
    for dt in [DType::F32, DType::BF16] {
        // f32: the reference's f64 sums against the kernels' f32 ones; bf16: one rounding each.
        let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
        for (name, vars, consts, f) in &cases {
            let want = with_grads(vars, consts, dt, &cpu, 5, f.as_ref());
            let got = with_grads(vars, consts, dt, &dev, 5, f.as_ref());
            let again = with_grads(vars, consts, dt, &dev, 5, f.as_ref());
            assert_eq!(got, again, "{name} {dt:?}: a second run differs");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let err = rel_err(g, w);
                eprintln!("{name} {dt:?} output {i}: rel err {err:.2e}");
                assert!(
                    err < tol,
                    "{name} {dt:?}: output {i} (0 = value, then gradients) {err:.3e}"
                );
            }
        }
    }
}

/// Whole passes in bf16 on the GPU with the fused layer ops are at least as accurate as with
/// the composed ops (the decoders of `decoder_cases`: q/k-norm, Gemma's `1 + w` norms and tanh
/// GELU, windows): a training pass's hidden states and every gradient (selective), and served
/// logits, each against the f32 composed pass of the same weights (`assert_as_accurate`).
/// The LM head's accumulating GEMM (`model::autograd::accumulate_tn`: cuBLAS's `gemm_acc_f32`
/// on the GPU) against its CPU reference (f64 sums, one rounding into the f32 accumulator): f32,
/// bf16 and f16 operands, odd sizes, an accumulator already holding values, two calls in a row.
/// f32 sums of up to 300 products against f64: 1e-5 of the norm.
#[test]
fn accumulating_gemm_equals_its_reference() {
    use crate::cudnn_attention::{host, rel_err};
    use xdistill_shared::model::autograd::accumulate_tn;
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (m, o, k) in [(37, 129, 65), (300, 1000, 64), (1, 7, 3)] {
            let mut r = |dims: &[usize]| {
                let v = values(&mut rng, dims.iter().product(), 1.0);
                Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
            };
            let (g, x, start) = (r(&[m, o]), r(&[m, k]), r(&[o, k]));
            let (g, x) = (g.to_dtype(dt).unwrap(), x.to_dtype(dt).unwrap());
            let want = start.copy().unwrap();
            let got = start.to_device(&dev).unwrap();
            let (gd, xd) = (g.to_device(&dev).unwrap(), x.to_device(&dev).unwrap());
            for _ in 0..2 {
                accumulate_tn(&want, &g, &x).unwrap();
                accumulate_tn(&got, &gd, &xd).unwrap();
            }
            let err = rel_err(&host(&got), &host(&want));
            eprintln!("accumulate {dt:?} {m}x{o}x{k}: rel err {err:.2e}");
            assert!(err < 1e-5, "accumulate {dt:?} {m}x{o}x{k}: {err:.3e}");
        }
    }
}

/// The gradient accumulation kernel (`grad_accumulate_f32`: a micro-batch's gradients into
/// their f32 sums, every parameter in one launch) against candle's cast and add on the CPU, bit
/// for bit: f32, bf16 and f16 gradients, both modes, sizes over a chunk, the sums views at
/// offsets of one buffer whose other elements stay as they were.
#[test]
fn grad_accumulate_equals_cast_and_add() {
    use xdistill_cuda_kernels::{grad_accumulate_f32, GradSum};
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    let sizes = [1usize, 1000, 70_000, 3, 131_077];
    let total: usize = sizes.iter().sum::<usize>() + 2 * sizes.len();
    let base = Tensor::from_vec(values(&mut rng, total, 1.0), total, &Device::Cpu).unwrap();
    let flat = base.to_device(&dev).unwrap();
    let dts = [DType::F32, DType::BF16, DType::F16];
    let mut at = 1; // one untouched element before and after each view
    let (mut srcs, mut dsts, mut want) = (Vec::new(), Vec::new(), base.to_vec1::<f32>().unwrap());
    for (i, &n) in sizes.iter().enumerate() {
        let g = Tensor::from_vec(values(&mut rng, n, 1e-2), n, &Device::Cpu).unwrap();
        let g = g.to_dtype(dts[i % 3]).unwrap();
        let add = i % 2 == 0;
        let widened = g.to_dtype(DType::F32).unwrap();
        let sum = if add {
            (base.narrow(0, at, n).unwrap() + widened).unwrap()
        } else {
            widened
        };
        want.splice(at..at + n, sum.to_vec1::<f32>().unwrap());
        srcs.push((g.to_device(&dev).unwrap(), add));
        dsts.push(flat.narrow(0, at, n).unwrap());
        at += n + 2;
    }
    let entries: Vec<GradSum<'_>> = srcs
        .iter()
        .zip(&dsts)
        .map(|((src, add), dst)| GradSum {
            src,
            dst,
            add: *add,
        })
        .collect();
    grad_accumulate_f32(&entries).unwrap();
    let got = flat
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let differ = got
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    eprintln!(
        "grad_accumulate: {} tensors, {total} elements: {differ} differ",
        sizes.len()
    );
    assert_eq!(differ, 0);
}

/// The packed forward's blocked GEMM (`gemm_nt_blocks`: `x · wᵀ`, each row as a product of
/// `block` rows computes it) both ways (one cuBLASLt matmul by the algorithm fixed for a block,
/// and one cuBLAS GEMM per block) against f64 on fresh random inputs (f32, bf16, f16; odd
/// sizes), and batch-invariant: a block's rows are the same bits computed alone, among other
/// blocks, after a different number of blocks, and on a second call. At the teacher's shapes
/// (blocks of 1,024 rows, Qwen3-0.6B's projections) the two ways against each other and the
/// same invariance.
#[test]
fn blocked_gemm_equals_f64_and_each_block_alone() {
    use crate::cudnn_attention::rel_err;
    use candle_core::backend::BackendStorage;
    use candle_core::Storage;
    use xdistill_cuda_kernels::{gemm_nt_blocks, GemmBlocksArgs, GemmBlocksMode};
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    // The blocked GEMM of `x` [rows, k] and `w` [n, k]: the result in f64, row-major.
    fn blocked(x: &Tensor, w: &Tensor, block: usize, mode: GemmBlocksMode) -> Vec<f64> {
        let (rows, k) = x.dims2().unwrap();
        let n = w.dim(0).unwrap();
        let (xs, lx) = x.storage_and_layout();
        let (ws, lw) = w.storage_and_layout();
        let (Storage::Cuda(xs), Storage::Cuda(ws)) = (&*xs, &*ws) else {
            panic!("CUDA tensors")
        };
        let args = GemmBlocksArgs {
            rows,
            k,
            n,
            block,
            mode,
        };
        let y = gemm_nt_blocks((xs, lx), (ws, lw), args).unwrap();
        match y.to_cpu_storage().unwrap() {
            candle_core::CpuStorage::F32(v) => v.iter().map(|&x| x as f64).collect(),
            candle_core::CpuStorage::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            candle_core::CpuStorage::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            other => panic!("{:?}", other.dtype()),
        }
    }
    // Each block alone, and the blocks after the first without it (each row at another offset
    // of another number of rows), give the rows' bits in `got`; so does a second call.
    fn assert_invariant(
        x: &Tensor,
        w: &Tensor,
        block: usize,
        mode: GemmBlocksMode,
        got: &[f64],
        case: &str,
    ) {
        let blocks = x.dim(0).unwrap() / block;
        let n = w.dim(0).unwrap();
        assert_eq!(got, blocked(x, w, block, mode), "{case}: a second call");
        for b in 0..blocks {
            let alone = blocked(&x.narrow(0, b * block, block).unwrap(), w, block, mode);
            assert_eq!(
                alone,
                got[b * block * n..(b + 1) * block * n],
                "{case}: block {b} alone"
            );
        }
        if blocks > 1 {
            let rest = blocked(
                &x.narrow(0, block, (blocks - 1) * block).unwrap(),
                w,
                block,
                mode,
            );
            assert_eq!(rest, got[block * n..], "{case}: the blocks after the first");
        }
    }
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (blocks, block, k, n) in [(3, 37, 65, 129), (2, 64, 128, 1000), (1, 16, 8, 3)] {
            let rows = blocks * block;
            let xh = Tensor::from_vec(values(&mut rng, rows * k, 1.0), (rows, k), &Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let wh = Tensor::from_vec(values(&mut rng, n * k, 1.0), (n, k), &Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            // f64 from the operands as stored.
            let x64: Vec<f64> = xh
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let w64: Vec<f64> = wh
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut want = vec![0.0; rows * n];
            for r in 0..rows {
                for c in 0..n {
                    want[r * n + c] = (0..k).map(|i| x64[r * k + i] * w64[c * k + i]).sum();
                }
            }
            let (x, w) = (xh.to_device(&dev).unwrap(), wh.to_device(&dev).unwrap());
            for mode in [GemmBlocksMode::FixedAlgo, GemmBlocksMode::PerBlock] {
                let got = blocked(&x, &w, block, mode);
                let err = rel_err(&got, &want);
                let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
                let case = format!("{dt:?} {mode:?} {blocks}x{block}x{k}x{n}");
                eprintln!("gemm_nt_blocks {case}: rel err {err:.2e}");
                assert!(err < tol, "{case}: {err:.3e}");
                assert_invariant(&x, &w, block, mode, &got, &case);
            }
        }
    }
    // The teacher's shapes: 4 blocks of 1,024 rows through Qwen3-0.6B's projections (k, n).
    for (k, n) in [
        (1024, 2048),
        (1024, 1024),
        (2048, 1024),
        (1024, 6144),
        (3072, 1024),
    ] {
        let (blocks, block) = (4, 1024);
        let x = Tensor::randn(0f32, 1.0, (blocks * block, k), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let w = (Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap() / (k as f64).sqrt())
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let fixed = blocked(&x, &w, block, GemmBlocksMode::FixedAlgo);
        let per_block = blocked(&x, &w, block, GemmBlocksMode::PerBlock);
        let err = rel_err(&fixed, &per_block);
        let case = format!("BF16 {blocks}x{block}x{k}x{n}");
        eprintln!("gemm_nt_blocks {case}: the fixed algorithm against a GEMM per block: {err:.2e}");
        assert!(err < 1e-2, "{case}: {err:.3e}");
        assert_invariant(&x, &w, block, GemmBlocksMode::FixedAlgo, &fixed, &case);
        // Each way's time (a figure for the log, not a test of speed): the median of 5 calls.
        let time = |mode: GemmBlocksMode| -> f64 {
            let mut ms: Vec<f64> = (0..5)
                .map(|_| {
                    dev.synchronize().unwrap();
                    let t0 = Instant::now();
                    let (xs, lx) = x.storage_and_layout();
                    let (ws, lw) = w.storage_and_layout();
                    let (Storage::Cuda(xs), Storage::Cuda(ws)) = (&*xs, &*ws) else {
                        panic!("CUDA tensors")
                    };
                    let args = GemmBlocksArgs {
                        rows: blocks * block,
                        k,
                        n,
                        block,
                        mode,
                    };
                    drop(gemm_nt_blocks((xs, lx), (ws, lw), args).unwrap());
                    dev.synchronize().unwrap();
                    t0.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            ms[2]
        };
        let (tf, tp) = (
            time(GemmBlocksMode::FixedAlgo),
            time(GemmBlocksMode::PerBlock),
        );
        eprintln!("gemm_nt_blocks {case}: fixed algorithm {tf:.3} ms, a GEMM per block {tp:.3} ms");
    }
}

#[test]
fn passes_with_fused_layer_ops_match_the_composed_ops() {
    use crate::cudnn_attention::{
        assert_as_accurate, decoder_cases, decoder_grads, host, random, rel_err, vars_of, PassOut,
    };
    use xdistill_shared::model::device_ops::force_in_this_thread;
    use xdistill_shared::model::{Activations, Decoder, Ops};
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    let rows: Vec<u32> = (0..2 * 41u32).map(|i| (i * 7 + 3) % 50).collect();
    let ids = Tensor::from_vec(rows, (2, 41), &dev).unwrap();
    for (name, cfg) in decoder_cases() {
        let g = random(&mut rng, &[2, 41, cfg.hidden_size], DType::BF16, &dev);
        let run = |dt: DType, fused: bool| {
            let (vars, vb) = vars_of(&cfg, dt, &dev);
            let train = Decoder::new(&cfg, vb.clone(), Ops::Differentiable).unwrap();
            let serve = Decoder::new(&cfg, vb, Ops::Fused).unwrap();
            force_in_this_thread(Some(fused));
            let pass = train.train_forward(&ids, Activations::Selective).unwrap();
            let hidden = host(pass.hidden());
            let grads = decoder_grads(&vars, &pass.backward(&g.to_dtype(dt).unwrap()).unwrap());
            let logits = host(&serve.forward(&ids).unwrap());
            force_in_this_thread(None);
            (PassOut { hidden, grads }, logits)
        };
        let (reference, l_ref) = run(DType::F32, false);
        let (base, l_base) = run(DType::BF16, false);
        let (new, l_new) = run(DType::BF16, true);
        assert_as_accurate(name, &new, &base, &reference);
        let (en, eb) = (rel_err(&l_new, &l_ref), rel_err(&l_base, &l_ref));
        eprintln!("{name}: logits against f32 {en:.2e} (composed {eb:.2e})");
        assert!(
            en <= 1.15 * eb + 1e-3,
            "{name} logits: {en:.3e}, composed {eb:.3e}"
        );
    }
}
