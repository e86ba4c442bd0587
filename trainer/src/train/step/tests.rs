//! The chunked micro-batch gradients ([`micro_grads`]) against the unchunked reference
//! ([`micro_loss`] + `backward`, plain autograd): loss values and every parameter's gradient,
//! for each same- and cross-tokenizer loss, with tiny forced head chunks (1 and 3 rows) and the
//! budget, kept and checkpointed activations, tied and untied heads; f64 to 1e-9 and f32 to
//! 1e-5 (relative).

use super::*;
use crate::align::{Chunk, ChunkKind, TokenizedPair};
use crate::collate::Encoded;
use crate::config::ActivationCheckpointing;
use crate::loss::full_vocab::TeacherHead;
use crate::loss::LossConfig;
use crate::loss::{Anchor, KdConfig};
use crate::loss::{CeConfig, Projection, TailMode, Temperature};
use crate::train::head_chunks::HeadOpts;
use crate::train::pairing::cross::xtoken_batch;
use crate::train::pairing::Pairing;
use crate::train::testutil::{answer, assert_rel, assert_same_grads, flat, ids, tiny, V};
use candle_core::Device;
use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const K: usize = 5;

fn cfg(kd: KdConfig, tail: Option<TailMode>, ce: CeConfig) -> LossConfig {
    LossConfig {
        kd,
        tail,
        temperature: Temperature::new(1.5).unwrap(),
        kd_weight: 0.7,
        ce,
    }
}

/// Every way the head may be cut and the decoder may keep activations.
fn head_opts() -> Vec<HeadOpts> {
    let mut v = vec![];
    for activations in [ActivationCheckpointing::Off, ActivationCheckpointing::On] {
        for chunk_rows in [1, 3, 0] {
            v.push(HeadOpts {
                activations,
                chunk_rows,
            });
        }
    }
    v
}

/// Compares [`micro_grads`] with the reference for `items` under every head option.
fn check(pairing: Pairing, loss: &LossConfig, items: &[Item], scores: &[SequenceScores], k: usize) {
    let refs: Vec<&SequenceScores> = scores.iter().collect();
    let norm = {
        let mut u = units(items);
        // A step bigger than this micro-batch (the losses are normalised by the step's units).
        u.kd *= 1.5;
        u.ce *= 2.0;
        u
    };
    for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 1e-5)] {
        for tied in [false, true] {
            let (model, vm) = tiny(tied, dtype, 5);
            let mut ctx = LossCtx {
                model: &model,
                k,
                loss,
                pairing,
                device: &Device::Cpu,
                micro_batch: items.len(),
                head: HeadOpts::default(),
            };
            let (l, want) = micro_loss(&ctx, items, &refs, norm).unwrap();
            let want_grads = l.backward().unwrap();
            for opts in head_opts() {
                ctx.head = opts;
                let case = format!("{:?} {dtype:?} tied {tied} {opts:?}", loss.kd);
                let (grads, got) = micro_grads(&ctx, items, &refs, norm, None).unwrap();
                assert_rel(got.kd.loss, want.kd.loss, tol, &format!("{case}: kd"));
                assert_eq!(got.kd.count, want.kd.count, "{case}: kd count");
                for (a, b) in [
                    (got.kd.teacher_topk_mass, want.kd.teacher_topk_mass),
                    (got.kd.student_topk_mass, want.kd.student_topk_mass),
                ] {
                    assert_eq!(a.is_some(), b.is_some(), "{case}: masses");
                    if let (Some(a), Some(b)) = (a, b) {
                        assert_rel(a, b, tol, &format!("{case}: mass"));
                    }
                }
                assert_eq!(got.ce.is_some(), want.ce.is_some(), "{case}: ce");
                if let (Some(a), Some(b)) = (got.ce, want.ce) {
                    assert_rel(a, b, tol, &format!("{case}: ce"));
                }
                assert_rel(got.kd_scale, want.kd_scale, tol, &format!("{case}: scale"));
                assert_eq!(got.units, want.units);
                assert_same_grads(&vm, &grads, &want_grads, tol, &case);
            }
        }
    }
}

/// Three same-tokenizer sequences of different lengths (padding, prompts not trained).
fn same_batch(seed: u64) -> (Vec<Item>, Vec<SequenceScores>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut items = vec![];
    let mut scores = vec![];
    for (len, loss_from) in [(9, 1), (6, 3), (11, 4)] {
        items.push(Item::Same(Encoded {
            ids: ids(&mut rng, len),
            loss_from,
        }));
        scores.push(answer(&mut rng, len - 1, K, V));
    }
    (items, scores)
}

#[test]
fn same_tokenizer_chunks_equal_the_whole_loss() {
    let (items, scores) = same_batch(1);
    let losses = [
        cfg(
            KdConfig::ForwardKl {},
            Some(TailMode::Bucket),
            CeConfig::Weight { weight: 0.3 },
        ),
        cfg(KdConfig::ReverseKl {}, None, CeConfig::Dynamic {}),
        cfg(KdConfig::Jsd { beta: 0.3 }, Some(TailMode::Renormalize), {
            CeConfig::None {}
        }),
        cfg(
            KdConfig::ForwardKl {},
            Some(TailMode::Ignore),
            CeConfig::Dynamic {},
        ),
        cfg(
            KdConfig::TotalVariation {},
            Some(TailMode::Bucket),
            CeConfig::Weight { weight: 0.3 },
        ),
    ];
    for loss in &losses {
        check(Pairing::Same, loss, &items, &scores, K);
    }
}

/// The same through the fused top-k loss and cross-entropy (forced on in this thread: the CPU
/// runs their f64 reference, and the decoder's fused ops): their figures stay on the device
/// (`KdFigures::Pending`) and the chunks' sums are read back once per micro-batch; under a
/// linear mix each head chunk runs by hand (`loss::fused_head`: both terms from one kernel
/// pass, their gradient written over the logits, the head's gradient summed in place), under
/// the dynamic one by hand too, in two passes (the totals first, then the chunks with the
/// factor); the checkpointed layers run by hand (`train_layer.rs`).
#[test]
fn same_tokenizer_chunks_equal_the_whole_loss_through_the_fused_loss() {
    use xdistill_shared::model::device_ops;
    let (items, scores) = same_batch(2);
    let losses = [
        cfg(
            KdConfig::ForwardKl {},
            Some(TailMode::Bucket),
            CeConfig::Weight { weight: 0.3 },
        ),
        cfg(KdConfig::Jsd { beta: 0.3 }, None, CeConfig::Dynamic {}),
        cfg(KdConfig::Jsd { beta: 0.3 }, Some(TailMode::Renormalize), {
            CeConfig::None {}
        }),
        cfg(
            KdConfig::TotalVariation {},
            Some(TailMode::Ignore),
            CeConfig::Weight { weight: 0.0 },
        ),
    ];
    let (model, _) = tiny(true, DType::F32, 5);
    assert!(!model.head_sinks() && !model.trains_by_hand());
    device_ops::force_in_this_thread(Some(true));
    let probe = Tensor::zeros((1, V), DType::F32, &Device::Cpu).unwrap();
    assert!(xdistill_kernels::TopkKd::runs_on(&probe));
    // The head's gradient goes to a sink (linear mixes) and checkpointed layers run by hand.
    assert!(model.head_sinks() && model.trains_by_hand());
    for loss in &losses {
        check(Pairing::Same, loss, &items, &scores, K);
    }
    device_ops::force_in_this_thread(None);
}

/// Forward KL with a tail bucket plus 0.3 × CE: the bf16 tests' loss (both terms through the
/// head chunks).
fn kl_with_ce() -> LossConfig {
    cfg(
        KdConfig::ForwardKl {},
        Some(TailMode::Bucket),
        CeConfig::Weight { weight: 0.3 },
    )
}

/// A same-tokenizer context on the CPU: `micro_batch` items at once, head chunks of 3 rows.
fn same_ctx<'a>(
    model: &'a xdistill_shared::model::Decoder,
    loss: &'a LossConfig,
    micro_batch: usize,
    activations: ActivationCheckpointing,
) -> LossCtx<'a> {
    LossCtx {
        model,
        k: K,
        loss,
        pairing: Pairing::Same,
        device: &Device::Cpu,
        micro_batch,
        head: HeadOpts {
            activations,
            chunk_rows: 3,
        },
    }
}

/// A tied head in bf16 compute: the head's gradient summed over the chunks in f32 and the
/// embedding's bf16 gradient from the decoder meet in `HeadOut::finish`, which adds the second
/// into the first in place. The micro-batch's gradients equal the f32 student's of the same
/// weights to bf16 accuracy, every tensor's (the tied one's included: without either part its
/// cosine falls far below the bound), through the composed losses and through the fused head
/// chunks by hand (forced in this thread: the CPU runs their f64 reference).
#[test]
fn a_tied_bf16_head_sums_its_two_gradients_in_f32() {
    use xdistill_shared::model::device_ops;
    let (items, scores) = same_batch(3);
    let refs: Vec<&SequenceScores> = scores.iter().collect();
    let loss = kl_with_ce();
    let norm = units(&items);
    let grads_of = |dtype: DType| {
        let (model, vm) = tiny(true, dtype, 5);
        let ctx = same_ctx(
            &model,
            &loss,
            items.len(),
            ActivationCheckpointing::default(),
        );
        let (g, _) = micro_grads(&ctx, &items, &refs, norm, None).unwrap();
        let data = vm.data().lock().unwrap();
        let mut by_name: Vec<(String, Vec<f64>)> = data
            .iter()
            .filter_map(|(n, v)| Some((n.clone(), flat(g.get(v.as_tensor())?))))
            .collect();
        by_name.sort_by(|a, b| a.0.cmp(&b.0));
        by_name
    };
    for fused in [false, true] {
        device_ops::force_in_this_thread(Some(fused));
        let (want, got) = (grads_of(DType::F32), grads_of(DType::BF16));
        device_ops::force_in_this_thread(None);
        assert_eq!(
            want.len(),
            got.len(),
            "fused {fused}: tensors with a gradient"
        );
        for ((name, w), (_, g)) in want.iter().zip(&got) {
            let dot: f64 = w.iter().zip(g).map(|(a, b)| a * b).sum();
            let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
            let cos = dot / (norm(w) * norm(g)).max(1e-300);
            assert!(cos > 0.995, "fused {fused}: {name} gradient cosine {cos}");
        }
    }
}

/// Summing each layer's gradients into the accumulator as the backward leaves the layer
/// ([`GradAccumulator::absorb`]) gives the sums adding the whole micro-batch's at once gives, bit
/// for bit, over two micro-batches into f32 sums of bf16 compute copies (the trainer's setup:
/// `Student::grad_keys`); the micro-batch's returned gradients then hold no layer's (they were
/// freed as the backward went), only the embedding's and the head's. Tied and untied heads,
/// kept (taped), selective and checkpointed passes, the composed and the fused layer ops.
#[test]
fn layer_gradients_summed_as_the_backward_goes_equal_the_sums_at_the_end() {
    use crate::optim::GradAccumulator;
    use candle_core::Var;
    use xdistill_shared::model::device_ops;
    let (items, scores) = same_batch(7);
    let refs: Vec<&SequenceScores> = scores.iter().collect();
    let loss = kl_with_ce();
    let norm = units(&items);
    let half = items.len() / 2;
    for tied in [false, true] {
        let (model, vm) = tiny(tied, DType::BF16, 11);
        let data = vm.data().lock().unwrap();
        let mut named: Vec<(&String, &Var)> = data.iter().collect();
        named.sort_by(|a, b| a.0.cmp(b.0));
        // f32 masters (only their shapes and dtype matter here) for the bf16 vars the decoder
        // reads, which key the gradients.
        let keys: Vec<Tensor> = named.iter().map(|(_, v)| v.as_tensor().clone()).collect();
        let masters: Vec<Var> = keys
            .iter()
            .map(|k| Var::zeros(k.shape(), DType::F32, &Device::Cpu).unwrap())
            .collect();
        for activations in [
            ActivationCheckpointing::Off,
            ActivationCheckpointing::Selective,
            ActivationCheckpointing::On,
        ] {
            for fused in [false, true] {
                device_ops::force_in_this_thread(Some(fused));
                let ctx = same_ctx(&model, &loss, items.len(), activations);
                let case = format!("tied {tied} {activations:?} fused {fused}");
                let mut sums = Vec::new();
                for as_it_goes in [false, true] {
                    let mut acc = GradAccumulator::with_keys(masters.clone(), keys.clone());
                    for range in [0..half, half..items.len()] {
                        let (part, r) = (&items[range.clone()], &refs[range]);
                        let acc_now = as_it_goes.then_some(&mut acc);
                        let (g, _) = micro_grads(&ctx, part, r, norm, acc_now).unwrap();
                        // What is left: with the sums made as the backward went (a pass layer
                        // by layer), the embedding's and the head's, no layer's.
                        let layers_left = named
                            .iter()
                            .filter(|(n, v)| {
                                n.starts_with("model.layers.") && g.get(v.as_tensor()).is_some()
                            })
                            .count();
                        let by_layer = as_it_goes && activations != ActivationCheckpointing::Off;
                        assert_eq!(layers_left == 0, by_layer, "{case}: {layers_left} left");
                        acc.add(&g).unwrap();
                    }
                    acc.end_shard().unwrap();
                    let got = acc.finish().unwrap();
                    sums.push(
                        got.0
                            .iter()
                            .map(|t| flat(t).iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                            .collect::<Vec<_>>(),
                    );
                }
                device_ops::force_in_this_thread(None);
                assert_eq!(sums[0].len(), keys.len());
                for (i, (a, b)) in sums[0].iter().zip(&sums[1]).enumerate() {
                    assert_eq!(a, b, "{case}: {} differs", named[i].0);
                }
            }
        }
    }
}

/// Teacher vocabulary of the cross-tokenizer fixtures.
const VT: usize = 30;

/// A projection from the student's [`V`] ids to [`VT`] teacher ids: every third student id maps
/// exactly (one-hot, weight 1), the others to two teacher ids; each teacher id's first student
/// token is known for most ids.
fn projection(rng: &mut ChaCha8Rng) -> Projection {
    projection_onto(rng, VT)
}

/// [`projection`] onto `vt` teacher ids.
fn projection_onto(rng: &mut ChaCha8Rng, vt: usize) -> Projection {
    let (mut indptr, mut indices, mut weights) = (vec![0usize], vec![], vec![]);
    for s in 0..V {
        let a = (s * 7 % vt) as u32;
        if s % 3 == 0 {
            indices.push(a);
            weights.push(1.0);
        } else {
            let b = ((s * 7 + 1 + s % 5) % vt) as u32;
            let w = rng.random_range(0.2..0.8f32);
            indices.extend([a, b]);
            weights.extend([w, 1.0 - w]);
        }
        indptr.push(indices.len());
    }
    let first: Vec<Option<u32>> = (0..vt)
        .map(|u| (u % 4 != 3).then(|| ((u * 3) % V) as u32))
        .collect();
    Projection::from_csr(V, vt, &indptr, &indices, &weights)
        .unwrap()
        .with_teacher_first(first)
        .unwrap()
}

/// An aligned pair whose chunks have these (student, teacher) token counts; the text is a byte
/// per chunk. `loss_start` bytes are context.
fn pair(rng: &mut ChaCha8Rng, sizes: &[(usize, usize)], loss_start: usize) -> Item {
    let (mut s, mut t) = (0, 0);
    let mut chunks = vec![];
    for (i, &(a, b)) in sizes.iter().enumerate() {
        chunks.push(Chunk {
            student: s..s + a,
            teacher: t..t + b,
            bytes: i..i + 1,
            kind: ChunkKind::Text,
        });
        s += a;
        t += b;
    }
    let teacher_ids = (0..t).map(|_| rng.random_range(0..VT as u32)).collect();
    Item::Cross {
        pair: TokenizedPair {
            text: "x".repeat(sizes.len()),
            student_ids: ids(rng, s),
            teacher_ids,
            chunks,
            truncated: false,
        },
        loss_start,
    }
}

/// Three aligned pairs of different lengths, with one-to-one, many-to-one, one-to-many and long
/// chunks, and a prompt on one of them.
fn cross_batch(seed: u64) -> (Vec<Item>, Vec<SequenceScores>, Projection) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let proj = projection(&mut rng);
    let shapes: [(&[(usize, usize)], usize); 3] = [
        (&[(1, 1), (2, 1), (1, 2), (1, 1), (4, 2), (1, 1), (2, 3)], 0),
        (&[(1, 1), (1, 1), (3, 1), (1, 1), (1, 2)], 2),
        (
            &[
                (1, 1),
                (1, 1),
                (1, 1),
                (2, 2),
                (1, 1),
                (5, 3),
                (1, 1),
                (1, 1),
            ],
            0,
        ),
    ];
    let mut items = vec![];
    let mut scores = vec![];
    for (sizes, start) in shapes {
        let it = pair(&mut rng, sizes, start);
        let tt = it.teacher_ids().len();
        scores.push(answer(&mut rng, tt - 1, K, VT));
        items.push(it);
    }
    (items, scores, proj)
}

#[test]
fn cross_tokenizer_chunks_equal_the_whole_loss() {
    let (items, scores, proj) = cross_batch(2);
    let losses = [
        cfg(
            KdConfig::Pkl {
                anchor: Anchor::First,
            },
            None,
            CeConfig::Weight { weight: 0.2 },
        ),
        cfg(
            KdConfig::Pkl {
                anchor: Anchor::Last,
            },
            Some(TailMode::Bucket),
            CeConfig::Dynamic {},
        ),
        cfg(KdConfig::FirstKl {}, None, CeConfig::None {}),
        cfg(
            KdConfig::Gold {
                matched_weight: 1.0,
                unmatched_weight: 0.5,
            },
            None,
            CeConfig::Weight { weight: 0.1 },
        ),
        cfg(KdConfig::Alm { tau: 3.0 }, None, CeConfig::Dynamic {}),
        cfg(KdConfig::SampledKl {}, None, CeConfig::None {}),
    ];
    for loss in &losses {
        check(Pairing::Cross(&proj), loss, &items, &scores, K);
    }
    check(Pairing::Mixture(&proj), &losses[2], &items, &scores, K);
}

/// Pieces cut inside a row never split an alignment chunk and cover every wanted position.
#[test]
fn cross_pieces_cut_between_chunks() {
    let (items, scores, _) = cross_batch(3);
    let refs: Vec<&SequenceScores> = scores.iter().collect();
    let (xb, _) = xtoken_batch(&items, &refs, K).unwrap();
    let wanted = vec![true; xb.batch * xb.student_len];
    for per in [1, 2, 3, 5, 100] {
        let plan = super::super::xpieces::plan(&xb, per, &wanted);
        let mut seen = vec![0; xb.batch * xb.student_len];
        for p in &plan {
            for r in p.rows(xb.student_len) {
                seen[r as usize] += 1;
            }
            for seg in &p.segments {
                for c in seg.chunks.clone() {
                    let ts = xb.student_len;
                    let row = &xb.student_chunk[seg.row * ts..(seg.row + 1) * ts];
                    for (q, &x) in row.iter().enumerate() {
                        if x == c {
                            assert!(seg.student.contains(&q), "chunk {c} cut at {per}");
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{per}: {seen:?}");
    }
}

/// Validation in forward-only head chunks equals the whole-batch figures.
#[test]
fn chunked_validation_equals_the_whole_batch() {
    let (items, scores) = same_batch(5);
    let (xitems, xscores, proj) = cross_batch(6);
    let loss = cfg(KdConfig::ForwardKl {}, None, CeConfig::None {});
    for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 1e-5)] {
        let (model, _) = tiny(false, dtype, 7);
        let cases: [(Pairing, &[Item], &[SequenceScores]); 3] = [
            (Pairing::Same, &items, &scores),
            (Pairing::Cross(&proj), &xitems, &xscores),
            (Pairing::Mixture(&proj), &xitems, &xscores),
        ];
        for (pairing, items, scores) in cases {
            let refs: Vec<&SequenceScores> = scores.iter().collect();
            let mut ctx = LossCtx {
                model: &model,
                k: K,
                loss: &loss,
                pairing,
                device: &Device::Cpu,
                micro_batch: items.len(),
                head: HeadOpts::default(),
            };
            let want = validation_sums_whole(&ctx, items, &refs).unwrap();
            for chunk_rows in [1, 3, 0] {
                ctx.head.chunk_rows = chunk_rows;
                let got = validation_sums(&ctx, items, &refs).unwrap();
                let case = format!("{dtype:?} rows {chunk_rows}");
                assert_rel(got.kl, want.kl, tol, &format!("{case}: kl"));
                assert_rel(got.ce, want.ce, tol, &format!("{case}: ce"));
                assert_eq!(got.kl_units, want.kl_units, "{case}");
                assert_eq!(got.ce_tokens, want.ce_tokens, "{case}");
            }
        }
    }
}

/// Teacher hidden size of the full-vocabulary fixtures.
const TH: usize = 6;

/// A teacher head `[V + 2, TH]` (padded, with a bias and a logit scale) and, for each of
/// [`same_batch`]'s sequences, hidden states as the client hands them over (f32 bytes, `k` = 0).
fn full_vocab_batch(seed: u64) -> (Vec<Item>, Vec<SequenceScores>, TeacherHead) {
    let (items, _) = same_batch(seed);
    let (scores, head) = hidden_answers(&items, V, seed);
    (items, scores, head)
}

/// A teacher head over `vocab` tokens (2 padding rows, a bias, a logit scale) and hidden states
/// for every teacher position of `items`, as the client hands them over.
fn hidden_answers(items: &[Item], vocab: usize, seed: u64) -> (Vec<SequenceScores>, TeacherHead) {
    let rows_h = vocab + 2;
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 100);
    let mut normal = |n: usize, s: f32| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.random::<f32>() - 0.5) * 2.0 * s)
            .collect()
    };
    let w = Tensor::from_vec(normal(rows_h * TH, 1.0), (rows_h, TH), &Device::Cpu).unwrap();
    let b = Tensor::from_vec(normal(rows_h, 0.5), rows_h, &Device::Cpu).unwrap();
    let head = TeacherHead::new(w, Some(b), 1.3, None, vocab).unwrap();
    let scores = items
        .iter()
        .map(|it| {
            let rows = it.teacher_ids().len() - 1;
            let h = normal(rows * TH, 1.5);
            SequenceScores {
                rows,
                k: 0,
                hidden: h.iter().flat_map(|x| x.to_le_bytes()).collect(),
                ..Default::default()
            }
        })
        .collect();
    (scores, head)
}

/// The teacher's whole distribution as a top-k answer with K = V, computed in f64 from the head
/// and the hidden states (`log_softmax(scale · (W h + b) / τ)` over the first V rows), with each
/// row's log-prob of `items`' next teacher token: the independent reference of the hidden-state
/// pairing.
fn as_full_topk(
    head: &TeacherHead,
    items: &[Item],
    scores: &[SequenceScores],
    tau: f64,
) -> Vec<SequenceScores> {
    let vocab = head.vocab();
    let w: Vec<Vec<f64>> = head
        .weight()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2()
        .unwrap();
    let b: Vec<f64> = head
        .bias()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap();
    scores
        .iter()
        .zip(items)
        .map(|(s, it)| {
            let mut ids = vec![];
            let mut lps = vec![];
            let mut target = vec![];
            for r in 0..s.rows {
                let h: Vec<f64> = s.hidden[r * TH * 4..(r + 1) * TH * 4]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                    .collect();
                let z: Vec<f64> = (0..vocab)
                    .map(|v| {
                        let dot: f64 = (0..TH).map(|j| w[v][j] * h[j]).sum();
                        head.scale() * (dot + b[v]) / tau
                    })
                    .collect();
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                ids.extend(0..vocab as u32);
                lps.extend(z.iter().map(|x| (x - lse) as f32));
                target.push((z[it.teacher_ids()[r + 1] as usize] - lse) as f32);
            }
            SequenceScores {
                rows: s.rows,
                k: vocab,
                topk_ids: ids,
                topk_values: lps,
                target_logprobs: target,
                logsumexp: vec![0.0; s.rows],
                ..Default::default()
            }
        })
        .collect()
}

/// The hidden-state pairing: chunked gradients equal the whole loss (every head option, tied
/// and untied, f64 and f32), for forward KL, reverse KL, JSD and total variation with each CE
/// mode.
#[test]
fn full_vocab_chunks_equal_the_whole_loss() {
    let (items, scores, head) = full_vocab_batch(11);
    let losses = [
        cfg(
            KdConfig::ForwardKl {},
            None,
            CeConfig::Weight { weight: 0.3 },
        ),
        cfg(KdConfig::ReverseKl {}, None, CeConfig::Dynamic {}),
        cfg(KdConfig::Jsd { beta: 0.3 }, None, CeConfig::None {}),
        cfg(KdConfig::TotalVariation {}, None, CeConfig::Dynamic {}),
    ];
    for loss in &losses {
        check(Pairing::FullVocab(&head), loss, &items, &scores, 0);
    }
}

/// Exact losses from hidden states equal the top-k path given the teacher's whole distribution
/// (K = V, computed in f64 from the same head): value and every gradient, and the validation KL.
#[test]
fn full_vocab_equals_top_k_with_the_whole_vocabulary() {
    let (items, hscores, head) = full_vocab_batch(12);
    for (kd, tol) in [
        (KdConfig::ForwardKl {}, 1e-5),
        (KdConfig::ReverseKl {}, 1e-5),
        (KdConfig::Jsd { beta: 0.4 }, 1e-5),
        (KdConfig::TotalVariation {}, 1e-5),
    ] {
        let loss = cfg(
            kd,
            Some(TailMode::Renormalize),
            CeConfig::Weight { weight: 0.3 },
        );
        let tscores = as_full_topk(&head, &items, &hscores, loss.temperature.get());
        let (model, vm) = tiny(false, DType::F64, 13);
        let norm = units(&items);
        let run = |pairing, scores: &[SequenceScores], k| {
            let refs: Vec<&SequenceScores> = scores.iter().collect();
            let ctx = LossCtx {
                model: &model,
                k,
                loss: &loss,
                pairing,
                device: &Device::Cpu,
                micro_batch: items.len(),
                head: HeadOpts {
                    chunk_rows: 4,
                    ..Default::default()
                },
            };
            let (grads, out) = micro_grads(&ctx, &items, &refs, norm, None).unwrap();
            let val = validation_sums(&ctx, &items, &refs).unwrap();
            (grads, out, val)
        };
        let (g_hidden, o_hidden, v_hidden) = run(Pairing::FullVocab(&head), &hscores, 0);
        let (g_topk, o_topk, v_topk) = run(Pairing::Same, &tscores, V);
        let case = format!("{:?}", loss.kd);
        // The teacher side is f32 in both (the head's matmul, the answer's log-probs).
        assert_rel(
            o_hidden.kd.loss,
            o_topk.kd.loss,
            tol,
            &format!("{case}: kd"),
        );
        assert!(
            o_hidden.kd.loss > 1e-3,
            "{case}: a loss that is not trivially 0"
        );
        assert_rel(
            o_hidden.ce.unwrap(),
            o_topk.ce.unwrap(),
            1e-9,
            &format!("{case}: ce"),
        );
        assert_same_grads(&vm, &g_hidden, &g_topk, tol, &case);
        assert_rel(v_hidden.kl, v_topk.kl, tol, &format!("{case}: val kl"));
        assert_eq!(v_hidden.kl_units, v_topk.kl_units);
    }
}

/// A hidden-state answer of the wrong width (a top-k answer given to the hidden pairing) is a
/// clear error, not a panic.
#[test]
fn full_vocab_refuses_answers_without_hidden_states() {
    let (items, hscores, head) = full_vocab_batch(14);
    let (model, _) = tiny(false, DType::F32, 15);
    let loss = cfg(KdConfig::ForwardKl {}, None, CeConfig::None {});
    let mut bad = hscores.clone();
    bad[1].hidden.truncate(8);
    let refs: Vec<&SequenceScores> = bad.iter().collect();
    let ctx = LossCtx {
        model: &model,
        k: 0,
        loss: &loss,
        pairing: Pairing::FullVocab(&head),
        device: &Device::Cpu,
        micro_batch: items.len(),
        head: HeadOpts::default(),
    };
    let err = micro_grads(&ctx, &items, &refs, units(&items), None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("teacher answer 1") && err.contains("hidden states"),
        "{err}"
    );
}

/// The hidden-state pairing's validation in forward-only head chunks equals its whole-batch
/// figures.
#[test]
fn full_vocab_chunked_validation_equals_the_whole_batch() {
    let (items, scores, head) = full_vocab_batch(16);
    let refs: Vec<&SequenceScores> = scores.iter().collect();
    let loss = cfg(KdConfig::ForwardKl {}, None, CeConfig::None {});
    for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 1e-5)] {
        let (model, _) = tiny(true, dtype, 17);
        let mut ctx = LossCtx {
            model: &model,
            k: 0,
            loss: &loss,
            pairing: Pairing::FullVocab(&head),
            device: &Device::Cpu,
            micro_batch: items.len(),
            head: HeadOpts::default(),
        };
        let want = validation_sums_whole(&ctx, &items, &refs).unwrap();
        assert!(want.kl > 0.0 && want.kl_units > 0.0);
        for chunk_rows in [1, 3, 0] {
            ctx.head.chunk_rows = chunk_rows;
            let got = validation_sums(&ctx, &items, &refs).unwrap();
            let case = format!("{dtype:?} rows {chunk_rows}");
            assert_rel(got.kl, want.kl, tol, &format!("{case}: kl"));
            assert_rel(got.ce, want.ce, tol, &format!("{case}: ce"));
            assert_eq!(got.kl_units, want.kl_units, "{case}");
            assert_eq!(got.ce_tokens, want.ce_tokens, "{case}");
        }
    }
}

/// Across tokenizers with hidden states: chunked gradients equal the whole loss.
#[test]
fn cross_full_vocab_chunks_equal_the_whole_loss() {
    let (mut items, _, proj) = cross_batch(21);
    with_exact_pairs(&mut items, &proj);
    let (scores, head) = hidden_answers(&items, VT, 21);
    let losses = [
        cfg(KdConfig::FirstKl {}, None, CeConfig::Weight { weight: 0.2 }),
        cfg(KdConfig::FirstKl {}, None, CeConfig::Dynamic {}),
        cfg(
            KdConfig::Pkl {
                anchor: Anchor::First,
            },
            None,
            CeConfig::None {},
        ),
        cfg(
            KdConfig::Pkl {
                anchor: Anchor::Last,
            },
            Some(TailMode::Bucket),
            CeConfig::Weight { weight: 0.3 },
        ),
        cfg(
            KdConfig::Alm { tau: 2.0 },
            None,
            CeConfig::Weight { weight: 0.2 },
        ),
        cfg(
            KdConfig::Gold {
                matched_weight: 0.9,
                unmatched_weight: 1.2,
            },
            None,
            CeConfig::Dynamic {},
        ),
    ];
    for loss in &losses {
        check(
            Pairing::CrossFullVocab(&proj, &head),
            loss,
            &items,
            &scores,
            0,
        );
    }
}

/// Across tokenizers, first_kl and P-KL from hidden states equal the top-k losses given the
/// teacher's whole distribution (K = V_t, from the same head in f64): value, every gradient,
/// validation.
#[test]
fn cross_full_vocab_equals_the_top_k_losses_with_every_teacher_id() {
    let pkl = |anchor| KdConfig::Pkl { anchor };
    for (kd, tail) in [
        (KdConfig::FirstKl {}, None),
        (pkl(Anchor::First), None),
        (pkl(Anchor::Last), Some(TailMode::Bucket)),
        (pkl(Anchor::First), Some(TailMode::Ignore)),
    ] {
        cross_full_equals_top_k(kd, tail);
    }
}

fn cross_full_equals_top_k(kd: KdConfig, tail: Option<TailMode>) {
    let (items, _, proj) = cross_batch(22);
    let (hscores, head) = hidden_answers(&items, VT, 22);
    let loss = cfg(kd, tail, CeConfig::Weight { weight: 0.3 });
    let tscores = as_full_topk(&head, &items, &hscores, loss.temperature.get());
    let (model, vm) = tiny(false, DType::F64, 23);
    let norm = units(&items);
    let run = |pairing, scores: &[SequenceScores], k| {
        let refs: Vec<&SequenceScores> = scores.iter().collect();
        let ctx = LossCtx {
            model: &model,
            k,
            loss: &loss,
            pairing,
            device: &Device::Cpu,
            micro_batch: items.len(),
            head: HeadOpts {
                chunk_rows: 5,
                ..Default::default()
            },
        };
        let (grads, out) = micro_grads(&ctx, &items, &refs, norm, None).unwrap();
        (grads, out)
    };
    let (g_hidden, o_hidden) = run(Pairing::CrossFullVocab(&proj, &head), &hscores, 0);
    let (g_topk, o_topk) = run(Pairing::Cross(&proj), &tscores, VT);
    let case = format!("{:?} {:?}", loss.kd, loss.tail);
    assert!(
        o_hidden.kd.loss > 1e-3,
        "{case}: a loss that is not trivially 0"
    );
    // The top-k tail is 1 − Σ mapped, the full one sums the unmapped ids (f32 log-probs).
    assert_rel(
        o_hidden.kd.loss,
        o_topk.kd.loss,
        1e-5,
        &format!("{case}: kd"),
    );
    assert_eq!(o_hidden.kd.count, o_topk.kd.count);
    assert_rel(o_hidden.ce.unwrap(), o_topk.ce.unwrap(), 1e-9, "ce");
    assert_same_grads(&vm, &g_hidden, &g_topk, 1e-5, &case);
    // Validation: the exact first-token KL, chunked as the whole batch.
    let refs: Vec<&SequenceScores> = hscores.iter().collect();
    let mut ctx = LossCtx {
        model: &model,
        k: 0,
        loss: &loss,
        pairing: Pairing::CrossFullVocab(&proj, &head),
        device: &Device::Cpu,
        micro_batch: items.len(),
        head: HeadOpts::default(),
    };
    let want = validation_sums_whole(&ctx, &items, &refs).unwrap();
    let tau2 = loss.temperature.get() * loss.temperature.get();
    assert_rel(
        want.kl * tau2 / want.kl_units,
        o_hidden.kd.loss * norm.kd / o_hidden.kd.count,
        1e-9,
        "val kl",
    );
    for chunk_rows in [1, 3, 0] {
        ctx.head.chunk_rows = chunk_rows;
        let got = validation_sums(&ctx, &items, &refs).unwrap();
        assert_rel(got.kl, want.kl, 1e-9, &format!("rows {chunk_rows}: kl"));
        assert_eq!(got.kl_units, want.kl_units);
    }
}

/// ALM across tokenizers from hidden states equals ALM on the top-k transport's answers (whose
/// `target_logprobs` the reference computes in f64 from the same head): value, every gradient;
/// its validation reports P-KL over every teacher id, which equals the top-k pairing's P-KL
/// given every teacher id (K = V_t, no tail).
#[test]
fn cross_full_vocab_alm_equals_the_top_k_alm() {
    let (items, _, proj) = cross_batch(24);
    let loss = cfg(
        KdConfig::Alm { tau: 2.0 },
        None,
        CeConfig::Weight { weight: 0.3 },
    );
    hidden_equals_top_k_with_every_teacher_id(&items, &proj, &loss, 24);
}

/// Gold across tokenizers from hidden states. With as many teacher as student ids it is the
/// top-k gold given every teacher id (K = V_t), matched and unmatched chunks alike: value, every
/// gradient, and validation (P-KL over every teacher id, as the top-k pairing reports). With
/// fewer teacher ids ULD also counts the student's mass past rank V_t (tested against the f64
/// definition in `loss/xtoken_full/tests.rs`), so there the matched chunks' KL alone is compared.
#[test]
fn cross_full_vocab_gold_equals_the_top_k_gold_with_every_teacher_id() {
    use crate::loss::xtoken::gold_split;
    let gold = |m, u| {
        cfg(
            KdConfig::Gold {
                matched_weight: m,
                unmatched_weight: u,
            },
            None,
            CeConfig::Weight { weight: 0.3 },
        )
    };
    for (vt, loss) in [(V, gold(0.8, 1.3)), (VT, gold(1.0, 0.0))] {
        let (mut items, _, _) = cross_batch(26);
        let proj = projection_onto(&mut ChaCha8Rng::seed_from_u64(26), vt);
        with_exact_pairs(&mut items, &proj);
        // Both kinds of chunk are present (counted on the top-k view of the same chunks).
        let (hscores, head) = hidden_answers(&items, vt, 26);
        let tscores = as_full_topk(&head, &items, &hscores, loss.temperature.get());
        let trefs: Vec<&SequenceScores> = tscores.iter().collect();
        let (xb, _) = xtoken_batch(&items, &trefs, vt).unwrap();
        let (m, u) = gold_split(&xb, &proj).unwrap();
        assert!(
            m >= 3 && u >= 3,
            "V_t = {vt}: {m} matched, {u} unmatched chunks"
        );
        hidden_equals_top_k_with_every_teacher_id(&items, &proj, &loss, 26);
    }
}

/// Makes every second one-to-one chunk of `items` an exact pair for gold: its student token
/// `g`, a multiple of 3, and the teacher token `g` maps to.
fn with_exact_pairs(items: &mut [Item], proj: &Projection) {
    for it in items {
        let Item::Cross { pair, .. } = it else {
            continue;
        };
        for (i, c) in pair.chunks.iter().enumerate() {
            if c.student.len() == 1 && c.teacher.len() == 1 && i % 2 == 1 {
                let g = (3 * (i % 13)) as u32;
                pair.student_ids[c.student.start] = g;
                pair.teacher_ids[c.teacher.start] = proj.exact_teacher(g as usize).unwrap();
            }
        }
    }
}

/// The hidden-state pairing equals the top-k pairing on answers carrying the teacher's whole
/// distribution (K = V_t, computed in f64 from the same head, rounded to f32): the loss, every
/// gradient, and validation, for a loss whose validation is P-KL over every teacher id.
fn hidden_equals_top_k_with_every_teacher_id(
    items: &[Item],
    proj: &Projection,
    loss: &LossConfig,
    seed: u64,
) {
    let vt = proj.teacher_vocab();
    let (hscores, head) = hidden_answers(items, vt, seed);
    let tscores = as_full_topk(&head, items, &hscores, loss.temperature.get());
    let (model, vm) = tiny(false, DType::F64, seed + 1);
    let norm = units(items);
    let ctx = |pairing, k| LossCtx {
        model: &model,
        k,
        loss,
        pairing,
        device: &Device::Cpu,
        micro_batch: items.len(),
        head: HeadOpts {
            chunk_rows: 5,
            ..Default::default()
        },
    };
    let hrefs: Vec<&SequenceScores> = hscores.iter().collect();
    let trefs: Vec<&SequenceScores> = tscores.iter().collect();
    let hidden = ctx(Pairing::CrossFullVocab(proj, &head), 0);
    let topk = ctx(Pairing::Cross(proj), vt);
    let (g_hidden, o_hidden) = micro_grads(&hidden, items, &hrefs, norm, None).unwrap();
    let (g_topk, o_topk) = micro_grads(&topk, items, &trefs, norm, None).unwrap();
    let case = format!("{:?} V_t = {vt}", loss.kd);
    assert!(
        o_hidden.kd.loss > 1e-3,
        "{case}: a loss that is not trivially 0"
    );
    // f32 teacher log-probs on both sides (the reference's rounded from f64).
    assert_rel(
        o_hidden.kd.loss,
        o_topk.kd.loss,
        1e-5,
        &format!("{case}: kd"),
    );
    assert_eq!(o_hidden.kd.count, o_topk.kd.count, "{case}");
    assert_same_grads(&vm, &g_hidden, &g_topk, 1e-5, &case);
    let got = validation_sums(&hidden, items, &hrefs).unwrap();
    let want = validation_sums(&topk, items, &trefs).unwrap();
    assert!(got.kl_units > 0.0);
    assert_eq!(got.kl_units, want.kl_units, "{case}");
    assert_rel(got.kl, want.kl, 1e-5, &format!("{case}: validation P-KL"));
    assert_rel(got.ce, want.ce, 1e-9, &format!("{case}: validation CE"));
}
