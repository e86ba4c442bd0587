//! Top-k of rows with tensor ops on the rows' device: the one chunked device top-k of the
//! workspace, and on CUDA (unless turned off, [`crate::device::cuda_kernels`]) the selection
//! kernel of `kernels/cuda/src/topk_rows.cu`.
//!
//! candle has no top-k and its CUDA `arg_sort` fails above 8192 columns (shared memory), so a row
//! is cut into chunks of at most [`SORT_CHUNK`] columns, each chunk contributes its own top-k
//! candidates, and the candidates are reduced the same way until one sort of ≤ `SORT_CHUNK`
//! columns remains. Two users:
//! - [`topk_rows`], the server's GPU scoring path: top-k and log-softmax statistics of logit
//!   rows, of which only `[N, k]` results leave the device;
//! - [`topk_indices`], the trainer's losses: the indices of each row's k largest entries.
//!
//! The same code runs on the CPU, which is how its results are checked without a GPU.

use candle_core::{DType, Result, Tensor, D};

/// Widest row candle's CUDA sort handles.
pub const SORT_CHUNK: usize = 8192;

/// What to compute for each row: the host scoring's query (`xdistill_cpu_kernels::row_scores`),
/// answered here on the rows' device.
pub use xdistill_cpu_kernels::row_scores::RowQuery;
use xdistill_cpu_kernels::row_scores::ValuesKind;

/// Results for `N` rows.
pub struct TopkRows {
    /// `[N, k]` u32, by descending value.
    pub ids: Tensor,
    /// `[N, k]` f32: log-probs or scaled logits, as asked.
    pub values: Tensor,
    /// `[N]` f32: log-prob of each row's target id.
    pub target_logprobs: Tensor,
    /// `[N]` f32: logsumexp of `logits / temperature` over the valid vocabulary.
    pub logsumexp: Tensor,
    /// `[N, m]` f32: log-probs at the candidate ids, when candidates were given.
    pub ids_logprobs: Option<Tensor>,
    /// `[N]` u32: `#{v < valid : z_v >= z_target}`, when ranks were asked for.
    pub target_ranks: Option<Tensor>,
}

/// Scores logit rows `[N, V]` against `targets` `[N]` (u32) and optional `candidates` `[N, m]`
/// (u32).
///
/// Only the first `q.valid` columns take part (padded LM-head rows are excluded from the softmax
/// and can never be returned). Requires `k ≤ valid` and `temperature > 0`. On a CUDA device
/// with the project's kernels on ([`crate::device::cuda_kernels`]) and k ≤ 4096, the selection
/// kernel (one launch per chunk of rows, ties by id); [`topk_rows_chunked`] otherwise.
pub fn topk_rows(
    logits: &Tensor,
    targets: &Tensor,
    candidates: Option<&Tensor>,
    q: &RowQuery,
) -> Result<TopkRows> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda()
        && q.k <= xdistill_cuda_kernels::MAX_K
        && crate::device::cuda_kernels()
    {
        return topk_rows_kernel(logits, targets, candidates, q);
    }
    topk_rows_chunked(logits, targets, candidates, q, SORT_CHUNK)
}

/// [`topk_rows`] through the selection kernel; candidate ids' log-probs gathered beside it.
#[cfg(feature = "cuda")]
fn topk_rows_kernel(
    logits: &Tensor,
    targets: &Tensor,
    candidates: Option<&Tensor>,
    q: &RowQuery,
) -> Result<TopkRows> {
    let args = xdistill_cuda_kernels::TopkArgs {
        k: q.k,
        valid: q.valid,
        temperature: q.temperature,
        logprobs: q.values == ValuesKind::Logprobs,
        ranks: q.ranks,
    };
    let r = xdistill_cuda_kernels::topk_rows(logits, targets, args)?;
    // [N, m]: z at the candidates minus the logsumexp, z as the kernel computes it (x / T).
    let ids_logprobs = match candidates {
        Some(c) => {
            let z = (logits
                .gather(&c.to_dtype(DType::U32)?.contiguous()?, D::Minus1)?
                .to_dtype(DType::F32)?
                / q.temperature as f64)?;
            Some(z.broadcast_sub(&r.logsumexp.unsqueeze(1)?)?)
        }
        None => None,
    };
    Ok(TopkRows {
        ids: r.ids,
        values: r.values,
        target_logprobs: r.target_logprobs,
        logsumexp: r.logsumexp,
        ids_logprobs,
        target_ranks: r.target_ranks,
    })
}

/// [`topk_rows`] with an explicit sort width (tests use small widths to exercise the reduction).
pub fn topk_rows_chunked(
    logits: &Tensor,
    targets: &Tensor,
    candidates: Option<&Tensor>,
    q: &RowQuery,
    chunk: usize,
) -> Result<TopkRows> {
    let (n, v) = logits.dims2()?;
    let RowQuery { k, valid, .. } = *q;
    if k > valid || valid > v || chunk < 2 * k.max(1) {
        candle_core::bail!(
            "topk_rows: need k ({k}) <= valid ({valid}) <= V ({v}) and chunk ({chunk}) >= 2k"
        );
    }
    // 1. Scaled logits in f32: [N, Vv].
    let z = (logits.narrow(1, 0, valid)?.to_dtype(DType::F32)? / q.temperature as f64)?;
    // 2. logsumexp: [N, 1].
    let m = z.max_keepdim(D::Minus1)?;
    let lse = (z.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &m)?;
    // 3. Target log-prob and rank: [N, 1].
    let tgt = z.gather(&targets.to_dtype(DType::U32)?.reshape((n, 1))?, D::Minus1)?;
    let target_ranks = if q.ranks {
        let ge = z.broadcast_ge(&tgt)?.to_dtype(DType::F32)?.sum(D::Minus1)?;
        Some(ge.to_dtype(DType::U32)?)
    } else {
        None
    };
    let target_lp = (tgt - &lse)?;
    // 4. Candidate-id log-probs: [N, m].
    let ids_logprobs = match candidates {
        Some(c) => Some(
            z.gather(&c.to_dtype(DType::U32)?.contiguous()?, D::Minus1)?
                .broadcast_sub(&lse)?,
        ),
        None => None,
    };
    let (top_ids, top_vals) = if k == 0 {
        (
            Tensor::zeros((n, 0), DType::U32, z.device())?,
            Tensor::zeros((n, 0), DType::F32, z.device())?,
        )
    } else {
        top_k(&z, &lse, q, chunk)?
    };
    Ok(TopkRows {
        ids: top_ids,
        values: top_vals,
        target_logprobs: target_lp.squeeze(1)?,
        logsumexp: lse.squeeze(1)?,
        ids_logprobs,
        target_ranks,
    })
}

/// Indices `[N, k]` (u32, by descending value) of the `k` largest entries of each row of
/// `x` `[N, V]`, sorting at most `chunk` columns at once. No gradient flows through indices:
/// gather the values with them. Requires `1 ≤ k ≤ V` and `chunk ≥ 2k`.
pub fn topk_indices(x: &Tensor, k: usize, chunk: usize) -> Result<Tensor> {
    let (_, v) = x.dims2()?;
    if k == 0 || k > v || chunk < 2 * k {
        candle_core::bail!("topk_indices: need 1 <= k ({k}) <= V ({v}) and chunk ({chunk}) >= 2k");
    }
    let x = x.detach().to_dtype(DType::F32)?;
    Ok(select(&x, k, chunk)?.1)
}

/// The `k` largest entries of each row of `z` `[N, W]` (f32), by descending value: their
/// values and their column ids, both `[N, k]`. Requires `chunk ≥ 2k`.
fn select(z: &Tensor, k: usize, chunk: usize) -> Result<(Tensor, Tensor)> {
    let (mut vals, mut cand) = if z.dim(1)? > chunk {
        first_reduction(z, k, chunk)?
    } else {
        let order = z.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?;
        return Ok((z.gather(&order, D::Minus1)?, order));
    };
    // Candidates (values, ids) [N, W'], reduced until one sort suffices.
    while vals.dim(1)? > chunk {
        (vals, cand) = reduce_chunks(&vals, &cand, k, chunk)?;
    }
    // Final sort of ≤ chunk columns, keep k.
    let order = vals
        .arg_sort_last_dim(false)?
        .narrow(1, 0, k)?
        .contiguous()?;
    Ok((
        vals.gather(&order, D::Minus1)?,
        cand.gather(&order, D::Minus1)?,
    ))
}

/// The first reduction of a whole row `z` `[N, W]`: `[N, ceil(W / chunk) * k]` candidates, each
/// chunk's top k. A candidate's column id is its place in its chunk's sort plus the chunk's
/// first column, so no `[N, W]` id tensor is built (nor a `W`-long range uploaded to the device):
/// only the chunks' `ceil(W / chunk)` first columns are.
fn first_reduction(z: &Tensor, k: usize, chunk: usize) -> Result<(Tensor, Tensor)> {
    let (n, w) = z.dims2()?;
    let n_chunks = w.div_ceil(chunk);
    let pad = n_chunks * chunk - w;
    let z = if pad > 0 {
        let neg = Tensor::full(f32::NEG_INFINITY, (n, pad), z.device())?;
        Tensor::cat(&[z, &neg], 1)?
    } else {
        z.contiguous()?
    };
    // [N * n_chunks, chunk] rows sorted independently; keep each one's k largest.
    let v = z.reshape((n * n_chunks, chunk))?;
    let order = v.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?;
    let vals = v.gather(&order, D::Minus1)?.reshape((n, n_chunks * k))?;
    let firsts: Vec<u32> = (0..n_chunks).map(|c| (c * chunk) as u32).collect();
    let firsts = Tensor::from_vec(firsts, (1, n_chunks, 1), z.device())?;
    let ids = order
        .reshape((n, n_chunks, k))?
        .broadcast_add(&firsts)?
        .reshape((n, n_chunks * k))?;
    Ok((vals.contiguous()?, ids.contiguous()?))
}

/// Top `q.k` (ids, values) of scaled logits `z` [N, Vv] with logsumexp `lse` [N, 1].
fn top_k(z: &Tensor, lse: &Tensor, q: &RowQuery, chunk: usize) -> Result<(Tensor, Tensor)> {
    let (top_vals, top_ids) = select(z, q.k, chunk)?;
    let top_vals = match q.values {
        ValuesKind::Logprobs => top_vals.broadcast_sub(lse)?,
        ValuesKind::Logits => top_vals,
    };
    Ok((top_ids, top_vals))
}

/// One reduction: `[N, W]` → `[N, ceil(W / chunk) * k]`, each chunk keeping its top k.
fn reduce_chunks(vals: &Tensor, ids: &Tensor, k: usize, chunk: usize) -> Result<(Tensor, Tensor)> {
    let (n, w) = vals.dims2()?;
    let n_chunks = w.div_ceil(chunk);
    let pad = n_chunks * chunk - w;
    let (vals, ids) = if pad > 0 {
        let neg = Tensor::full(f32::NEG_INFINITY, (n, pad), vals.device())?;
        let zero = Tensor::zeros((n, pad), DType::U32, vals.device())?;
        (
            Tensor::cat(&[vals, &neg], 1)?,
            Tensor::cat(&[ids, &zero], 1)?,
        )
    } else {
        (vals.clone(), ids.clone())
    };
    // [N * n_chunks, chunk] rows sorted independently.
    let v = vals.reshape((n * n_chunks, chunk))?.contiguous()?;
    let i = ids.reshape((n * n_chunks, chunk))?.contiguous()?;
    let order = v.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?;
    let v = v.gather(&order, D::Minus1)?.reshape((n, n_chunks * k))?;
    let i = i.gather(&order, D::Minus1)?.reshape((n, n_chunks * k))?;
    Ok((v.contiguous()?, i.contiguous()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// f64 reference: full log-softmax and a full sort.
    fn reference(
        row: &[f32],
        target: usize,
        k: usize,
        t: f32,
        valid: usize,
    ) -> (Vec<(u32, f64)>, f64, f64) {
        let z: Vec<f64> = row[..valid].iter().map(|&x| x as f64 / t as f64).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let mut idx: Vec<usize> = (0..valid).collect();
        idx.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
        (
            idx[..k].iter().map(|&i| (i as u32, z[i] - lse)).collect(),
            z[target] - lse,
            lse,
        )
    }

    fn check(n: usize, v: usize, valid: usize, k: usize, t: f32, chunk: usize) {
        // Distinct values (a permutation scaled), so the order is unique and ids must match.
        let mut data = Vec::with_capacity(n * v);
        for r in 0..n {
            for c in 0..v {
                let h = ((c * 7919 + r * 104729) % v) as f32;
                data.push(h / v as f32 * 12.0 - 6.0);
            }
        }
        let targets: Vec<u32> = (0..n).map(|r| ((r * 31) % valid) as u32).collect();
        let logits = Tensor::from_vec(data.clone(), (n, v), &Device::Cpu).unwrap();
        let tg = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let q = RowQuery {
            k,
            temperature: t,
            valid,
            values: ValuesKind::Logprobs,
            ranks: true,
        };
        // Candidates: 3 ids per row spread over the valid vocabulary.
        let cands: Vec<u32> = (0..n * 3).map(|i| ((i * 977) % valid) as u32).collect();
        let ct = Tensor::from_vec(cands.clone(), (n, 3), &Device::Cpu).unwrap();
        let out = topk_rows_chunked(&logits, &tg, Some(&ct), &q, chunk).unwrap();
        let ilp: Vec<Vec<f32>> = out.ids_logprobs.unwrap().to_vec2().unwrap();
        let ranks: Vec<u32> = out.target_ranks.unwrap().to_vec1().unwrap();
        let ids: Vec<Vec<u32>> = out.ids.to_vec2().unwrap();
        let vals: Vec<Vec<f32>> = out.values.to_vec2().unwrap();
        let tlp: Vec<f32> = out.target_logprobs.to_vec1().unwrap();
        let lse: Vec<f32> = out.logsumexp.to_vec1().unwrap();
        for r in 0..n {
            let (top, t_lp, l) =
                reference(&data[r * v..(r + 1) * v], targets[r] as usize, k, t, valid);
            for (j, (id, lp)) in top.iter().enumerate() {
                assert_eq!(ids[r][j], *id, "row {r} rank {j}");
                assert!(
                    (vals[r][j] as f64 - lp).abs() < 1e-5,
                    "row {r} rank {j}: {} vs {lp}",
                    vals[r][j]
                );
            }
            assert!((tlp[r] as f64 - t_lp).abs() < 1e-5);
            assert!((lse[r] as f64 - l).abs() < 1e-5);
            let row = &data[r * v..r * v + valid];
            for j in 0..3 {
                let c = cands[r * 3 + j] as usize;
                let want = row[c] as f64 / t as f64 - l;
                assert!((ilp[r][j] as f64 - want).abs() < 1e-5, "row {r} cand {j}");
            }
            // Rank by a naive count in f64.
            let zt = row[targets[r] as usize] as f64;
            let want_rank = row.iter().filter(|&&x| x as f64 >= zt).count() as u32;
            assert_eq!(ranks[r], want_rank, "row {r}");
        }
    }

    #[test]
    fn k_zero_gives_target_and_logsumexp_only() {
        let data: Vec<f32> = (0..2 * 50).map(|i| ((i * 37) % 50) as f32 / 7.0).collect();
        let logits = Tensor::from_vec(data.clone(), (2, 50), &Device::Cpu).unwrap();
        let tg = Tensor::new(&[3u32, 40], &Device::Cpu).unwrap();
        let q = RowQuery {
            k: 0,
            temperature: 1.0,
            valid: 45,
            values: ValuesKind::Logprobs,
            ranks: false,
        };
        let out = topk_rows(&logits, &tg, None, &q).unwrap();
        assert_eq!(out.ids.dims(), &[2, 0]);
        assert_eq!(out.values.dims(), &[2, 0]);
        let tlp: Vec<f32> = out.target_logprobs.to_vec1().unwrap();
        for (r, &t) in [3usize, 40].iter().enumerate() {
            let (_, want, _) = reference(&data[r * 50..(r + 1) * 50], t, 1, 1.0, 45);
            assert!((tlp[r] as f64 - want).abs() < 1e-5);
        }
        assert!(out.ids_logprobs.is_none() && out.target_ranks.is_none());
    }

    #[test]
    fn matches_f64_reference_without_reduction() {
        check(3, 200, 190, 8, 1.0, 256);
    }

    #[test]
    fn matches_f64_reference_through_several_reductions() {
        // 5000 columns with 16-wide sorts: 5000 -> 2504 -> ... -> <= 16, and padded columns masked.
        check(4, 5000, 4993, 5, 0.7, 16);
        check(2, 1000, 1000, 8, 2.0, 16);
    }

    #[test]
    fn rejects_bad_arguments() {
        let l = Tensor::zeros((2, 10), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::zeros(2, DType::U32, &Device::Cpu).unwrap();
        let q = |k, valid| RowQuery {
            k,
            temperature: 1.0,
            valid,
            values: ValuesKind::Logprobs,
            ranks: false,
        };
        assert!(topk_rows(&l, &t, None, &q(11, 10)).is_err());
        assert!(topk_rows(&l, &t, None, &q(3, 12)).is_err());
        assert!(topk_indices(&l, 0, 16).is_err());
        assert!(topk_indices(&l, 11, 64).is_err());
        assert!(topk_indices(&l, 9, 16).is_err());
    }

    /// The indices of the k largest entries, through several reductions and none, equal a
    /// full sort's (distinct values: the order is unique).
    #[test]
    fn indices_match_a_full_sort() {
        for (n, v, k, chunk) in [(3, 5000, 5, 16), (2, 200, 8, 256), (4, 1000, 1, 2)] {
            let data: Vec<f32> = (0..n * v)
                .map(|i| ((i % v) * 7919 % v + (i / v) * 13) as f32 / v as f32)
                .collect();
            let x = Tensor::from_vec(data.clone(), (n, v), &Device::Cpu).unwrap();
            let got: Vec<Vec<u32>> = topk_indices(&x, k, chunk).unwrap().to_vec2().unwrap();
            for (r, g) in got.iter().enumerate() {
                let row = &data[r * v..(r + 1) * v];
                let mut idx: Vec<u32> = (0..v as u32).collect();
                idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
                assert_eq!(
                    g.as_slice(),
                    &idx[..k],
                    "n {n} v {v} k {k} chunk {chunk} row {r}"
                );
            }
        }
    }
}
