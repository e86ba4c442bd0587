//! The head kernel against f64 references, its bits against the chunking, and its two levels
//! (AVX-512, AVX2) against each other.

use super::*;
use crate::lcg_noise as noise;
use crate::row_scores::{CandidateRows, RowQuery, RowScores, ValuesKind};

fn kernel(
    hidden: &[f32],
    head: &[f32],
    h: usize,
    width: usize,
    (targets, cands): (&[u32], CandidateRows<'_>),
    p: &RowQuery,
) -> RowScores {
    kernel_at(Simd::current(), hidden, head, h, width, (targets, cands), p)
}

/// [`kernel`] at `level` (capped at the CPU's).
fn kernel_at(
    level: Simd,
    hidden: &[f32],
    head: &[f32],
    h: usize,
    width: usize,
    (targets, cands): (&[u32], CandidateRows<'_>),
    p: &RowQuery,
) -> RowScores {
    let mut f = RowFolds::for_head(width, targets, cands, p);
    f.level = level;
    f.fold_head(hidden, head, h);
    f.finish()
}

/// Every field of every row as bits (NaNs included).
fn all_bits(s: &RowScores) -> Vec<u32> {
    let f = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    [
        f(&s.logsumexp),
        f(&s.target_logprobs),
        f(&s.topk_values),
        f(&s.ids_logprobs),
        s.topk_ids.clone(),
        s.target_ranks.clone(),
    ]
    .concat()
}

/// The kernel's logits are `matmul::dot_blocked`'s dot products (so the reference
/// below sees the same f32 logits); everything computed from them is checked in f64
/// against a full sort: top-k ids (ties by id) and values, logsumexp, target and candidate
/// log-probs, ranks — over panels, groups, segments, tile tails and head padding.
#[test]
fn kernel_matches_f64_reference() {
    if !available() {
        eprintln!("skipped: this CPU has neither AVX2 with FMA nor AVX-512");
        return;
    }
    let (width, valid) = (3000, 2900);
    for (h, rows) in [(16usize, 1usize), (37, 33), (64, 130), (600, 5)] {
        let hidden = noise(h as u64, rows * h, 2.0);
        let mut head = noise(7 + h as u64, width * h, 2.0 / (h as f32).sqrt());
        // Head padding rows with huge weights must never be computed.
        for x in &mut head[valid * h..] {
            *x = 1e4;
        }
        let logits: Vec<f32> = (0..rows * valid)
            .map(|i| {
                let (r, v) = (i / valid, i % valid);
                let w = &head[v * h..(v + 1) * h];
                let a = &hidden[r * h..(r + 1) * h];
                matmul::dot_blocked(w, a, true)
            })
            .collect();
        // Ties: one row's top values repeated at larger ids.
        let targets: Vec<u32> = (0..rows).map(|r| (r * 977 % valid) as u32).collect();
        let m = 3;
        let cand_ids: Vec<u32> = (0..rows * m)
            .map(|i| [(i * 131 % valid) as u32, valid as u32 - 1, 0][i % m])
            .collect();
        let cands = CandidateRows { ids: &cand_ids, m };
        for (k, t, values, ranks) in [
            (7usize, 1.0f32, ValuesKind::Logprobs, true),
            (0, 0.7, ValuesKind::Logprobs, false),
            (300, 1.3, ValuesKind::Logits, true),
        ] {
            let p = RowQuery {
                ranks,
                ..RowQuery::new(k, t, values, valid)
            };
            let s = kernel(&hidden, &head, h, width, (&targets, cands), &p);
            s.check_shapes().unwrap();
            for r in 0..rows {
                let what = format!("h {h} rows {rows} k {k} row {r}");
                let row = &logits[r * valid..(r + 1) * valid];
                let z: Vec<f64> = row.iter().map(|&x| x as f64 / t as f64).collect();
                let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = mx + z.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
                assert!(
                    (s.logsumexp[r] as f64 - lse).abs() < 2e-6 * lse.abs().max(1.0),
                    "{what}"
                );
                let mut order: Vec<usize> = (0..valid).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                let want: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
                assert_eq!(s.ids_row(r), want.as_slice(), "{what}");
                for (&v, &i) in s.values_row(r).iter().zip(&order) {
                    let w = match values {
                        ValuesKind::Logprobs => z[i] - lse,
                        ValuesKind::Logits => z[i],
                    };
                    assert!((v as f64 - w).abs() < 1e-5, "{what}: {v} vs {w}");
                }
                let target = targets[r] as usize;
                assert!(
                    (s.target_logprobs[r] as f64 - (z[target] - lse)).abs() < 1e-5,
                    "{what}"
                );
                for (j, &c) in cand_ids[r * m..(r + 1) * m].iter().enumerate() {
                    let got = s.ids_logprobs_row(r)[j] as f64;
                    assert!(
                        (got - (z[c as usize] - lse)).abs() < 1e-5,
                        "{what} cand {j}"
                    );
                }
                if ranks {
                    let ge = row.iter().filter(|&&x| x >= row[target]).count() as u32;
                    let rank = order.iter().position(|&i| i == target).unwrap() as u32 + 1;
                    let want = if (rank as usize) <= k { rank } else { ge };
                    assert_eq!(s.target_ranks[r], want, "{what}");
                }
            }
        }
    }
}

/// A row's scores are the same bits alone, in any chunk, beside any neighbours and on any
/// number of threads; a NaN in one row's hidden state makes that row's scores NaN and no
/// other's.
#[test]
fn rows_are_independent_of_their_neighbours() {
    if !available() {
        eprintln!("skipped: this CPU has neither AVX2 with FMA nor AVX-512");
        return;
    }
    let (h, rows, width) = (24, 70, 2100);
    let mut hidden = noise(3, rows * h, 2.0);
    let head = noise(4, width * h, 0.5);
    let targets: Vec<u32> = (0..rows).map(|r| (r * 31 % width) as u32).collect();
    let none = CandidateRows { ids: &[], m: 0 };
    let p = RowQuery {
        ranks: true,
        ..RowQuery::new(9, 0.9, ValuesKind::Logprobs, width)
    };
    // Row r's fields as bits.
    let row_bits = |s: &RowScores, r: usize| -> Vec<u32> {
        let vals = s.values_row(r).iter().map(|x| x.to_bits());
        let stats = [s.target_logprobs[r], s.logsumexp[r]].map(f32::to_bits);
        let ids = s.ids_row(r).iter().copied();
        vals.chain(stats)
            .chain(ids)
            .chain([s.target_ranks[r]])
            .collect()
    };
    let all = kernel(&hidden, &head, h, width, (&targets, none), &p);
    // Thread counts give other waves of segments (other candidates kept on the way).
    for threads in [1, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        let s = pool.install(|| kernel(&hidden, &head, h, width, (&targets, none), &p));
        for r in 0..rows {
            assert_eq!(
                row_bits(&s, r),
                row_bits(&all, r),
                "{threads} threads, row {r}"
            );
        }
    }
    for chunk in [1usize, 7, 33] {
        for c0 in (0..rows).step_by(chunk) {
            let c1 = (c0 + chunk).min(rows);
            let part = &hidden[c0 * h..c1 * h];
            let s = kernel(part, &head, h, width, (&targets[c0..c1], none), &p);
            for r in c0..c1 {
                assert_eq!(
                    row_bits(&s, r - c0),
                    row_bits(&all, r),
                    "chunks of {chunk}, row {r}"
                );
            }
        }
    }
    hidden[40 * h + 5] = f32::NAN;
    let s = kernel(&hidden, &head, h, width, (&targets, none), &p);
    for r in 0..rows {
        assert_eq!(s.logsumexp[r].is_nan(), r == 40, "row {r}");
    }
    assert_eq!(s.logsumexp[41].to_bits(), all.logsumexp[41].to_bits());
}

/// The AVX2 kernel gives the AVX-512 kernel's bits: every field of every row, with ties,
/// candidates, ranks, head padding, partial panels, a NaN row and logits far below a row's
/// max (exponents near the floor of −126 that `2^n` is built for). Runs where the CPU has
/// AVX-512 (CI's machines differ: on an AVX2-only one, `kernel_matches_f64_reference` holds
/// the AVX2 kernel to f64).
#[test]
fn avx2_and_avx512_give_the_same_bits() {
    if Simd::current() != Simd::Avx512 {
        eprintln!("skipped: this CPU has no AVX-512 to compare AVX2 with");
        return;
    }
    let (width, valid) = (2500, 2437);
    for (h, rows, scale) in [(16usize, 45usize, 2.0f32), (100, 33, 40.0), (64, 7, 0.3)] {
        let mut hidden = noise(11 + h as u64, rows * h, scale);
        let mut head = noise(12 + h as u64, width * h, 2.0 / (h as f32).sqrt());
        // Ties: a row of the head repeated at a larger id.
        let (a, b) = (17 * h, 1900 * h);
        head.copy_within(a..a + h, b);
        hidden[3 * h + 1] = f32::NAN;
        let targets: Vec<u32> = (0..rows).map(|r| (r * 389 % width) as u32).collect();
        let m = 2;
        let ids: Vec<u32> = (0..rows * m).map(|i| (i * 577 % valid) as u32).collect();
        for (k, t, values, ranks) in [
            (5usize, 1.0f32, ValuesKind::Logprobs, true),
            (64, 0.6, ValuesKind::Logits, false),
            (0, 1.7, ValuesKind::Logprobs, true),
        ] {
            let p = RowQuery {
                ranks,
                ..RowQuery::new(k, t, values, valid)
            };
            let cands = CandidateRows { ids: &ids, m };
            let wide = kernel_at(
                Simd::Avx512,
                &hidden,
                &head,
                h,
                width,
                (&targets, cands),
                &p,
            );
            let narrow = kernel_at(Simd::Avx2, &hidden, &head, h, width, (&targets, cands), &p);
            assert!(wide.logsumexp[3].is_nan(), "the NaN row");
            assert_eq!(
                all_bits(&wide),
                all_bits(&narrow),
                "h {h} rows {rows} k {k} t {t} ranks {ranks}"
            );
        }
    }
}

/// Speed figure, not a check: `cargo test --release -p xdistill-cpu-kernels --lib head_speed --
/// --ignored --nocapture`. The kernel on 256 positions of the Qwen3 vocabulary (best of 5).
#[test]
#[ignore]
fn head_speed() {
    let (width, valid) = (151_936, 151_669);
    for (h, rows) in [(128usize, 256usize), (128, 127), (1024, 256)] {
        let hidden = noise(1, rows * h, 2.0);
        let head = noise(2, width * h, 2.0 / (h as f32).sqrt());
        let targets = vec![5u32; rows];
        let none = CandidateRows { ids: &[], m: 0 };
        for k in [64, 0] {
            let p = RowQuery::new(k, 1.0, ValuesKind::Logprobs, valid);
            let (mut wall, mut fold, mut merge) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
            for _ in 0..5 {
                let t0 = Instant::now();
                let mut f = RowFolds::for_head(width, &targets, none, &p);
                let t = f.fold_head(&hidden, &head, h);
                assert_eq!(f.finish().rows, rows);
                let w = t0.elapsed();
                wall = wall.min(w.as_secs_f64());
                // As the server splits it.
                fold = fold.min(t.split(w).1.as_secs_f64());
                merge = merge.min(t.merge.as_secs_f64());
            }
            let logits = (rows * valid) as f64;
            println!(
                "h {h}, {rows} rows, k {k}: {:.1} ms, {:.0} GFLOP/s, fold {:.3} ns per logit ({:.1}% of the wall; merges {:.2} ms), {} threads",
                wall * 1e3,
                2.0 * logits * h as f64 / wall / 1e9,
                fold * 1e9 / logits,
                fold / wall * 100.0,
                merge * 1e3,
                rayon::current_num_threads()
            );
        }
    }
}
