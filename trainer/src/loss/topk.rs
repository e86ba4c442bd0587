//! Row-wise top-k indices over a wide last dimension: the workspace's one chunked device top-k
//! ([`xdistill_shared::topk::topk_indices`]), with the loss's argument checks, and whole-row
//! sorts on the host for wider `k` ([`descending_order`]).
//!
//! candle has no top-k op and its CUDA `arg_sort_last_dim` fails above 8192 columns, so wide rows
//! are sorted in blocks of [`BLOCK`] columns, the best `k` of every block kept, and the
//! candidates reduced again until one block remains.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::{LossError, Result};

/// Columns sorted at once (well under the CUDA shared-memory limit of 8192).
pub const BLOCK: usize = 4096;

/// Indices `[R, k]` (u32, descending by value) of the `k` largest entries of each row of
/// `x: [R, V]`. No gradient flows through indices; gather the values with them. Up to
/// `BLOCK / 2` on the device; a wider `k` sorts whole rows on the host.
pub fn topk_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    let (_, v) = x.dims2()?;
    if k == 0 || k > v {
        return Err(LossError::input(
            "k",
            format!("top-k needs 1 <= k <= columns = {v}"),
        ));
    }
    if k > BLOCK / 2 {
        return Ok(descending_order(x)?.narrow(1, 0, k)?.contiguous()?);
    }
    Ok(xdistill_shared::topk::topk_indices(x, k, BLOCK)?)
}

/// Each row's column order by descending value, `[R, V]` u32 on `x`'s device: every row sorted
/// on the host, rows in parallel, as packed `(key, column)` u64s (f32 and narrower dtypes; an
/// order-preserving key of the f32 bits) or by `total_cmp` (f64). For whole-vocabulary sorts,
/// which candle's CUDA arg-sort cannot do (it stops at 8,192 columns).
pub fn descending_order(x: &Tensor) -> Result<Tensor> {
    let (n, v) = x.dims2()?;
    let mut order = vec![0u32; n * v];
    if n * v == 0 {
        return Ok(Tensor::from_vec(order, (n, v), x.device())?);
    }
    if x.dtype() == DType::F64 {
        let host = x.flatten_all()?.to_vec1::<f64>()?;
        order
            .par_chunks_mut(v)
            .zip(host.par_chunks(v))
            .for_each(|(o, row)| {
                o.iter_mut().enumerate().for_each(|(i, c)| *c = i as u32);
                o.sort_unstable_by(|&i, &j| row[j as usize].total_cmp(&row[i as usize]));
            });
    } else {
        let host = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        order
            .par_chunks_mut(v)
            .zip(host.par_chunks(v))
            .for_each(|(o, row)| {
                let mut keys: Vec<u64> = row
                    .iter()
                    .enumerate()
                    .map(|(i, x)| (u64::from(!ascending_key(*x)) << 32) | i as u64)
                    .collect();
                keys.sort_unstable();
                o.iter_mut().zip(keys).for_each(|(o, k)| *o = k as u32);
            });
    }
    Ok(Tensor::from_vec(order, (n, v), x.device())?)
}

/// A u32 that orders as the f32 does (IEEE total order: negatives reversed, then positives).
fn ascending_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 1 << 31
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::{rng, topk, uniform};
    use candle_core::{DType, Device};

    #[test]
    fn matches_a_host_sort_on_wide_and_narrow_rows() {
        let mut r = rng(71);
        for (rows, v, k) in [
            (3, 10_000, 7),
            (2, 8_193, 64),
            (4, 50, 5),
            (1, 3 * BLOCK, 3),
            // Past the device top-k: whole rows sorted on the host.
            (2, 10_000, BLOCK / 2 + 1),
            (1, 9_000, 9_000),
        ] {
            let data = uniform(&mut r, rows * v, 10.0);
            let x = Tensor::from_vec(data.clone(), (rows, v), &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let got: Vec<Vec<u32>> = topk_indices(&x, k).unwrap().to_vec2().unwrap();
            for (row, g) in got.iter().enumerate() {
                // Compared by value in f32 (two draws may round to one f32: either order is right).
                let d = &data[row * v..(row + 1) * v];
                let value = |i: usize| d[i] as f32;
                let want: Vec<f32> = topk(d, k).into_iter().map(value).collect();
                let got: Vec<f32> = g.iter().map(|&i| value(i as usize)).collect();
                assert!(got == want, "rows={rows} v={v} k={k} row={row}");
                let mut distinct = g.clone();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(
                    distinct.len(),
                    k,
                    "rows={rows} v={v} k={k}: distinct indices"
                );
            }
        }
    }

    /// The host sort at a real vocabulary's width (past candle's 8,192-column CUDA arg-sort):
    /// the order of a std sort by value, in f32 and f64, with negatives, zeros of both signs
    /// and ties.
    #[test]
    fn descending_order_sorts_rows_wider_than_the_device_arg_sort() {
        let (n, v) = (3, 20_000);
        let mut vals = uniform(&mut rng(41), n * v, 5.0);
        vals[5] = 0.0;
        vals[7] = -0.0;
        vals[9] = 0.0;
        vals[v + 3] = vals[v + 11];
        for dtype in [DType::F32, DType::F64] {
            let x = Tensor::from_vec(vals.clone(), (n, v), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let rows: Vec<f64> = x
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let order: Vec<Vec<u32>> = descending_order(&x).unwrap().to_vec2().unwrap();
            for (i, o) in order.iter().enumerate() {
                let row = &rows[i * v..(i + 1) * v];
                let mut seen = vec![false; v];
                o.iter().for_each(|&j| seen[j as usize] = true);
                assert!(seen.iter().all(|&s| s), "{dtype:?} row {i}: a permutation");
                let got: Vec<f64> = o.iter().map(|&j| row[j as usize]).collect();
                let mut want = row.to_vec();
                want.sort_by(|a, b| b.partial_cmp(a).unwrap());
                assert_eq!(got, want, "{dtype:?} row {i}");
            }
        }
    }

    #[test]
    fn bad_k_is_an_error() {
        let x = Tensor::zeros((2, 10), DType::F32, &Device::Cpu).unwrap();
        assert!(topk_indices(&x, 0).is_err());
        assert!(topk_indices(&x, 11).is_err());
    }
}
