//! cuDNN's fused attention (kernels/cudnn) on the GPU: the op against an f64 reference on fresh
//! random inputs (bf16 and f16, odd lengths, grouped-query heads, windows, a KV cache's
//! bottom-right mask, strided inputs), and decoders served through it against the eager path;
//! for training, its forward with statistics and its backward against f64 loops, and whole
//! training passes through it against the blockwise attention core.
//! CUDA builds only; the GPU check runs them (`XDISTILL_TEST_DEVICE=cuda`, step 1).

use crate::model::{config_with, dev, params};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;
use xdistill_cudnn::{sdpa, Causal, Params};
use xdistill_shared::model::{AttnBackend, Decoder, KvCache, Ops};

/// The test device when it is a GPU; `None` (the test says it skipped) on the CPU.
pub(crate) fn gpu() -> Option<Device> {
    let d = dev();
    if d.is_cuda() {
        Some(d)
    } else {
        eprintln!("skipped: XDISTILL_TEST_DEVICE is not a CUDA device");
        None
    }
}

/// A fresh seed per run (printed, so that a failure can be replayed).
pub(crate) fn rng() -> ChaCha8Rng {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(7);
    eprintln!("seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

pub(crate) fn random(rng: &mut ChaCha8Rng, shape: &[usize], dt: DType, dev: &Device) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, dev)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

/// `x` as f64 on the host, in the order of its logical shape.
pub(crate) fn host(x: &Tensor) -> Vec<f64> {
    x.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// Attention in f64 by loops: q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D] → [B, Sq, Hq, D].
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, p: Params) -> Vec<f64> {
    let (b, hq, sq, d) = q.dims4().unwrap();
    let (_, hkv, skv, _) = k.dims4().unwrap();
    let (q, k, v) = (host(q), host(k), host(v));
    let mut out = vec![0.0; b * sq * hq * d];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..sq {
                let pos = match p.causal {
                    Causal::BottomRight => i + skv - sq,
                    _ => i,
                };
                let seen = |j: usize| {
                    (p.causal == Causal::None || j <= pos) && p.window.is_none_or(|w| pos < j + w)
                };
                let qrow = &q[((bi * hq + h) * sq + i) * d..][..d];
                let scores: Vec<f64> = (0..skv)
                    .map(|j| {
                        let krow = &k[((bi * hkv + kh) * skv + j) * d..][..d];
                        let dot: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum();
                        if seen(j) {
                            dot * p.scale as f64
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = w.iter().sum();
                let o = &mut out[((bi * sq + i) * hq + h) * d..][..d];
                for (j, wj) in w.iter().enumerate() {
                    let vrow = &v[((bi * hkv + kh) * skv + j) * d..][..d];
                    for (oe, ve) in o.iter_mut().zip(vrow) {
                        *oe += wj / z * ve;
                    }
                }
            }
        }
    }
    out
}

pub(crate) fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

/// One case: shapes, mask, dtype, and whether q and k/v come strided ([B, S, H, D] transposed).
struct Case {
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    skv: usize,
    d: usize,
    causal: Causal,
    window: Option<usize>,
    dt: DType,
    strided_kv: bool,
}

#[test]
fn sdpa_equals_the_f64_reference() {
    let Some(dev) = gpu() else { return };
    if let Err(why) = xdistill_cudnn::load() {
        panic!("cuDNN did not load on a CUDA device: {why}");
    }
    let mut rng = rng();
    let cases = [
        // b hq hkv sq skv d causal window dtype strided k/v
        Case {
            b: 2,
            hq: 4,
            hkv: 2,
            sq: 37,
            skv: 37,
            d: 64,
            causal: Causal::TopLeft,
            window: None,
            dt: DType::BF16,
            strided_kv: false,
        },
        Case {
            b: 1,
            hq: 8,
            hkv: 1,
            sq: 5,
            skv: 70,
            d: 128,
            causal: Causal::BottomRight,
            window: None,
            dt: DType::BF16,
            strided_kv: true,
        },
        Case {
            b: 1,
            hq: 4,
            hkv: 4,
            sq: 129,
            skv: 129,
            d: 128,
            causal: Causal::TopLeft,
            window: Some(16),
            dt: DType::F16,
            strided_kv: true,
        },
        Case {
            b: 3,
            hq: 6,
            hkv: 2,
            sq: 200,
            skv: 200,
            d: 256,
            causal: Causal::TopLeft,
            window: Some(64),
            dt: DType::BF16,
            strided_kv: false,
        },
        Case {
            b: 1,
            hq: 4,
            hkv: 2,
            sq: 40,
            skv: 300,
            d: 128,
            causal: Causal::BottomRight,
            window: Some(100),
            dt: DType::BF16,
            strided_kv: true,
        },
        Case {
            b: 2,
            hq: 2,
            hkv: 2,
            sq: 17,
            skv: 33,
            d: 64,
            causal: Causal::None,
            window: None,
            dt: DType::F16,
            strided_kv: false,
        },
    ];
    for c in &cases {
        let p = Params {
            scale: 1.0 / (c.d as f32).sqrt(),
            causal: c.causal,
            window: c.window,
        };
        // q always strided: the decoder passes [B, T, H, D] transposed.
        let q = random(&mut rng, &[c.b, c.sq, c.hq, c.d], c.dt, &dev)
            .transpose(1, 2)
            .unwrap();
        let (k, v) = if c.strided_kv {
            let k = random(&mut rng, &[c.b, c.skv, c.hkv, c.d], c.dt, &dev);
            let v = random(&mut rng, &[c.b, c.skv, c.hkv, c.d], c.dt, &dev);
            (k.transpose(1, 2).unwrap(), v.transpose(1, 2).unwrap())
        } else {
            let k = random(&mut rng, &[c.b, c.hkv, c.skv, c.d], c.dt, &dev);
            let v = random(&mut rng, &[c.b, c.hkv, c.skv, c.d], c.dt, &dev);
            (k, v)
        };
        let t0 = Instant::now();
        let out = sdpa(&q, &k, &v, p).unwrap();
        dev.synchronize().unwrap();
        let first = t0.elapsed();
        assert_eq!(out.dims(), &[c.b, c.sq, c.hq, c.d]);
        let got = host(&out);
        assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
        let err = rel_err(&got, &reference(&q, &k, &v, p));
        let tol = if c.dt == DType::BF16 { 1e-2 } else { 2e-3 };
        // The same inputs again: the cached graph, the same bits.
        let t1 = Instant::now();
        let again = host(&sdpa(&q, &k, &v, p).unwrap());
        dev.synchronize().unwrap();
        eprintln!(
            "b={} hq={} hkv={} sq={} skv={} d={} {:?} window={:?} {:?}: rel err {err:.2e} \
             (tol {tol:.0e}); first call {:.1} ms (graph built), second {:.2} ms",
            c.b,
            c.hq,
            c.hkv,
            c.sq,
            c.skv,
            c.d,
            c.causal,
            c.window,
            c.dt,
            first.as_secs_f64() * 1e3,
            t1.elapsed().as_secs_f64() * 1e3
        );
        assert!(err < tol, "relative error {err:.3e} over {tol:.0e}");
        assert_eq!(got, again, "the second run differs from the first");
    }
}

/// What a new length costs: the teacher's batch-invariant mode runs each sequence at its own
/// length, so each new length builds its graph once (44–58 ms on an H200, 2026-11-29). Printed
/// for the GPU log; the outputs are checked like the cases above.
#[test]
fn each_new_length_builds_its_graph_once() {
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    for s in [301, 302, 517, 1000, 2047] {
        let q = random(&mut rng, &[1, s, 16, 128], DType::BF16, &dev)
            .transpose(1, 2)
            .unwrap();
        let k = random(&mut rng, &[1, s, 8, 128], DType::BF16, &dev)
            .transpose(1, 2)
            .unwrap();
        let v = random(&mut rng, &[1, s, 8, 128], DType::BF16, &dev)
            .transpose(1, 2)
            .unwrap();
        let p = Params {
            scale: 128f32.powf(-0.5),
            causal: Causal::TopLeft,
            window: None,
        };
        let t0 = Instant::now();
        let out = sdpa(&q, &k, &v, p).unwrap();
        dev.synchronize().unwrap();
        let built = t0.elapsed();
        let t1 = Instant::now();
        let again = sdpa(&q, &k, &v, p).unwrap();
        dev.synchronize().unwrap();
        eprintln!(
            "length {s}: first call {:.1} ms, cached {:.3} ms",
            built.as_secs_f64() * 1e3,
            t1.elapsed().as_secs_f64() * 1e3
        );
        assert_eq!(host(&out), host(&again));
        if s <= 517 {
            let err = rel_err(&host(&out), &reference(&q, &k, &v, p));
            assert!(err < 1e-2, "length {s}: relative error {err:.3e}");
        }
    }
}

/// `cfg`'s parameters ([`params`]) as bf16 `Var`s on `dev`, and a builder reading them.
pub(crate) fn bf16_vars(
    cfg: &xdistill_shared::hf::ModelConfig,
    dev: &Device,
) -> (Vec<(String, candle_core::Var)>, VarBuilder<'static>) {
    let vars: Vec<(String, candle_core::Var)> = params(cfg)
        .into_iter()
        .map(|(n, t)| {
            let t = t.to_device(dev).unwrap().to_dtype(DType::BF16).unwrap();
            (n, candle_core::Var::from_tensor(&t).unwrap())
        })
        .collect();
    let vb = VarBuilder::from_tensors(
        vars.iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect(),
        DType::BF16,
        dev,
    );
    (vars, vb)
}

/// Each decoder parameter's gradient in `grads` (the LM head's aside: the loss's), on the host;
/// empty where it has none.
pub(crate) fn decoder_grads(
    vars: &[(String, candle_core::Var)],
    grads: &candle_core::backprop::GradStore,
) -> Vec<(String, Vec<f64>)> {
    vars.iter()
        .filter(|(n, _)| n != "lm_head.weight")
        .map(|(n, v)| {
            (
                n.clone(),
                grads.get(v.as_tensor()).map(host).unwrap_or_default(),
            )
        })
        .collect()
}

/// Small decoders whose heads cuDNN takes (head size 64, grouped-query 2:1): Qwen3 (q/k norms),
/// Llama, Mistral with a window of 8, Gemma 3 (local and global layers, its own scale).
pub(crate) fn decoder_cases() -> Vec<(&'static str, xdistill_shared::hf::ModelConfig)> {
    let big = serde_json::json!({"hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 128,
        "max_position_embeddings": 128});
    let with = |extra: serde_json::Value| {
        let mut e = big.clone();
        for (k, v) in extra.as_object().unwrap() {
            e[k] = v.clone();
        }
        e
    };
    vec![
        ("qwen3", config_with("qwen3", with(serde_json::json!({})))),
        ("llama", config_with("llama", with(serde_json::json!({})))),
        (
            "mistral window 8",
            config_with("mistral", with(serde_json::json!({"sliding_window": 8}))),
        ),
        (
            "gemma3",
            config_with(
                "gemma3_text",
                with(
                    serde_json::json!({"num_hidden_layers": 3, "sliding_window": 8,
                    "sliding_window_pattern": 3, "query_pre_attn_scalar": 48,
                    "rope_local_base_freq": 100.0, "tie_word_embeddings": true}),
                ),
            ),
        ),
    ]
}

/// Decoders in bf16 on the GPU: cuDNN's attention against the eager path (a whole forward, a
/// forward in two chunks over a KV cache, windows, Gemma 3's scale), hidden states compared
/// (both round to bf16 at every op, differently, over 2–3 layers: 3e-2 of the norm; the op's own
/// precision is checked against f64 above).
#[test]
fn decoders_through_cudnn_match_the_eager_path() {
    let Some(dev) = gpu() else { return };
    let cases = decoder_cases();
    let ids: Vec<u32> = (0..41u32).map(|i| (i * 7 + 3) % 50).collect();
    for (name, cfg) in cases {
        let vb = VarBuilder::from_tensors(params(&cfg), DType::BF16, &dev);
        let mut m = Decoder::new(&cfg, vb, Ops::Fused).unwrap();
        let x = Tensor::new(ids.as_slice(), &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        m.set_attention(AttnBackend::Eager);
        let eager = m.forward_hidden(&x, None, None, None).unwrap();
        m.set_attention(AttnBackend::Cudnn);
        let fused = m.forward_hidden(&x, None, None, None).unwrap();
        // Two chunks over a cache: the second chunk's queries are the last of its keys.
        let mut cache = KvCache::for_sequence(ids.len());
        let a = m
            .forward_hidden(&x.narrow(1, 0, 25).unwrap(), Some(&mut cache), None, None)
            .unwrap();
        let b = m
            .forward_hidden(&x.narrow(1, 25, 16).unwrap(), Some(&mut cache), None, None)
            .unwrap();
        let chunked = Tensor::cat(&[&a, &b], 1).unwrap();
        let e = host(&eager);
        for (what, t) in [("whole", &fused), ("chunked", &chunked)] {
            let err = rel_err(&host(t), &e);
            eprintln!("{name}: cuDNN {what} vs eager: rel err {err:.2e}");
            assert!(err < 3e-2, "{name} {what}: relative error {err:.3e}");
        }
    }
    // Every forward above ran through cuDNN: a refused shape would have run eager and agreed.
    let refused = xdistill_shared::model::cudnn_refused_shapes();
    assert!(refused.is_empty(), "cuDNN refused {refused:?}");
}

/// Attention's backward in f64 by loops, given the output's gradient `d_o` `[B, Sq, Hq, D]`
/// (top-left causal with an optional window; `Sq == Skv`): dq `[B, Hq, S, D]`, dk and dv
/// `[B, Hkv, S, D]` (grouped-query heads summed), and each query's log-sum-exp `[B, Hq, S]`.
fn reference_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    p: Params,
) -> [Vec<f64>; 4] {
    let (b, hq, s, d) = q.dims4().unwrap();
    let (_, hkv, _, _) = k.dims4().unwrap();
    let (q, k, v, d_o) = (host(q), host(k), host(v), host(d_o));
    let scale = p.scale as f64;
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; b * hq * s * d],
        vec![0.0; b * hkv * s * d],
        vec![0.0; b * hkv * s * d],
    );
    let mut lse = vec![0.0; b * hq * s];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            let at = |heads: usize, head: usize, i: usize| {
                ((bi * heads + head) * s + i) * d..((bi * heads + head) * s + i + 1) * d
            };
            for i in 0..s {
                let seen: Vec<usize> = (0..=i)
                    .filter(|&j| p.window.is_none_or(|w| i < j + w))
                    .collect();
                let qi = &q[at(hq, h, i)];
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&j| {
                        let kj = &k[at(hkv, kh, j)];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                lse[(bi * hq + h) * s + i] = m + z.ln();
                let probs: Vec<f64> = scores.iter().map(|x| (x - m).exp() / z).collect();
                // d_o is [B, S, Hq, D].
                let doi = &d_o[((bi * s + i) * hq + h) * d..][..d];
                let dp: Vec<f64> = seen
                    .iter()
                    .map(|&j| doi.iter().zip(&v[at(hkv, kh, j)]).map(|(a, b)| a * b).sum())
                    .collect();
                let row: f64 = probs.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (n, &j) in seen.iter().enumerate() {
                    let ds = probs[n] * (dp[n] - row) * scale;
                    let (kr, qr) = (at(hkv, kh, j), at(hq, h, i));
                    for e in 0..d {
                        dv[kr.start + e] += probs[n] * doi[e];
                        dq[qr.start + e] += ds * k[kr.start + e];
                        dk[kr.start + e] += ds * q[qr.start + e];
                    }
                }
            }
        }
    }
    [dq, dk, dv, lse]
}

/// The training forward (output and softmax statistics) and backward (dq, dk, dv) against the
/// f64 loops on fresh random inputs: bf16 and f16, odd lengths, grouped-query heads, windows,
/// head sizes 64 to 256; the backward twice gives the same bits (cuDNN's deterministic
/// algorithm).
#[test]
fn training_sdpa_and_its_backward_equal_the_f64_reference() {
    let Some(dev) = gpu() else { return };
    let mut rng = rng();
    // b, hq, hkv, s, d, window, dtype
    let cases = [
        (2, 4, 2, 37, 64, None, DType::BF16),
        (1, 8, 1, 130, 128, None, DType::BF16),
        (1, 4, 4, 129, 128, Some(16), DType::F16),
        (2, 6, 2, 200, 256, Some(64), DType::BF16),
        (3, 16, 8, 64, 128, None, DType::F16),
    ];
    for (b, hq, hkv, s, d, window, dt) in cases {
        let p = Params {
            scale: 1.0 / (d as f32).sqrt(),
            causal: Causal::TopLeft,
            window,
        };
        // [B, H, S, D] contiguous, as the training pass hands them over.
        let q = random(&mut rng, &[b, hq, s, d], dt, &dev);
        let k = random(&mut rng, &[b, hkv, s, d], dt, &dev);
        let v = random(&mut rng, &[b, hkv, s, d], dt, &dev);
        let d_o = random(&mut rng, &[b, s, hq, d], dt, &dev);
        let (out, stats) = xdistill_cudnn::sdpa_train(&q, &k, &v, p).unwrap();
        assert_eq!(out.dims(), &[b, s, hq, d]);
        assert_eq!(stats.dims(), &[b, hq, s, 1]);
        let grads = xdistill_cudnn::sdpa_backward((&q, &k, &v), &out, &stats, &d_o, p).unwrap();
        let again = xdistill_cudnn::sdpa_backward((&q, &k, &v), &out, &stats, &d_o, p).unwrap();
        let [dq, dk, dv, lse] = reference_backward(&q, &k, &v, &d_o, p);
        let tol = if dt == DType::BF16 { 2e-2 } else { 4e-3 };
        let checks = [
            ("out", rel_err(&host(&out), &reference(&q, &k, &v, p))),
            ("stats", rel_err(&host(&stats), &lse)),
            ("dq", rel_err(&host(&grads.0), &dq)),
            ("dk", rel_err(&host(&grads.1), &dk)),
            ("dv", rel_err(&host(&grads.2), &dv)),
        ];
        eprintln!("b={b} hq={hq} hkv={hkv} s={s} d={d} window={window:?} {dt:?}: {checks:?}");
        for (what, err) in checks {
            assert!(err < tol, "{what}: relative error {err:.3e} over {tol:.0e}");
        }
        for (a, b) in [
            (&grads.0, &again.0),
            (&grads.1, &again.1),
            (&grads.2, &again.2),
        ] {
            assert_eq!(host(a), host(b), "the backward's second run differs");
        }
    }
}

/// A whole training pass in bf16 on the GPU with cuDNN's attention core against the blockwise
/// one: hidden states and every parameter's gradient (selective and checkpointed), for the
/// decoders of [`decoder_cases`]. Both round to bf16 at every op, differently: compared at 3e-2
/// (hidden) and 6e-2 (gradients) of the norm.
#[test]
fn training_pass_through_cudnn_matches_the_blockwise_core() {
    use xdistill_shared::model::Activations;
    let Some(dev) = gpu() else { return };
    let cases = decoder_cases();
    let rows: Vec<u32> = (0..2 * 41u32).map(|i| (i * 7 + 3) % 50).collect();
    let ids = Tensor::from_vec(rows, (2, 41), &dev).unwrap();
    for (name, cfg) in cases {
        let (vars, vb) = bf16_vars(&cfg, &dev);
        let mut m = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
        let mut rng = rng();
        let mut grad = None;
        let mut run = |m: &Decoder, act| {
            let pass = m.train_forward(&ids, act).unwrap();
            let g = grad
                .get_or_insert_with(|| random(&mut rng, pass.hidden().dims(), DType::BF16, &dev))
                .clone();
            let hidden = host(pass.hidden());
            let grads = pass.backward(&g).unwrap();
            (hidden, decoder_grads(&vars, &grads))
        };
        m.set_attention(AttnBackend::Eager);
        let (h0, g0) = run(&m, Activations::Checkpoint);
        m.set_attention(AttnBackend::Cudnn);
        for act in [Activations::Selective, Activations::Checkpoint] {
            let (h1, g1) = run(&m, act);
            let err = rel_err(&h1, &h0);
            eprintln!("{name} {act:?}: hidden rel err {err:.2e}");
            assert!(err < 3e-2, "{name} {act:?} hidden: {err:.3e}");
            for ((n, a), (_, b)) in g1.iter().zip(&g0) {
                assert!(
                    !b.is_empty() && a.len() == b.len(),
                    "{name}: {n} has no gradient"
                );
                let err = rel_err(a, b);
                assert!(err < 6e-2, "{name} {act:?} {n}: gradient rel err {err:.3e}");
            }
        }
    }
    // Every pass above ran through cuDNN: a refused shape would have run blockwise and agreed.
    let refused = xdistill_shared::model::cudnn_refused_shapes();
    assert!(refused.is_empty(), "cuDNN refused {refused:?}");
}
