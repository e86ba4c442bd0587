//! The scorer's paths against each other and against f64 references on a small random model;
//! the model and the reference are shared with the worker's tests.

use super::*;
use candle_nn::VarBuilder;
use xdistill_shared::hf::ModelConfig;
use xdistill_shared::model::Ops;
use xdistill_shared::protocol::ValuesKind;

/// LM head of 9000 rows (more than one device sort chunk), of which 8990 are valid ids.
pub(crate) const V: usize = 9000;
pub(crate) const VALID: usize = 8990;

pub(crate) fn decoder() -> Decoder {
    let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
        "model_type": "qwen3", "vocab_size": V, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "max_position_embeddings": 64, "rope_theta": 10000.0,
        "tie_word_embeddings": false
    }))
    .unwrap();
    let params = xdistill_shared::init::random_params(&cfg, 0.5, 3).unwrap();
    let vb = VarBuilder::from_tensors(params, DType::F32, &Device::Cpu);
    Decoder::new(&cfg, vb, Ops::Fused).unwrap()
}

/// f64 scores of one logit row: top-k by a full sort, target log-prob, logsumexp.
pub(crate) fn reference(
    row: &[f32],
    target: usize,
    k: usize,
    t: f64,
) -> (Vec<(u32, f64)>, f64, f64) {
    let z: Vec<f64> = row[..VALID].iter().map(|&x| x as f64 / t).collect();
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    let mut idx: Vec<usize> = (0..VALID).collect();
    idx.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    let top = idx[..k].iter().map(|&i| (i as u32, z[i] - lse)).collect();
    (top, z[target] - lse, lse)
}

/// Every chunking of the LM head, on both paths, gives the scores of the whole `[n, V]`
/// logits computed at once, for exactly the requested positions.
#[test]
fn chunked_lm_head_equals_full_logits_on_both_paths() {
    let dec = decoder();
    let (first, n, start) = (2usize, 7usize, 4usize);
    // Hidden states of positions first..first+n: [n, 16], spread values.
    let h: Vec<f32> = (0..n * 16)
        .map(|i| ((i * 7919 % 113) as f32 / 113.0 - 0.5) * 4.0)
        .collect();
    let hidden = Tensor::from_vec(h, (n, 16), &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..first + n + 1)
        .map(|i| (i * 997 % VALID) as u32)
        .collect();
    let full: Vec<Vec<f32>> = dec.logits(&hidden).unwrap().to_vec2().unwrap();
    // Candidate ids: 3 per requested row, spread over the valid vocabulary.
    let rows = first + n - start;
    let cands = Candidates {
        m: 3,
        ids: (0..rows * 3).map(|i| (i * 2011 % VALID) as u32).collect(),
    };
    // The host paths' answers without ranks, per chunking, for the bit-level claims below.
    let mut host: Vec<((LmHead, bool), usize, SequenceScores)> = Vec::new();
    let kernel = RowFolds::head_kernel_available();
    let mut paths = vec![
        (false, LmHead::Full, false),
        (false, LmHead::Fused, false),
        (true, LmHead::Full, false),
    ];
    if kernel {
        paths.push((false, LmHead::Fused, true));
    }
    for ((on_device, lm_head, head_kernel), ranks) in
        paths.into_iter().flat_map(|x| [(x, true), (x, false)])
    {
        let p = ScoreParams {
            ranks,
            ..ScoreParams::native(6, 0.8, ValuesKind::Logprobs)
        };
        let p = &p;
        for chunk_rows in [1, 3, 64] {
            let scorer = Scorer {
                vocab: VALID,
                logits_size: V,
                chunk_rows,
                on_device,
                lm_head,
                head_kernel,
            };
            let seq = SeqRef {
                ids: &ids,
                start,
                params: p,
                candidates: Some(&cands),
            };
            let mut acc = seq.empty();
            let mut timing = Timing::default();
            let span = HiddenSpan {
                states: &hidden,
                first,
            };
            scorer
                .score(&dec, span, seq, &mut acc, &mut timing)
                .unwrap();
            acc.check_shapes().unwrap();
            // Requested rows: positions start..first+n (row p predicts ids[p + 1]).
            assert_eq!(acc.rows, rows);
            for (r, pos) in (start..first + n).enumerate() {
                let row = &full[pos - first];
                let (top, tl, lse) = reference(row, ids[pos + 1] as usize, p.k, 0.8);
                let what = format!(
                    "device {on_device} {lm_head:?} kernel {head_kernel} ranks {ranks} chunk {chunk_rows} row {r}"
                );
                let got_ids: Vec<u32> = top.iter().map(|e| e.0).collect();
                assert_eq!(acc.ids_row(r), got_ids.as_slice(), "{what}");
                for (v, want) in acc.values_row(r).iter().zip(&top) {
                    assert!(
                        (*v as f64 - want.1).abs() < 1e-4,
                        "{what}: {v} vs {}",
                        want.1
                    );
                }
                assert!((acc.target_logprobs[r] as f64 - tl).abs() < 1e-4, "{what}");
                assert!((acc.logsumexp[r] as f64 - lse).abs() < 1e-4, "{what}");
                for j in 0..3 {
                    let c = cands.ids[r * 3 + j] as usize;
                    let want = row[c] as f64 / 0.8 - lse;
                    let got = acc.ids_logprobs_row(r)[j] as f64;
                    assert!((got - want).abs() < 1e-4, "{what} cand {j}");
                }
                // Rank: 1 + the number of valid ids with a larger logit (no ties here).
                if ranks {
                    let zt = row[ids[pos + 1] as usize];
                    let want_rank = 1 + row[..VALID].iter().filter(|&&x| x > zt).count();
                    assert_eq!(acc.target_ranks[r] as usize, want_rank, "{what}");
                } else {
                    assert!(acc.target_ranks.is_empty());
                }
            }
            if !on_device && !ranks {
                host.push(((lm_head, head_kernel), chunk_rows, acc));
            }
        }
    }
    // Which equalities hold where (every answer above is within 1e-4 of the f64 truth):
    // 1. On every CPU, the fused head through candle's tiles gives the full logits' bits at
    //    the same chunking: each tile is the same matmul as the full one's columns.
    // 2. Across chunkings, candle's paths agree to f32 rounding only: its matmul (the gemm
    //    crate) picks its kernel from the matrix shape and the CPU (AVX2 or AVX-512), so a
    //    row's bits may change with the number of rows in its chunk (they do on AVX2 CPUs).
    // 3. The head kernel (AVX-512 or AVX2, the same bits) sums each dot product in a fixed
    //    order whatever the chunk (kernels/cpu/src/row_scores/fused_head.rs): its bits do not
    //    depend on the chunking.
    let with = |path: (LmHead, bool)| -> Vec<(usize, &SequenceScores)> {
        host.iter()
            .filter(|(p, _, _)| *p == path)
            .map(|(_, c, a)| (*c, a))
            .collect()
    };
    let (full, tiled) = (with((LmHead::Full, false)), with((LmHead::Fused, false)));
    assert_eq!((full.len(), tiled.len()), (3, 3));
    for ((c, f), (ct, t)) in full.iter().zip(&tiled) {
        assert_eq!(c, ct);
        assert!(
            f.bits() == t.bits(),
            "chunk {c}: the fused LM head through candle's tiles differs from the full logits"
        );
    }
    let tolerance = 1e-5f32;
    for (c, a) in &full[1..] {
        let b = full[0].1;
        assert_eq!(a.topk_ids, b.topk_ids, "chunk {c}: top-k ids");
        for (name, x, y) in [
            ("top-k values", &a.topk_values, &b.topk_values),
            ("target log-probs", &a.target_logprobs, &b.target_logprobs),
            ("logsumexp", &a.logsumexp, &b.logsumexp),
            ("candidate log-probs", &a.ids_logprobs, &b.ids_logprobs),
        ] {
            let worst = x
                .iter()
                .zip(y)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= tolerance,
                "chunk {c} vs 1: {name} differ by {worst}"
            );
        }
    }
    if kernel {
        let k = with((LmHead::Fused, true));
        assert_eq!(k.len(), 3);
        assert!(
            k.iter().all(|(_, a)| a.bits() == k[0].1.bits()),
            "the kernel's bits depend on the chunking"
        );
    }
}

/// With a next token asked for, the position after the last token is scored too (its target
/// is the chosen token), on both paths and whatever the chunking; greedy takes the argmax.
#[test]
fn next_row_scores_the_chosen_token() {
    let dec = decoder();
    let ids: Vec<u32> = vec![5, 900, 33, 4000, 12];
    let x = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let hidden = dec
        .forward_hidden(&x, None, None, None)
        .unwrap()
        .get(0)
        .unwrap(); // [5, H]
    let full: Vec<Vec<f32>> = dec.logits(&hidden).unwrap().to_vec2().unwrap();
    let p = ScoreParams {
        next: Some(NextToken::Greedy),
        ..ScoreParams::native(2, 1.0, ValuesKind::Logprobs)
    };
    for (on_device, chunk_rows) in [(false, 2), (true, 64)] {
        let scorer = Scorer {
            vocab: VALID,
            logits_size: V,
            chunk_rows,
            on_device,
            lm_head: LmHead::Fused,
            head_kernel: RowFolds::head_kernel_available(),
        };
        let seq = SeqRef {
            ids: &ids,
            start: 3,
            params: &p,
            candidates: None,
        };
        let mut acc = seq.empty();
        let span = HiddenSpan {
            states: &hidden,
            first: 0,
        };
        scorer
            .score(&dec, span, seq, &mut acc, &mut Timing::default())
            .unwrap();
        // Rows at positions 3 (predicting ids[4]) and 4 (the next token).
        assert_eq!(acc.rows, 2);
        let (top, _, _) = reference(&full[4], 0, 1, 1.0);
        let token = acc.next_token.unwrap();
        assert_eq!(token, top[0].0);
        assert_eq!(acc.ids_row(1)[0], token);
        assert!((acc.target_logprobs[1] as f64 - top[0].1).abs() < 1e-4);
        let (_, tl, _) = reference(&full[3], ids[4] as usize, 1, 1.0);
        assert!((acc.target_logprobs[0] as f64 - tl).abs() < 1e-4);
    }
}

/// candle's CPU matmul (gemm 0.19) computes a row of `x · Wᵀ` with the same bits whatever
/// the number of rows M ≥ 2, for LM-head-like shapes (N in the thousands): the reduction
/// over K is blocked by K alone. M = 1 goes to a gemv kernel with another summation order
/// (printed, not asserted), as do tiny products (M·N ≤ 256, a "horizontal" kernel). So the
/// LM-head chunking changes no row but a one-row chunk's; the batch-invariant guarantee does
/// not rest on this (a sequence's chunking depends only on itself and its request).
#[test]
fn matmul_rows_do_not_depend_on_the_row_count() {
    let values = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 2.0)
            .collect()
    };
    for (k, n) in [(16usize, 9000usize), (128, 4000), (1024, 3000)] {
        let w = Tensor::from_vec(values(n * k, 1), (n, k), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(values(130 * k, 2), (130, k), &Device::Cpu).unwrap();
        let wt = w.t().unwrap();
        let full: Vec<Vec<f32>> = x.matmul(&wt).unwrap().to_vec2().unwrap();
        for m in [1usize, 2, 3, 7, 16, 64, 65, 129] {
            let part: Vec<Vec<f32>> = x
                .narrow(0, 130 - m, m)
                .unwrap()
                .matmul(&wt)
                .unwrap()
                .to_vec2()
                .unwrap();
            let differ = (0..m)
                .filter(|&r| {
                    let want = &full[130 - m + r];
                    part[r]
                        .iter()
                        .zip(want)
                        .any(|(a, b)| a.to_bits() != b.to_bits())
                })
                .count();
            if m == 1 {
                println!("k {k} n {n}: one row alone differs: {}", differ == 1);
            } else {
                assert_eq!(differ, 0, "k {k} n {n} m {m}");
            }
        }
    }
}

#[test]
fn auto_path_is_host_on_the_cpu() {
    assert!(!TopkPath::Auto.on_device(&Device::Cpu));
    assert!(TopkPath::Device.on_device(&Device::Cpu));
    assert!(!TopkPath::Host.on_device(&Device::Cpu));
    assert!(device_topk_fits(0) && device_topk_fits(4096) && !device_topk_fits(4097));
}

/// Chunk sizes: a GPU holds ≈880 Qwen3 rows of logits at once (one chunk for a sequence of
/// 512), the host 110 (or 256 positions on the fused path); never fewer than one row.
#[test]
fn head_chunks_are_sized_by_where_the_logits_are() {
    let qwen3 = 151_936;
    assert_eq!(chunk_rows(true, true, LmHead::Fused, qwen3), 883);
    assert_eq!(chunk_rows(false, true, LmHead::Fused, qwen3), 110);
    assert_eq!(chunk_rows(false, false, LmHead::Full, qwen3), 110);
    assert_eq!(
        chunk_rows(false, false, LmHead::Fused, qwen3),
        FUSED_CHUNK_ROWS
    );
    assert_eq!(chunk_rows(true, true, LmHead::Full, 1 << 30), 1);
    let cpu = Scorer::new(VALID, V, TopkPath::Device, LmHead::Full, &Device::Cpu);
    assert_eq!(cpu.chunk_rows, LOGIT_CHUNK_ELEMS / V);
}
