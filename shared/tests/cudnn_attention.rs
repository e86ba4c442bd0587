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
use std::collections::HashMap;
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

/// The shape buckets (`XDISTILL_ATTENTION_BUCKET`, 32 rows by default; `attn_rows.rs`): a
/// decoder's forward at 301, 302, 317 and 320 positions (one bucket of 32: 320) builds one
/// graph between them and 321 a second, each length's hidden states near the eager path's (two
/// bf16 paths; a padded row leaking into a real one would be off by order 1); the packed forward of 301, 317 and
/// 455 positions reads the same graphs through its sequences' views (their strides do not
/// depend on the batch around them) and builds only the one of 455's bucket (480). The count
/// is the process's: one test at a time (`--test-threads=1`, as the GPU check runs them), heads
/// of a shape no other test uses.
#[test]
fn lengths_of_one_bucket_share_one_graph() {
    use xdistill_shared::model::{attention_bucket, PackedSeq};
    let Some(dev) = gpu() else { return };
    // Heads of a shape no other test here uses (6 × 32, grouped 3:1): the graphs this test
    // counts are its own, whatever ran before it in the process.
    let cfg = config_with(
        "qwen3",
        serde_json::json!({"hidden_size": 192, "num_attention_heads": 6,
            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
            "max_position_embeddings": 1024}),
    );
    let vb = VarBuilder::from_tensors(params(&cfg), DType::BF16, &dev);
    let mut m = Decoder::new(&cfg, vb, Ops::Fused).unwrap();
    let bucket = attention_bucket();
    let tokens = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 7 + 3) % 50).collect() };
    let mut seen = std::collections::HashSet::new();
    for n in [301usize, 302, 317, 320, 321] {
        let x = Tensor::from_vec(tokens(n), (1, n), &dev).unwrap();
        m.set_attention(AttnBackend::Cudnn);
        let before = xdistill_cudnn::graphs_built();
        let fused = m.forward_hidden(&x, None, None, None).unwrap();
        let built = xdistill_cudnn::graphs_built() - before;
        let new_bucket = seen.insert(n.div_ceil(bucket) * bucket);
        m.set_attention(AttnBackend::Eager);
        let eager = m.forward_hidden(&x, None, None, None).unwrap();
        let err = rel_err(&host(&fused), &host(&eager));
        eprintln!("length {n} (bucket {bucket}): {built} graph(s) built, rel err {err:.2e}");
        assert_eq!(built, u64::from(new_bucket), "length {n}");
        // Two bf16 paths over 2 layers (3e-2 at 41 positions above); a padding that reached a
        // real row would be off by order 1.
        assert!(err < 5e-2, "length {n}: relative error {err:.3e}");
    }
    m.set_attention(AttnBackend::Cudnn);
    let lens = [301usize, 317, 455];
    let ids: Vec<Vec<u32>> = lens.iter().map(|&n| tokens(n)).collect();
    let seqs: Vec<PackedSeq> = ids
        .iter()
        .map(|t| PackedSeq {
            ids: t,
            total: t.len(),
        })
        .collect();
    let before = xdistill_cudnn::graphs_built();
    let packed = m.forward_packed(&seqs, 256).unwrap();
    let built = xdistill_cudnn::graphs_built() - before;
    let new_buckets = lens
        .iter()
        .filter(|&&n| seen.insert(n.div_ceil(bucket) * bucket))
        .count() as u64;
    assert_eq!(built, new_buckets, "the packed forward's graphs");
    let mut at = 0;
    for (n, t) in lens.iter().zip(&ids) {
        let x = Tensor::from_vec(t.clone(), (1, *n), &dev).unwrap();
        let alone = m.forward_hidden(&x, None, None, None).unwrap();
        let rows = packed.narrow(0, at, *n).unwrap();
        let err = rel_err(&host(&rows), &host(&alone));
        eprintln!("packed, {n} positions: rel err {err:.2e} against its own forward");
        assert!(err < 5e-2, "packed {n}: relative error {err:.3e}");
        at += n;
    }
    let refused = xdistill_shared::model::cudnn_refused_shapes();
    assert!(refused.is_empty(), "cuDNN refused {refused:?}");
}

/// Parameters of `cfg` scaled like a trained model's rather than like the tiny models' of
/// [`params`] (whose projections, at hidden 256, multiply activations about threefold each and
/// sharpen attention to nearly one-hot: there any two bf16 roundings of a pass drift 10–20 %
/// apart, the f64-exact one included, and a comparison of paths says nothing). Projections of
/// standard deviation 1/√hidden, embeddings as in [`params`], norms near their identity (1, or 0
/// for Gemma's `1 + w`). Deterministic.
fn conditioned_params(cfg: &xdistill_shared::hf::ModelConfig) -> HashMap<String, Tensor> {
    use xdistill_shared::model::{param_specs, Init};
    let mut rng = ChaCha8Rng::seed_from_u64(12345);
    // uniform(-0.5, 0.5) has standard deviation 1/√12.
    let std = (12.0 / cfg.hidden_size as f32).sqrt();
    param_specs(cfg, 0.02)
        .into_iter()
        .map(|s| {
            let n: usize = s.shape.iter().product();
            let mut u = || rng.random_range(-0.5f32..0.5);
            let v: Vec<f32> = match s.init {
                Init::Normal(_) if s.name.contains("embed") => (0..n).map(|_| u() * 0.6).collect(),
                Init::Normal(_) => (0..n).map(|_| u() * std).collect(),
                Init::Ones => (0..n).map(|_| 1.0 + u() * 0.5).collect(),
                Init::Zeros => (0..n).map(|_| u() * 0.5).collect(),
            };
            (s.name, Tensor::from_vec(v, s.shape, &Device::Cpu).unwrap())
        })
        .collect()
}

/// `cfg`'s [`conditioned_params`], rounded to bf16 once, as `Var`s of `dt` on `dev`, and a
/// builder reading them: a bf16 pass and its f32 reference run the same model.
pub(crate) fn vars_of(
    cfg: &xdistill_shared::hf::ModelConfig,
    dt: DType,
    dev: &Device,
) -> (Vec<(String, candle_core::Var)>, VarBuilder<'static>) {
    let mut params: Vec<(String, Tensor)> = conditioned_params(cfg).into_iter().collect();
    // Sorted by name: passes of the same weights list their gradients in the same order.
    params.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<(String, candle_core::Var)> = params
        .into_iter()
        .map(|(n, t)| {
            let t = t.to_dtype(DType::BF16).unwrap().to_dtype(dt).unwrap();
            let t = t.to_device(dev).unwrap();
            (n, candle_core::Var::from_tensor(&t).unwrap())
        })
        .collect();
    let vb = VarBuilder::from_tensors(
        vars.iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect(),
        dt,
        dev,
    );
    (vars, vb)
}

/// What a training pass gives, on the host: its hidden states (or logits) and each decoder
/// parameter's gradient ([`decoder_grads`]).
pub(crate) struct PassOut {
    pub(crate) hidden: Vec<f64>,
    pub(crate) grads: Vec<(String, Vec<f64>)>,
}

/// `new`, a bf16 pass, is at least as accurate as `base`, the bf16 pass it replaces, both held
/// against `reference`, the f32 pass of the same weights. Two bf16 passes round differently at
/// every op, so they are not compared with each other (how far apart they drift depends on the
/// model's conditioning, not on either path) but each with the exact one: hidden states within
/// 1.15× base's error; the gradients' errors summed within 1.15× base's; each gradient within
/// 2× + 5e-3 (one parameter's error is a noisy figure: a wrong gradient is off by ~1).
/// On the CPU, the fused ops' f64 reference against the composed ops over 80 draws: summed
/// ratio ≤ 0.98, one gradient's ≤ 1.38 (Gemma's q/k-norm weights, errors ~1.5e-2).
pub(crate) fn assert_as_accurate(case: &str, new: &PassOut, base: &PassOut, reference: &PassOut) {
    let (hn, hb) = (
        rel_err(&new.hidden, &reference.hidden),
        rel_err(&base.hidden, &reference.hidden),
    );
    let mut sums = (0.0f64, 0.0f64);
    let mut worst = (String::new(), 0.0f64, 0.0f64);
    for (((name, n), (_, b)), (_, r)) in new.grads.iter().zip(&base.grads).zip(&reference.grads) {
        assert!(
            !r.is_empty() && n.len() == r.len() && b.len() == r.len(),
            "{case}: {name} has no gradient"
        );
        let (en, eb) = (rel_err(n, r), rel_err(b, r));
        assert!(
            en <= 2.0 * eb + 5e-3,
            "{case}: {name}'s gradient is off the f32 one by {en:.3e} (the bf16 pass it replaces: {eb:.3e})"
        );
        sums = (sums.0 + en, sums.1 + eb);
        if en / eb > worst.1 / worst.2.max(f64::MIN_POSITIVE) {
            worst = (name.clone(), en, eb);
        }
    }
    eprintln!(
        "{case}: against f32, hidden {hn:.2e} (was {hb:.2e}); gradients summed {:.2e} (was {:.2e}); \
         the worst ratio {} {:.2e} (was {:.2e})",
        sums.0, sums.1, worst.0, worst.1, worst.2
    );
    assert!(
        hn <= 1.15 * hb + 1e-3,
        "{case}: hidden states off the f32 ones by {hn:.3e} (the bf16 pass it replaces: {hb:.3e})"
    );
    assert!(
        sums.0 <= 1.15 * sums.1,
        "{case}: gradients off the f32 ones by {:.3e} summed (the bf16 pass it replaces: {:.3e})",
        sums.0,
        sums.1
    );
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

/// A whole training pass in bf16 on the GPU with cuDNN's attention core is at least as accurate
/// as one with the blockwise core it replaces: hidden states and every parameter's gradient
/// (selective and checkpointed) against the f32 pass of the same weights
/// ([`assert_as_accurate`]), for the decoders of [`decoder_cases`].
#[test]
fn training_pass_through_cudnn_matches_the_blockwise_core() {
    use xdistill_shared::model::Activations;
    let Some(dev) = gpu() else { return };
    let rows: Vec<u32> = (0..2 * 41u32).map(|i| (i * 7 + 3) % 50).collect();
    let ids = Tensor::from_vec(rows, (2, 41), &dev).unwrap();
    let mut rng = rng();
    for (name, cfg) in decoder_cases() {
        let g = random(&mut rng, &[2, 41, cfg.hidden_size], DType::BF16, &dev);
        let run = |dt: DType, backend: AttnBackend, act: Activations| {
            let (vars, vb) = vars_of(&cfg, dt, &dev);
            let mut m = Decoder::new(&cfg, vb, Ops::Differentiable).unwrap();
            m.set_attention(backend);
            let pass = m.train_forward(&ids, act).unwrap();
            let hidden = host(pass.hidden());
            let grads = pass.backward(&g.to_dtype(dt).unwrap()).unwrap();
            PassOut {
                hidden,
                grads: decoder_grads(&vars, &grads),
            }
        };
        let reference = run(DType::F32, AttnBackend::Eager, Activations::Checkpoint);
        let base = run(DType::BF16, AttnBackend::Eager, Activations::Checkpoint);
        for act in [Activations::Selective, Activations::Checkpoint] {
            let new = run(DType::BF16, AttnBackend::Cudnn, act);
            assert_as_accurate(&format!("{name} {act:?}"), &new, &base, &reference);
        }
    }
    // Every pass above ran through cuDNN: a refused shape would have run blockwise and agreed.
    let refused = xdistill_shared::model::cudnn_refused_shapes();
    assert!(refused.is_empty(), "cuDNN refused {refused:?}");
}
