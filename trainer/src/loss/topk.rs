//! Row-wise top-k indices over a wide last dimension: the workspace's one chunked device top-k
//! ([`xdistill_shared::topk::topk_indices`]), with the loss's argument checks.
//!
//! candle has no top-k op and its CUDA `arg_sort_last_dim` fails above 8192 columns, so wide rows
//! are sorted in blocks of [`BLOCK`] columns, the best `k` of every block kept, and the
//! candidates reduced again until one block remains.

use candle_core::Tensor;

use super::{LossError, Result};

/// Columns sorted at once (well under the CUDA shared-memory limit of 8192).
pub const BLOCK: usize = 4096;

/// Indices `[R, k]` (u32, descending by value) of the `k` largest entries of each row of
/// `x: [R, V]`. No gradient flows through indices; gather the values with them.
pub fn topk_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    let (_, v) = x.dims2()?;
    if k == 0 || k > v || k > BLOCK / 2 {
        return Err(LossError::input(
            "k",
            format!("top-k needs 1 <= k <= min(columns = {v}, {})", BLOCK / 2),
        ));
    }
    Ok(xdistill_shared::topk::topk_indices(x, k, BLOCK)?)
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
        ] {
            let data = uniform(&mut r, rows * v, 10.0);
            let x = Tensor::from_vec(data.clone(), (rows, v), &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let got: Vec<Vec<u32>> = topk_indices(&x, k).unwrap().to_vec2().unwrap();
            for (row, g) in got.iter().enumerate() {
                let want: Vec<u32> = topk(&data[row * v..(row + 1) * v], k)
                    .into_iter()
                    .map(|i| i as u32)
                    .collect();
                assert_eq!(g, &want, "rows={rows} v={v} k={k} row={row}");
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
