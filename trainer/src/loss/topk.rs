//! Row-wise top-k indices over a wide last dimension.
//!
//! candle has no top-k op and its CUDA `arg_sort_last_dim` fails above 8192 columns, so wide rows
//! are sorted in blocks of [`BLOCK`] columns, the best `k` of every block kept, and the
//! candidates reduced again until one block remains.

use candle_core::{DType, Tensor, D};

use super::{LossError, Result};

/// Columns sorted at once (well under the CUDA shared-memory limit of 8192).
pub const BLOCK: usize = 4096;

/// Indices `[R, k]` (u32, descending by value) of the `k` largest entries of each row of
/// `x: [R, V]`. No gradient flows through indices; gather the values with them.
pub fn topk_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    let (rows, v) = x.dims2()?;
    if k == 0 || k > v || k > BLOCK / 2 {
        return Err(LossError::input(
            "k",
            format!("top-k needs 1 <= k <= min(columns = {v}, {})", BLOCK / 2),
        ));
    }
    let x = x.detach().to_dtype(DType::F32)?;
    if v <= BLOCK {
        return Ok(x.arg_sort_last_dim(false)?.narrow(1, 0, k)?.contiguous()?);
    }
    // 1. Pad to whole blocks with −∞: [R, nb, BLOCK].
    let nb = v.div_ceil(BLOCK);
    let pad = nb * BLOCK - v;
    let x = if pad > 0 {
        let fill = Tensor::full(f32::NEG_INFINITY, (rows, pad), x.device())?;
        Tensor::cat(&[&x, &fill], 1)?
    } else {
        x
    };
    let x3 = x.reshape((rows, nb, BLOCK))?;
    // 2. Best k per block, as global column indices: [R, nb·k].
    let local = x3
        .arg_sort_last_dim(false)?
        .narrow(D::Minus1, 0, k)?
        .contiguous()?;
    let vals = x3.gather(&local, D::Minus1)?.reshape((rows, nb * k))?;
    let offsets: Vec<u32> = (0..nb).map(|b| (b * BLOCK) as u32).collect();
    let offsets = Tensor::from_vec(offsets, (1, nb, 1), x.device())?;
    let global = local.broadcast_add(&offsets)?.reshape((rows, nb * k))?;
    // 3. Reduce the candidates (nb·k ≤ V/2, so this terminates).
    let best = topk_indices(&vals, k)?;
    Ok(global.gather(&best, 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::testutil::{rng, topk, uniform};
    use candle_core::Device;

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
