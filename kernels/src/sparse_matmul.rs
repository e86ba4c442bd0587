//! `x · W` for a sparse `W` stored column by column: the projection of a student's
//! probabilities onto teacher tokens in the cross-tokenizer losses (`Q = p̄ · W`), with a
//! backward pass.
//!
//! Composed from candle's ops, the product is `index_select` → `mul` → `index_add` over one
//! entry per stored weight and row, and candle's backward adds four more tensors of that size:
//! at k = 32,000 on 45 chunks (a Qwen3 student, a Llama 2 teacher) that is 15M entries, about
//! 60 MB a tensor and most of the loss's memory. On the CPU this op keeps the plan on the host
//! (12 bytes an entry, no tensor of that size) and writes only `[R, n_out]` forward and
//! `[R, n_in]` backward. Other devices use the composed ops.

use std::sync::Arc;

use crate::log_softmax::contiguous_slice;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// A sparse `[n_in, n_out]` matrix by columns (CSC): column `o` holds the weights
/// `weights[ptr[o]..ptr[o + 1]]` at the rows `rows[ptr[o]..ptr[o + 1]]`. Repeated rows within a
/// column add up.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseColumns {
    n_in: usize,
    ptr: Vec<usize>,
    rows: Vec<u32>,
    weights: Vec<f32>,
}

impl SparseColumns {
    /// Checks the layout: `ptr` starts at 0, never decreases and ends at the number of entries,
    /// every row is `< n_in`, one weight per row.
    pub fn new(n_in: usize, ptr: Vec<usize>, rows: Vec<u32>, weights: Vec<f32>) -> Result<Self> {
        if rows.len() != weights.len() {
            candle_core::bail!(
                "sparse_matmul: {} rows for {} weights",
                rows.len(),
                weights.len()
            );
        }
        if ptr.first() != Some(&0)
            || ptr.last() != Some(&rows.len())
            || ptr.windows(2).any(|w| w[0] > w[1])
        {
            candle_core::bail!(
                "sparse_matmul: column offsets must rise from 0 to {}",
                rows.len()
            );
        }
        if let Some(r) = rows.iter().find(|&&r| r as usize >= n_in) {
            candle_core::bail!("sparse_matmul: row {r} >= {n_in} input columns");
        }
        Ok(Self {
            n_in,
            ptr,
            rows,
            weights,
        })
    }

    /// The number of columns (the product's width).
    pub fn n_out(&self) -> usize {
        self.ptr.len() - 1
    }

    /// The number of rows (the input's width).
    pub fn n_in(&self) -> usize {
        self.n_in
    }

    /// The number of stored weights.
    pub fn nnz(&self) -> usize {
        self.rows.len()
    }

    /// Each entry's column, `[nnz]`: the segment ids of the composed form.
    fn columns(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.nnz());
        for (o, w) in self.ptr.windows(2).enumerate() {
            out.extend(std::iter::repeat_n(o as u32, w[1] - w[0]));
        }
        out
    }
}

/// `x [R, n_in] · W [n_in, n_out] -> [R, n_out]` (f32/f64; each column's sum in f64 on the CPU), with
/// a backward pass to `x` (W is a constant).
pub fn sparse_matmul(x: &Tensor, w: &Arc<SparseColumns>) -> Result<Tensor> {
    let (_, n_in) = x.dims2()?;
    if n_in != w.n_in {
        candle_core::bail!("sparse_matmul: x has {n_in} columns, W {} rows", w.n_in);
    }
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        return x.contiguous()?.apply_op1(SparseMatmul(w.clone()));
    }
    composed(x, w)
}

/// The product from candle's ops: `index_select` → `mul` → `index_add`, `[R, nnz]` between.
fn composed(x: &Tensor, w: &SparseColumns) -> Result<Tensor> {
    let dev = x.device();
    let r = x.dim(0)?;
    let rows = Tensor::from_vec(w.rows.clone(), w.nnz(), dev)?;
    let weights = Tensor::from_vec(w.weights.clone(), (1, w.nnz()), dev)?.to_dtype(x.dtype())?;
    let cols = Tensor::from_vec(w.columns(), w.nnz(), dev)?;
    let vals = x.index_select(&rows, 1)?.broadcast_mul(&weights)?; // [R, nnz]
    Tensor::zeros((r, w.n_out()), x.dtype(), dev)?.index_add(&cols, &vals, 1)
}

struct SparseMatmul(Arc<SparseColumns>);

/// `out[r, o] = Σ_{e ∈ column o} w_e · x[r, row_e]` for the `r_rows` rows of `x`.
fn fwd<T: crate::num_like::Float>(x: &[T], r_rows: usize, w: &SparseColumns) -> Vec<T> {
    let (n_in, n_out) = (w.n_in, w.n_out());
    let mut out = vec![T::zero(); r_rows * n_out];
    let column = |x: &[T], o: usize| -> T {
        let e = w.ptr[o]..w.ptr[o + 1];
        let s: f64 = w.rows[e.clone()]
            .iter()
            .zip(&w.weights[e])
            .map(|(&r, &wt)| wt as f64 * x[r as usize].to_f64())
            .sum();
        T::from_f64(s)
    };
    if r_rows == 1 {
        // One row (the top-k losses' flat plan): the columns in parallel.
        out.par_chunks_mut(4096).enumerate().for_each(|(b, o)| {
            for (i, o) in o.iter_mut().enumerate() {
                *o = column(x, b * 4096 + i);
            }
        });
    } else if n_out > 0 && n_in > 0 {
        out.par_chunks_mut(n_out)
            .zip(x.par_chunks(n_in))
            .for_each(|(o, x)| {
                for (j, o) in o.iter_mut().enumerate() {
                    *o = column(x, j);
                }
            });
    }
    out
}

/// `gx[r, row_e] += w_e · g[r, o]` over every entry e of column o, for the `r_rows` rows of
/// `g` (each product in f64, the sums kept in `T`: a `[R, n_in]` f64 buffer would double the
/// backward's largest allocation).
fn bwd<T: crate::num_like::Float>(g: &[T], r_rows: usize, w: &SparseColumns) -> Vec<T> {
    let (n_in, n_out) = (w.n_in, w.n_out());
    let mut gx = vec![T::zero(); r_rows * n_in];
    if n_in == 0 || n_out == 0 {
        return gx;
    }
    gx.par_chunks_mut(n_in)
        .zip(g.par_chunks(n_out))
        .for_each(|(gx, g)| {
            for (o, &go) in g.iter().enumerate() {
                let go = go.to_f64();
                let e = w.ptr[o]..w.ptr[o + 1];
                for (&r, &wt) in w.rows[e.clone()].iter().zip(&w.weights[e]) {
                    let at = &mut gx[r as usize];
                    *at = T::from_f64(at.to_f64() + wt as f64 * go);
                }
            }
        });
    gx
}

/// Runs one pass (the forward or the backward, `f32_pass` / `f64_pass`) on f32 or f64 storage.
fn on_floats(
    s: &CpuStorage,
    l: &Layout,
    f32_pass: impl FnOnce(&[f32]) -> Vec<f32>,
    f64_pass: impl FnOnce(&[f64]) -> Vec<f64>,
) -> Result<CpuStorage> {
    Ok(match s {
        CpuStorage::F32(v) => CpuStorage::F32(f32_pass(contiguous_slice(v, l)?)),
        CpuStorage::F64(v) => CpuStorage::F64(f64_pass(contiguous_slice(v, l)?)),
        _ => candle_core::bail!("sparse_matmul: f32 or f64 only"),
    })
}

impl CustomOp1 for SparseMatmul {
    fn name(&self) -> &'static str {
        "xdistill-sparse-matmul"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let r = l.dims()[0];
        let out = on_floats(s, l, |x| fwd(x, r, &self.0), |x| fwd(x, r, &self.0))?;
        Ok((out, Shape::from((r, self.0.n_out()))))
    }
    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            grad_res
                .contiguous()?
                .apply_op1_no_bwd(&SparseMatmulBwd(self.0.clone()))?,
        ))
    }
}

struct SparseMatmulBwd(Arc<SparseColumns>);

impl CustomOp1 for SparseMatmulBwd {
    fn name(&self) -> &'static str {
        "xdistill-sparse-matmul-bwd"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let r = l.dims()[0];
        let out = on_floats(s, l, |g| bwd(g, r, &self.0), |g| bwd(g, r, &self.0))?;
        Ok((out, Shape::from((r, self.0.n_in))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{max_abs, to_f64s};
    use candle_core::{Device, Var};

    /// A 7 × 5 W with an empty column, a repeated row within a column and a row in no column.
    fn small_w() -> Arc<SparseColumns> {
        let ptr = vec![0, 2, 2, 5, 6, 8];
        let rows = vec![0, 3, 1, 1, 6, 2, 0, 5];
        let weights = vec![0.5, -1.0, 2.0, 0.25, 1.5, -0.75, 3.0, 0.125];
        Arc::new(SparseColumns::new(7, ptr, rows, weights).unwrap())
    }

    /// The product and its gradient in f64 by naive loops over a dense W.
    fn dense_reference(x: &[f64], r: usize, w: &SparseColumns) -> (Vec<f64>, Vec<f64>) {
        let (n_in, n_out) = (w.n_in, w.n_out());
        let mut dense = vec![0.0; n_in * n_out];
        for o in 0..n_out {
            for e in w.ptr[o]..w.ptr[o + 1] {
                dense[w.rows[e] as usize * n_out + o] += w.weights[e] as f64;
            }
        }
        let mut y = vec![0.0; r * n_out];
        for i in 0..r {
            for o in 0..n_out {
                y[i * n_out + o] = (0..n_in)
                    .map(|j| x[i * n_in + j] * dense[j * n_out + o])
                    .sum();
            }
        }
        // d(Σ_o c_o y[i, o])/dx[i, j] with c_o = o + 1.
        let mut g = vec![0.0; r * n_in];
        for i in 0..r {
            for j in 0..n_in {
                g[i * n_in + j] = (0..n_out)
                    .map(|o| (o + 1) as f64 * dense[j * n_out + o])
                    .sum();
            }
        }
        (y, g)
    }

    #[test]
    fn matches_a_dense_f64_reference_forward_and_backward() {
        let w = small_w();
        for r in [1, 3] {
            let xs: Vec<f64> = (0..r * 7).map(|i| (i as f64 * 0.7).sin()).collect();
            let (want_y, want_g) = dense_reference(&xs, r, &w);
            let c = Tensor::from_vec(
                (1..=5).map(|o| o as f64).collect::<Vec<_>>(),
                (1, 5),
                &Device::Cpu,
            )
            .unwrap();
            for dtype in [DType::F64, DType::F32] {
                let x = Var::from_tensor(
                    &Tensor::from_vec(xs.clone(), (r, 7), &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap(),
                )
                .unwrap();
                let y = sparse_matmul(x.as_tensor(), &w).unwrap();
                let got = to_f64s(&y);
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                for (a, b) in got.iter().zip(&want_y) {
                    assert!((a - b).abs() < tol, "{dtype:?} r={r}: {a} vs {b}");
                }
                let loss = y
                    .broadcast_mul(&c.to_dtype(dtype).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let g = loss.backward().unwrap();
                let got = to_f64s(g.get(x.as_tensor()).unwrap());
                for (a, b) in got.iter().zip(&want_g) {
                    assert!((a - b).abs() < tol, "{dtype:?} r={r} grad: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn the_fused_op_equals_the_composed_form() {
        // The composed form is what other devices run.
        let w = small_w();
        let xs: Vec<f32> = (0..21).map(|i| (i as f32 * 0.3).cos()).collect();
        let c = Tensor::from_vec(
            (1..=15).map(|o| o as f32).collect::<Vec<_>>(),
            (3, 5),
            &Device::Cpu,
        )
        .unwrap();
        let x = Var::from_tensor(&Tensor::from_vec(xs, (3, 7), &Device::Cpu).unwrap()).unwrap();
        let fused = sparse_matmul(x.as_tensor(), &w).unwrap();
        let comp = composed(x.as_tensor(), &w).unwrap();
        assert!(max_abs(&fused, &comp) < 1e-6, "forward");
        let gf = (fused * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = (comp * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_abs(
            gf.get(x.as_tensor()).unwrap(),
            gc.get(x.as_tensor()).unwrap(),
        );
        assert!(d < 1e-5, "backward {d}");
    }

    #[test]
    fn empty_inputs_and_columns_give_zeros_of_the_right_shape() {
        for (n_in, r) in [(0, 2), (3, 2), (3, 1)] {
            let w = Arc::new(SparseColumns::new(n_in, vec![0; 4], vec![], vec![]).unwrap());
            let x = Var::from_tensor(&Tensor::ones((r, n_in), DType::F32, &Device::Cpu).unwrap())
                .unwrap();
            let y = sparse_matmul(x.as_tensor(), &w).unwrap();
            assert_eq!(y.dims(), [r, 3]);
            assert_eq!(y.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
            let g = y.sum_all().unwrap().backward().unwrap();
            assert_eq!(g.get(x.as_tensor()).unwrap().dims(), [r, n_in]);
        }
    }

    #[test]
    fn malformed_plans_and_shapes_are_refused() {
        let bad = [
            SparseColumns::new(3, vec![0, 2], vec![0], vec![1.0]), // offsets past the entries
            SparseColumns::new(3, vec![1, 1], vec![0], vec![1.0]), // not from 0
            SparseColumns::new(3, vec![0, 2, 1], vec![0, 1], vec![1.0, 1.0]), // falling
            SparseColumns::new(3, vec![0, 1], vec![3], vec![1.0]), // row past n_in
            SparseColumns::new(3, vec![0, 1], vec![0], vec![]),    // a row without weight
        ];
        for b in bad {
            assert!(b.is_err(), "{b:?}");
        }
        let w = Arc::new(SparseColumns::new(3, vec![0, 1], vec![2], vec![1.0]).unwrap());
        let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let e = sparse_matmul(&x, &w).unwrap_err().to_string();
        assert!(e.contains("4 columns"), "{e}");
    }
}
