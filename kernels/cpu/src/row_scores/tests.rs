//! The host path against f64 references and against itself (tiles, SIMD levels, ties).

use super::*;

const NONE: CandidateRows<'static> = CandidateRows { ids: &[], m: 0 };

/// The packed key orders candidates as `desc` does (total order of the values, smaller id
/// first among equal ones) and gives back the value's bits and the id.
#[test]
fn packed_candidates_order_as_pairs() {
    let values = [
        f32::NEG_INFINITY,
        -3.5,
        -1e-30,
        -0.0,
        0.0,
        1e-30,
        2.25,
        2.25,
        f32::MAX,
        f32::INFINITY,
    ];
    let mut pairs = Vec::new();
    for (i, &x) in values.iter().enumerate() {
        for id in [0u32, 7, 7 + i as u32, u32::MAX] {
            pairs.push((x, id));
        }
    }
    for a in &pairs {
        let ca = Cand::new(a.0, a.1);
        assert_eq!((ca.x().to_bits(), ca.id()), (a.0.to_bits(), a.1));
        for b in &pairs {
            let cb = Cand::new(b.0, b.1);
            assert_eq!(best_first(&ca, &cb), desc(a, b), "{a:?} vs {b:?}");
        }
    }
}

/// `kth_best` gives the k-th of a full sort (ties by smaller id) while the row holds k or
/// more candidates, keeps exactly the best k and raises the threshold to it; a later seed
/// over those k plus newcomers still matches the sort of everything pushed.
#[test]
fn kth_best_matches_a_sort_and_keeps_the_best_k() {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for (k, n) in [(1usize, 1usize), (3, 2), (5, 40), (64, 300), (64, 64)] {
        let p = RowQuery::new(k, 1.0, ValuesKind::Logprobs, 1000);
        let targets = [0u32];
        let mut f = RowFolds::new(1000, &targets, NONE, &p);
        let row = &mut f.rows[0];
        let mut all: Vec<(f32, u32)> = Vec::new();
        for round in 0..2 {
            for i in 0..n {
                // Values from few levels, so that ties are common.
                let x = (next() % 17) as f32 * 0.5 - 4.0;
                let id = (round * n + i) as u32;
                all.push((x, id));
                row.buf.push(Cand::new(x, id));
            }
            all.sort_by(desc);
            let got = row.kth_best(k);
            if all.len() < k {
                assert_eq!(got, f32::NEG_INFINITY, "fewer than k: the threshold");
                continue;
            }
            assert_eq!(got.to_bits(), all[k - 1].0.to_bits(), "k {k}, n {n}");
            assert_eq!(row.thr.to_bits(), got.to_bits());
            let mut kept: Vec<(f32, u32)> = row.buf.iter().map(|c| (c.x(), c.id())).collect();
            kept.sort_by(desc);
            assert_eq!(kept, all[..k], "the best k, ties to the smaller id");
        }
    }
}

/// Reference in f64 with a full sort (independent of the partial selection above).
fn reference(row: &[f32], valid: usize, t: f64) -> (Vec<(usize, f64)>, f64) {
    let y: Vec<f64> = row[..valid].iter().map(|&x| x as f64 / t).collect();
    let m = y.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + y.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    let mut all: Vec<(usize, f64)> = y.iter().map(|&v| v - lse).enumerate().collect();
    all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    (all, lse)
}

fn pseudo_logits(rows: usize, width: usize) -> Vec<f32> {
    let mut s = 7u64;
    (0..rows * width)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 12.0
        })
        .collect()
}

#[test]
fn matches_f64_reference_and_masks_padding() {
    let (rows, width, valid) = (5, 300, 290);
    let mut logits = pseudo_logits(rows, width);
    // Padded LM-head rows with huge logits must neither appear nor count in the softmax.
    for r in 0..rows {
        for c in valid..width {
            logits[r * width + c] = 1e4;
        }
    }
    let targets = [0u32, 7, 289, 100, 5];
    for t in [1.0f32, 0.7, 2.5] {
        let p = RowQuery::new(17, t, ValuesKind::Logprobs, valid);
        let s = score_rows(&logits, width, &targets, NONE, &p);
        s.check_shapes().unwrap();
        for r in 0..rows {
            let (all, lse) = reference(&logits[r * width..(r + 1) * width], valid, t as f64);
            assert!((s.logsumexp[r] as f64 - lse).abs() < 1e-5 * lse.abs().max(1.0));
            let got = s.ids_row(r).iter().zip(s.values_row(r));
            for ((&id, &v), want) in got.zip(&all[..p.k]) {
                assert_eq!(id as usize, want.0);
                assert!((v as f64 - want.1).abs() < 1e-5);
            }
            let tl = all.iter().find(|e| e.0 == targets[r] as usize).unwrap().1;
            assert!((s.target_logprobs[r] as f64 - tl).abs() < 1e-5);
        }
    }
}

#[test]
fn logits_mode_and_ties() {
    let row = vec![1.0f32, 3.0, 3.0, -2.0, 3.0];
    let p = RowQuery::new(3, 2.0, ValuesKind::Logits, 5);
    let s = score_rows(&row, 5, &[3], NONE, &p);
    // Equal values come in ascending id order.
    assert_eq!(s.topk_ids, vec![1, 2, 4]);
    assert_eq!(s.topk_values, vec![1.5, 1.5, 1.5]);
    // lse of [0.5, 1.5, 1.5, -1, 1.5], computed by hand in f64.
    let lse = (0.5f64.exp() + 3.0 * 1.5f64.exp() + (-1.0f64).exp()).ln();
    assert!((s.logsumexp[0] as f64 - lse).abs() < 1e-6);
    assert!((s.target_logprobs[0] as f64 - (-1.0 - lse)).abs() < 1e-6);
}

/// Many rows, k larger than a block's worth of pruning, and rows with long runs of equal
/// values: the one-pass selection equals a full sort.
#[test]
fn one_pass_selection_equals_full_sort() {
    let (rows, width) = (4, 5000);
    let mut logits = pseudo_logits(rows, width);
    for v in logits[width..2 * width].iter_mut() {
        *v = (*v * 2.0).round(); // many exact ties
    }
    for k in [1, 64, 300] {
        let p = RowQuery::new(k, 1.0, ValuesKind::Logits, width);
        let s = score_rows(&logits, width, &[0; 4], NONE, &p);
        for r in 0..rows {
            let row = &logits[r * width..(r + 1) * width];
            let mut all: Vec<(f32, u32)> = row
                .iter()
                .enumerate()
                .map(|(i, &x)| (x, i as u32))
                .collect();
            all.sort_by(desc);
            let want: Vec<u32> = all[..k].iter().map(|e| e.1).collect();
            assert_eq!(s.ids_row(r), want.as_slice(), "row {r} k {k}");
        }
    }
}

/// Bits of every id, score and rank, for bit-for-bit comparisons (f32 equality would hide
/// -0.0 against 0.0 and NaN).
fn bits(s: &RowScores) -> Vec<u32> {
    let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    [
        s.topk_ids.clone(),
        f(&s.topk_values),
        f(&s.target_logprobs),
        f(&s.logsumexp),
        f(&s.ids_logprobs),
        s.target_ranks.clone(),
    ]
    .concat()
}

/// Every SIMD level gives the same bits (the levels differ in instruction width only), for
/// top-k, candidates, ranks and logsumexp; levels the CPU lacks fall back to one it has.
#[test]
fn simd_levels_agree_bit_for_bit() {
    let (rows, width, valid) = (6, 5000, 4990);
    let logits = pseudo_logits(rows, width);
    let mut p = RowQuery::new(17, 0.7, ValuesKind::Logprobs, valid);
    p.ranks = true;
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 7).collect();
    let cands: Vec<u32> = [3, 4_000, 4_995, 17].repeat(rows);
    let cands = CandidateRows { ids: &cands, m: 4 };
    let run = |level: Simd| bits(&score_rows_at(level, &logits, width, (&targets, cands), &p));
    let base = run(Simd::Baseline);
    for level in [Simd::Avx2, Simd::Avx512] {
        assert!(run(level) == base, "{level:?} differs from the baseline");
    }
}

/// The fused LM head's contract: folding the logits a tile at a time (padding columns in
/// the last tiles, targets and candidates in any tile, ties, temperature, both value kinds,
/// k = 0) gives the same bits as scoring the whole rows, and ranks refuse the tiled path.
#[test]
fn tiles_fold_to_the_same_bits_as_whole_rows() {
    let (rows, width, valid) = (5, 3 * RowFolds::TILE + 700, 3 * RowFolds::TILE + 300);
    let mut logits = pseudo_logits(rows, width);
    // Ties across tile borders: equal maxima in the first and the last tile of row 1.
    logits[width + 5] = 40.0;
    logits[width + 3 * RowFolds::TILE + 10] = 40.0;
    let targets: Vec<u32> = vec![0, 2 * RowFolds::TILE as u32 + 3, 1, valid as u32 - 1, 9];
    let cands: Vec<u32> = [5, RowFolds::TILE as u32, valid as u32 - 1].repeat(rows);
    let cands = CandidateRows { ids: &cands, m: 3 };
    for (k, t, values) in [
        (8, 1.0, ValuesKind::Logprobs),
        (64, 0.6, ValuesKind::Logits),
        (0, 2.0, ValuesKind::Logprobs),
    ] {
        let p = RowQuery::new(k, t, values, valid);
        let whole = score_rows(&logits, width, &targets, cands, &p);
        let mut folds = RowFolds::tiled(width, &targets, cands, &p).expect("no ranks asked");
        for c0 in (0..width).step_by(RowFolds::TILE) {
            let c1 = (c0 + RowFolds::TILE).min(width);
            let tile: Vec<f32> = (0..rows)
                .flat_map(|r| logits[r * width + c0..r * width + c1].to_vec())
                .collect();
            folds.fold(&tile, c0..c1);
        }
        let tiled = folds.finish();
        assert_eq!(bits(&tiled), bits(&whole), "k {k} t {t}");
        if k > 0 {
            assert_eq!(&tiled.ids_row(1)[..2], &[5, 3 * RowFolds::TILE as u32 + 10]);
        }
    }
    let mut p = RowQuery::new(8, 1.0, ValuesKind::Logprobs, valid);
    p.ranks = true;
    assert!(RowFolds::tiled(width, &targets, cands, &p).is_none());
}

/// Speed figure, not a check: `cargo test --release -p xdistill-cpu-kernels --lib topk_speed --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn topk_speed() {
    let (rows, width) = (64, 151_936);
    let logits = pseudo_logits(rows, width);
    let p = RowQuery::new(64, 1.0, ValuesKind::Logprobs, 151_669);
    let targets = vec![0u32; rows];
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        let s = score_rows(&logits, width, &targets, NONE, &p);
        let dt = t0.elapsed().as_secs_f64();
        println!(
            "{:.2} ms per row, {:.2} ns per logit ({} threads)",
            dt * 1e3 / rows as f64,
            dt * 1e9 / (rows * width) as f64,
            rayon::current_num_threads()
        );
        assert_eq!(s.rows, rows);
    }
    let row = &logits[..width];
    let t0 = std::time::Instant::now();
    let mut acc = 0.0;
    for _ in 0..50 {
        acc += simd::max(std::hint::black_box(row)) as f64;
    }
    println!(
        "max: {:.2} ns per logit",
        t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
    );
    let t0 = std::time::Instant::now();
    for _ in 0..50 {
        for b in std::hint::black_box(row).chunks(BLOCK) {
            acc += simd::sum_exp2(b, 6.0, std::f32::consts::LOG2_E);
        }
    }
    println!(
        "sum_exp: {:.2} ns per logit ({acc})",
        t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
    );
    println!("this CPU: {}", Simd::detect().name());
    let one = NONE;
    for round in 0..2 {
        for level in [Simd::Baseline, Simd::Avx2, Simd::Avx512] {
            let t0 = std::time::Instant::now();
            for _ in 0..50 {
                let s = score_rows_at(
                    level,
                    std::hint::black_box(row),
                    width,
                    (&[0], one),
                    &RowQuery { valid: width, ..p },
                );
                assert_eq!(s.rows, 1);
            }
            println!(
                "round {round}: one row ({}): {:.2} ns per logit",
                level.name(),
                t0.elapsed().as_secs_f64() * 1e9 / (50 * width) as f64
            );
        }
    }
}

#[test]
fn k_equal_to_vocab_and_zero_rows() {
    let row = vec![0.0f32, 1.0, 2.0];
    let p = RowQuery::new(3, 1.0, ValuesKind::Logprobs, 3);
    let s = score_rows(&row, 3, &[0], NONE, &p);
    assert_eq!(s.topk_ids, vec![2, 1, 0]);
    let total: f64 = s.topk_values.iter().map(|&v| (v as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6);
    let e = score_rows(&[], 3, &[], NONE, &p);
    assert_eq!(e.rows, 0);
    e.check_shapes().unwrap();
}

/// Version-2 outputs against the f64 reference: k = 0, candidate-id log-probs (padding ids
/// give -inf), and ranks (a target inside the top k gets its position, one outside it the
/// count of values >= its own).
#[test]
fn k_zero_candidates_and_ranks() {
    let (rows, width, valid) = (3, 400, 390);
    let logits = pseudo_logits(rows, width);
    let targets = [5u32, 77, 389];
    let cands: Vec<u32> = vec![1, 2, 3, 389, 0, 10, 20, 30, 40, 50, 60, 70];
    let c = CandidateRows { ids: &cands, m: 4 };
    for k in [0usize, 1, 50] {
        let p = RowQuery {
            ranks: true,
            ..RowQuery::new(k, 0.8, ValuesKind::Logprobs, valid)
        };
        let s = score_rows(&logits, width, &targets, c, &p);
        s.check_shapes().unwrap();
        assert_eq!((s.k, s.m, s.target_ranks.len()), (k, 4, rows));
        for r in 0..rows {
            let row = &logits[r * width..(r + 1) * width];
            let (all, lse) = reference(row, valid, 0.8);
            let lp = |id: usize| row[id] as f64 / 0.8 - lse;
            assert!((s.logsumexp[r] as f64 - lse).abs() < 1e-5);
            assert!((s.target_logprobs[r] as f64 - lp(targets[r] as usize)).abs() < 1e-5);
            for (j, &id) in cands[r * 4..(r + 1) * 4].iter().enumerate() {
                let got = s.ids_logprobs_row(r)[j] as f64;
                assert!((got - lp(id as usize)).abs() < 1e-5, "row {r} cand {j}");
            }
            // Rank from the full f64 sort (distinct values: no ties).
            let pos = all.iter().position(|e| e.0 == targets[r] as usize).unwrap();
            assert_eq!(s.target_ranks[r] as usize, pos + 1, "row {r} k {k}");
        }
    }
}

#[test]
fn ranks_put_ties_last_outside_the_top_k() {
    // Target 3 ties with ids 1 and 2 (value 3.0) but loses the tie order: with k = 1 it is
    // outside the top k, and its rank counts every value >= its own.
    let row = vec![1.0f32, 3.0, 3.0, 3.0, 4.0];
    let p = RowQuery {
        ranks: true,
        ..RowQuery::new(1, 1.0, ValuesKind::Logprobs, 5)
    };
    let s = score_rows(&row, 5, &[3], NONE, &p);
    assert_eq!(s.topk_ids, vec![4]);
    assert_eq!(s.target_ranks, vec![4]);
    let p3 = RowQuery { k: 4, ..p };
    let s = score_rows(&row, 5, &[3], NONE, &p3);
    assert_eq!(s.topk_ids, vec![4, 1, 2, 3]);
    assert_eq!(s.target_ranks, vec![4]);
    assert_eq!(rank_of(&row, 4.0), 1);
}
