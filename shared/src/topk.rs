//! Top-k and log-softmax statistics of logit rows, computed with tensor ops on the rows' device.
//!
//! This is the GPU scoring path: only `[N, k]` results leave the device. candle has no top-k and
//! its CUDA `arg_sort` fails above 8192 columns (shared memory), so the vocabulary is cut into
//! chunks of at most [`SORT_CHUNK`] columns, each chunk contributes its own top-k candidates, and the
//! candidates are reduced the same way until one sort of ≤ `SORT_CHUNK` columns remains. The same
//! code runs on the CPU, which is how its results are checked without a GPU.

use crate::protocol::ValuesKind;
use candle_core::{DType, Result, Tensor, D};

/// Widest row candle's CUDA sort handles.
pub const SORT_CHUNK: usize = 8192;

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
}

/// Scores logit rows `[N, V]` against `targets` `[N]` (u32).
///
/// Only the first `valid` columns take part (padded LM-head rows are excluded from the softmax and
/// can never be returned). Requires `1 ≤ k ≤ valid` and `temperature > 0`.
pub fn topk_rows(
    logits: &Tensor,
    targets: &Tensor,
    k: usize,
    temperature: f32,
    valid: usize,
    values: ValuesKind,
) -> Result<TopkRows> {
    topk_rows_chunked(logits, targets, k, temperature, valid, values, SORT_CHUNK)
}

/// [`topk_rows`] with an explicit sort width (tests use small widths to exercise the reduction).
pub fn topk_rows_chunked(
    logits: &Tensor,
    targets: &Tensor,
    k: usize,
    temperature: f32,
    valid: usize,
    values: ValuesKind,
    chunk: usize,
) -> Result<TopkRows> {
    let (n, v) = logits.dims2()?;
    if k == 0 || k > valid || valid > v || chunk < 2 * k {
        candle_core::bail!(
            "topk_rows: need 1 <= k ({k}) <= valid ({valid}) <= V ({v}) and chunk ({chunk}) >= 2k"
        );
    }
    // 1. Scaled logits in f32: [N, Vv].
    let z = (logits.narrow(1, 0, valid)?.to_dtype(DType::F32)? / temperature as f64)?;
    // 2. logsumexp: [N, 1].
    let m = z.max_keepdim(D::Minus1)?;
    let lse = (z.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &m)?;
    // 3. Target log-prob: [N, 1].
    let tgt = z.gather(&targets.to_dtype(DType::U32)?.reshape((n, 1))?, D::Minus1)?;
    let target_lp = (tgt - &lse)?;
    // 4. Candidates: (values, ids) [N, W], reduced until one sort suffices.
    let ids = Tensor::arange(0u32, valid as u32, z.device())?
        .unsqueeze(0)?
        .broadcast_as((n, valid))?
        .contiguous()?;
    let (mut vals, mut cand) = (z.contiguous()?, ids);
    while vals.dim(1)? > chunk {
        (vals, cand) = reduce_chunks(&vals, &cand, k, chunk)?;
    }
    // 5. Final sort of ≤ chunk columns, keep k.
    let order = vals
        .arg_sort_last_dim(false)?
        .narrow(1, 0, k)?
        .contiguous()?;
    let top_vals = vals.gather(&order, D::Minus1)?;
    let top_ids = cand.gather(&order, D::Minus1)?;
    let top_vals = match values {
        ValuesKind::Logprobs => top_vals.broadcast_sub(&lse)?,
        ValuesKind::Logits => top_vals,
    };
    Ok(TopkRows {
        ids: top_ids,
        values: top_vals,
        target_logprobs: target_lp.squeeze(1)?,
        logsumexp: lse.squeeze(1)?,
    })
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
        let out =
            topk_rows_chunked(&logits, &tg, k, t, valid, ValuesKind::Logprobs, chunk).unwrap();
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
        }
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
        assert!(topk_rows(&l, &t, 0, 1.0, 10, ValuesKind::Logprobs).is_err());
        assert!(topk_rows(&l, &t, 11, 1.0, 10, ValuesKind::Logprobs).is_err());
        assert!(topk_rows(&l, &t, 3, 1.0, 12, ValuesKind::Logprobs).is_err());
    }
}
