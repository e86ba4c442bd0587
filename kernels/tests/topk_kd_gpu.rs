//! The fused top-k distillation loss (`topk_kd.cu`) on the GPU against its f64 CPU reference on
//! the same inputs: each row's divergence, masses and logsumexp, and the logits' gradient, for
//! every divergence and tail mode, two temperatures, f32 and bf16 logits, Qwen3's vocabulary
//! (151,936) at k = 64 and the cross-entropy (k = 1); the divergence with the cross-entropy
//! beside it, its gradient written over the logits (`TopkKdTrain`); a second run gives the same
//! bits. CUDA
//! builds only; the GPU check runs them (`XDISTILL_TEST_DEVICE=cuda`, `scripts/gpu-check.sh`
//! step 1c).

use candle_core::{DType, Device, Tensor, Var};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xdistill_kernels::{topk_kd, KdDivergence, KdTail, TopkKd};

fn gpu() -> Option<Device> {
    if std::env::var("XDISTILL_TEST_DEVICE").as_deref() == Ok("cuda") {
        Some(Device::new_cuda(0).expect("a CUDA device"))
    } else {
        eprintln!("skipped: XDISTILL_TEST_DEVICE is not cuda");
        None
    }
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `‖a − b‖ / ‖b‖`.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Random logits `[rows, v]`, distinct teacher ids `[rows, k]` and log-probs summing to
/// `mass` per row (1 for the cross-entropy's single 0).
fn inputs(
    rng: &mut ChaCha8Rng,
    rows: usize,
    v: usize,
    k: usize,
    mass: f64,
) -> (Tensor, Tensor, Tensor) {
    let z: Vec<f32> = (0..rows * v)
        .map(|_| rng.random_range(-6.0f32..6.0))
        .collect();
    let mut ids = Vec::with_capacity(rows * k);
    let mut lts = Vec::with_capacity(rows * k);
    let mut perm: Vec<u32> = (0..v as u32).collect();
    for _ in 0..rows {
        perm.partial_shuffle(rng, k);
        ids.extend_from_slice(&perm[..k]);
        let w: Vec<f64> = (0..k)
            .map(|_| rng.random_range(0.0f64..3.0).exp())
            .collect();
        let s: f64 = w.iter().sum();
        lts.extend(w.iter().map(|x| {
            if k == 1 {
                0.0
            } else {
                (x / s * mass).ln() as f32
            }
        }));
    }
    let cpu = Device::Cpu;
    (
        Tensor::from_vec(z, (rows, v), &cpu).unwrap(),
        Tensor::from_vec(ids, (rows, k), &cpu).unwrap(),
        Tensor::from_vec(lts, (rows, k), &cpu).unwrap(),
    )
}

/// The op's output and the logits' gradient for the upstream gradient `g` on column 0.
fn run(
    z: &Tensor,
    ids: &Tensor,
    lts: &Tensor,
    g: &Tensor,
    loss: TopkKd,
    dev: &Device,
    dt: DType,
) -> (Vec<f64>, Vec<f64>) {
    let on = |t: &Tensor| t.to_device(dev).unwrap();
    let x = Var::from_tensor(&on(&z.to_dtype(dt).unwrap())).unwrap();
    let out = topk_kd(x.as_tensor(), &on(ids), &on(lts), loss).unwrap();
    let d = out.narrow(1, 0, 1).unwrap().squeeze(1).unwrap();
    let grads = (d * on(g)).unwrap().sum_all().unwrap().backward().unwrap();
    let dz = grads.get(x.as_tensor()).expect("a gradient");
    assert_eq!(dz.dtype(), dt);
    (host(&out), host(dz))
}

#[test]
fn topk_kd_equals_its_cpu_reference() {
    let Some(dev) = gpu() else { return };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7);
    eprintln!("seed {seed}");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let divs = [
        KdDivergence::Forward,
        KdDivergence::Reverse,
        KdDivergence::Jsd(0.5),
        KdDivergence::TotalVariation,
    ];
    let tails = [KdTail::Renormalize, KdTail::Bucket, KdTail::Ignore];
    // (rows, V, k, teacher mass, losses)
    let mut cases: Vec<(usize, usize, usize, f64, Vec<TopkKd>)> = Vec::new();
    let mut every = Vec::new();
    for divergence in divs {
        for tail in tails {
            for temperature in [1.0, 0.7] {
                every.push(TopkKd {
                    divergence,
                    tail,
                    temperature,
                    tail_floor: 1e-6,
                });
            }
        }
    }
    cases.push((5, 1000, 17, 0.9, every));
    let big = |divergence| TopkKd {
        divergence,
        tail: KdTail::Bucket,
        temperature: 1.0,
        tail_floor: 1e-6,
    };
    cases.push((
        7,
        151_936,
        64,
        0.97,
        vec![big(KdDivergence::Forward), big(KdDivergence::Jsd(0.5))],
    ));
    cases.push((9, 151_936, 1, 1.0, vec![TopkKd::cross_entropy()]));
    for (rows, v, k, mass, losses) in cases {
        let (z, ids, lts) = inputs(&mut rng, rows, v, k, mass);
        let g = Tensor::from_vec(
            (0..rows)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect::<Vec<_>>(),
            rows,
            &Device::Cpu,
        )
        .unwrap();
        for loss in losses {
            for dt in [DType::F32, DType::BF16] {
                let (want_out, want_dz) = run(&z, &ids, &lts, &g, loss, &Device::Cpu, dt);
                let (out, dz) = run(&z, &ids, &lts, &g, loss, &dev, dt);
                let (out2, dz2) = run(&z, &ids, &lts, &g, loss, &dev, dt);
                let what = format!("{rows}x{v} k {k} {loss:?} {dt:?}");
                assert_eq!((&out, &dz), (&out2, &dz2), "{what}: a second run differs");
                let (e_out, e_dz) = (rel_err(&out, &want_out), rel_err(&dz, &want_dz));
                eprintln!("{what}: outputs {e_out:.2e}, gradient {e_dz:.2e}");
                // f32 sums over V against f64; bf16: each gradient rounded once.
                let tol_dz = if dt == DType::F32 { 1e-4 } else { 8e-3 };
                assert!(e_out < 1e-4, "{what}: outputs {e_out:.3e}");
                assert!(e_dz < tol_dz, "{what}: gradient {e_dz:.3e}");
            }
        }
    }
}

/// The divergence with the cross-entropy beside it, run by hand ([`TopkKdTrain`]: the figures,
/// then the gradient written over the logits) on the GPU against the same on the CPU (the f64
/// reference): every column of the figures and the gradient of `g_kd·D + g_ce·CE`, for targets
/// inside K and outside, two temperatures (the cross-entropy's logsumexp at τ = 1 apart from the
/// divergence's), f32 and bf16, Qwen3's vocabulary at k = 64 and k = 4096 (every column at K
/// staged); and with the cross-entropy alone (SFT, k = 1). A second run gives the same bits.
#[test]
fn topk_kd_train_writes_the_gradient_over_the_logits() {
    use xdistill_kernels::TopkKdTrain;
    let Some(dev) = gpu() else { return };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(11);
    eprintln!("seed {seed}");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let loss = |divergence, tail, temperature| TopkKd {
        divergence,
        tail,
        temperature,
        tail_floor: 1e-6,
    };
    // (rows, V, k, losses, with the cross-entropy beside)
    let cases = [
        (
            6,
            151_936,
            64,
            vec![
                loss(KdDivergence::Forward, KdTail::Bucket, 1.0),
                loss(KdDivergence::Jsd(0.5), KdTail::Renormalize, 0.7),
                loss(KdDivergence::Reverse, KdTail::Ignore, 1.0),
            ],
            true,
        ),
        (
            3,
            151_936,
            4096,
            vec![loss(KdDivergence::Forward, KdTail::Bucket, 0.7)],
            true,
        ),
        (5, 151_936, 1, vec![TopkKd::cross_entropy()], false),
    ];
    for (rows, v, k, losses, with_ce) in cases {
        let (z, ids, lts) = inputs(&mut rng, rows, v, k, if k == 1 { 1.0 } else { 0.95 });
        // Even rows' next token inside K, odd rows' outside.
        let idv: Vec<u32> = ids.flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<u32> = (0..rows)
            .map(|r| {
                let row = &idv[r * k..(r + 1) * k];
                if r % 2 == 0 {
                    row[k / 2]
                } else {
                    (0..v as u32).find(|c| !row.contains(c)).unwrap()
                }
            })
            .collect();
        let y = Tensor::from_vec(y, rows, &Device::Cpu).unwrap();
        let g: Vec<f32> = (0..2 * rows)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let g = Tensor::from_vec(g, (rows, 2), &Device::Cpu).unwrap();
        for loss in losses {
            for dt in [DType::F32, DType::BF16] {
                let run = |on: &Device| {
                    let to = |t: &Tensor| t.to_device(on).unwrap();
                    // A copy of its own: the gradient is written over it, and `to_dtype` and
                    // `to_device` to what a tensor already is share its storage (the first GPU
                    // run, 2026-12-04, read the CPU run's gradient as its logits).
                    let z = to(&z.to_dtype(dt).unwrap()).copy().unwrap();
                    let ce = with_ce.then(|| to(&y));
                    let op = TopkKdTrain::new(&z, &to(&ids), &to(&lts), ce.as_ref(), loss).unwrap();
                    let out = op.figures(&z).unwrap();
                    op.grad_into_logits(&z, &out, &to(&g)).unwrap();
                    (host(&out), host(&z))
                };
                let (want_out, want_dz) = run(&Device::Cpu);
                let (out, dz) = run(&dev);
                let (out2, dz2) = run(&dev);
                let what = format!("{rows}x{v} k {k} ce {with_ce} {loss:?} {dt:?}");
                assert_eq!((&out, &dz), (&out2, &dz2), "{what}: a second run differs");
                let (e_out, e_dz) = (rel_err(&out, &want_out), rel_err(&dz, &want_dz));
                eprintln!("{what}: figures {e_out:.2e}, gradient {e_dz:.2e}");
                let tol_dz = if dt == DType::F32 { 1e-4 } else { 8e-3 };
                assert!(e_out < 1e-4, "{what}: figures {e_out:.3e}");
                assert!(e_dz < tol_dz, "{what}: gradient {e_dz:.3e}");
            }
        }
    }
}
