//! Two ops that keep candle's backward pass small. candle's `backward` gives every node of the
//! graph a gradient, each as `zeros + contribution` (a fill and an add per node, a strided add
//! where the node is a transposed view), and computes gradients for constant operands too; on a
//! GPU those small kernels, not the matmuls, led a training step's profile (an H200, 2026-11-29:
//! `badd_bf16`, 361 launches, 19.2 of 45.8 ms). So:
//! - [`seed`]: the gradients reached from outputs whose gradients are known (a layer's output,
//!   the attention core's q, k, v), without building `Σ out ∘ grad` to differentiate: one node
//!   per output whose backward hands its gradient on (the surrogate cost a mul, a sum and about
//!   eight kernels more in the backward per output, and a gradient for the constant `grad`);
//! - [`linear`]: `x · Wᵀ` as one node whose backward writes `dx = g · W` and `dW = gᵀ · x`
//!   directly (candle-nn's linear is a reshape, a transpose and a matmul: three more nodes, and
//!   `W`'s gradient arrives as a transposed view added to zeros element by element).

#[cfg(feature = "cuda")]
use candle_core::backend::BackendDevice;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// The gradients of `Σᵢ Σ outᵢ ∘ gradᵢ` (each `gradᵢ` detached, `outᵢ`'s shape): what the
/// graphs behind the `outᵢ` receive when `gradᵢ` arrives at `outᵢ`. Keyed as
/// `Tensor::backward`'s are.
pub fn seed(seeds: &[(&Tensor, &Tensor)]) -> Result<candle_core::backprop::GradStore> {
    let mut root: Option<Tensor> = None;
    for (out, grad) in seeds {
        if grad.dims() != out.dims() {
            candle_core::bail!(
                "gradient seed: gradient {:?} for an output {:?}",
                grad.dims(),
                out.dims()
            );
        }
        let grad = grad.detach().to_dtype(out.dtype())?;
        let r = out.apply_op1(Seed(grad))?;
        root = Some(match root {
            Some(sum) => (sum + r)?,
            None => r,
        });
    }
    match root {
        Some(r) => r.backward(),
        None => Ok(candle_core::backprop::GradStore::default()),
    }
}

/// A scalar zero whose backward hands its input the gradient it holds, whatever arrives.
struct Seed(Tensor);

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "gradient-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let zero = s
            .device()
            .zeros_impl(&Shape::from(()), candle_core::DType::F32)?;
        Ok((zero, Shape::from(())))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

/// `x [..., k] · wᵀ` with `w` `[o, k]` → `[..., o]`, one node in the graph (see the module).
/// The same matmuls as candle-nn's linear (cuBLAS or gemm, `w` read transposed in place).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (o, k) = w.dims2()?;
    if x.dim(candle_core::D::Minus1)? != k || x.dtype() != w.dtype() {
        candle_core::bail!(
            "linear: input {:?} {:?}, weight {:?} {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    if x.rank() == 0 || o == 0 || k == 0 {
        candle_core::bail!("linear: empty weight {:?} or scalar input", w.dims());
    }
    x.contiguous()?
        .apply_op2(&w.contiguous()?, Linear { sink: None })
}

/// `(x [..., k] contiguous, w [o, k])` → `x · wᵀ` `[..., o]`, computed on the rows `[m, k]`.
fn matmul_nt<S: BackendStorage>(x: &S, lx: &Layout, w: &S, lw: &Layout) -> Result<(S, Shape)> {
    let (o, k) = lw.shape().dims2()?;
    let m = lx.shape().elem_count() / k;
    let lhs = Layout::contiguous_with_offset((m, k), lx.start_offset());
    let rhs = lw.transpose(0, 1)?;
    let y = x.matmul(w, (1, m, o, k), &lhs, &rhs)?;
    let mut dims = lx.shape().dims().to_vec();
    *dims.last_mut().expect("rank ≥ 1") = o;
    Ok((y, Shape::from(dims)))
}

/// [`linear`]'s node (and [`linear_into`]'s, with a sink): its forward, and its backward by
/// two matmuls, or by one and the weight's gradient summed into the sink.
struct Linear {
    sink: Option<Tensor>,
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        matmul_nt(x, lx, w, lw)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        matmul_nt(x, lx, w, lw)
    }

    /// `grad` `[..., o]` as rows `[m, o]`: `dx = grad · w` `[m, k]` (reshaped as `x`),
    /// `dw = gradᵀ · x` `[o, k]`, both contiguous; with a sink, `sink += gradᵀ · x` and no
    /// gradient for `w`.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w) = (x.detach(), w.detach());
        let Some(sink) = &self.sink else {
            let (dx, dw) = linear_backward(&x, &w, grad)?;
            return Ok((Some(dx), Some(dw)));
        };
        Ok((Some(linear_backward_into(&x, &w, sink, grad)?), None))
    }
}

/// `x · wᵀ` as [`linear`] computes it, recorded nowhere (for a backward written by hand,
/// [`linear_backward_into`]).
pub fn linear_untracked(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.detach()
        .contiguous()?
        .apply_op2_no_bwd(&w.detach().contiguous()?, &Linear { sink: None })
}

/// The backward of `x · wᵀ` with the weight's gradient summed into `sink`, as [`linear_into`]'s
/// node runs it: `sink += gradᵀ · x` in place, and `dx = grad · w` returned (`x`'s shape).
pub fn linear_backward_into(
    x: &Tensor,
    w: &Tensor,
    sink: &Tensor,
    grad: &Tensor,
) -> Result<Tensor> {
    let g = grad.contiguous()?.reshape(((), w.dim(0)?))?;
    accumulate_tn(sink, &g, &x.reshape(((), w.dim(1)?))?)?;
    g.matmul(w)?.reshape(x.shape())
}

/// `x [..., k] · wᵀ` like [`linear`], but with `w` `[o, k]` a constant of the node and its
/// gradient summed into `sink` (f32 `[o, k]`, or f64 for f64 operands) by the backward, in
/// place ([`accumulate_tn`]), instead of returned: a weight whose gradient is summed over row
/// chunks (the LM head's) is accumulated in place, never written as a `[o, k]` product of its
/// own, filled into zeros and added. Only `x` gets a gradient through the graph.
pub fn linear_into(x: &Tensor, w: &Tensor, sink: &Tensor) -> Result<Tensor> {
    let (o, k) = w.dims2()?;
    if x.dim(candle_core::D::Minus1)? != k || x.dtype() != w.dtype() || sink.dims() != [o, k] {
        candle_core::bail!(
            "linear into a sink: input {:?} {:?}, weight {:?} {:?}, sink {:?}",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype(),
            sink.dims()
        );
    }
    let op = Linear {
        sink: Some(sink.clone()),
    };
    x.contiguous()?.apply_op2(&w.detach().contiguous()?, op)
}

/// `acc` `[o, k]` `+= gᵀ · x` in place, for `g` `[m, o]` and `x` `[m, k]` of one dtype: on
/// CUDA one cuBLAS GEMM into an f32 `acc` (`xdistill_cuda_kernels::gemm_acc_f32`), on the CPU
/// the reference, summed in f64 and rounded once into `acc` (f32 or f64).
pub fn accumulate_tn(acc: &Tensor, g: &Tensor, x: &Tensor) -> Result<()> {
    let ((m, o), (m2, k)) = (g.dims2()?, x.dims2()?);
    if m != m2 || acc.dims() != [o, k] || g.dtype() != x.dtype() || !acc.is_contiguous() {
        candle_core::bail!(
            "accumulate: {:?} += {:?}ᵀ · {:?} ({:?}, {:?})",
            acc.dims(),
            g.dims(),
            x.dims(),
            g.dtype(),
            x.dtype()
        );
    }
    acc.inplace_op3(&g.contiguous()?, &x.contiguous()?, &AccumulateTn)
}

/// [`accumulate_tn`]'s in-place op.
struct AccumulateTn;

impl candle_core::InplaceOp3 for AccumulateTn {
    fn name(&self) -> &'static str {
        "accumulate-tn"
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        la: &Layout,
        g: &CpuStorage,
        lg: &Layout,
        x: &CpuStorage,
        lx: &Layout,
    ) -> Result<()> {
        let (m, o) = lg.shape().dims2()?;
        let k = lx.shape().dims2()?.1;
        let (g, x) = (
            super::device_ops::dense(g, lg)?,
            super::device_ops::dense(x, lx)?,
        );
        let mut sum = vec![0.0f64; o * k];
        for r in 0..m {
            for (i, &gv) in g[r * o..(r + 1) * o].iter().enumerate() {
                for (s, &xv) in sum[i * k..(i + 1) * k]
                    .iter_mut()
                    .zip(&x[r * k..(r + 1) * k])
                {
                    *s += gv * xv;
                }
            }
        }
        let at = la.start_offset();
        match acc {
            CpuStorage::F32(a) => {
                for (a, s) in a[at..at + o * k].iter_mut().zip(&sum) {
                    *a = (*a as f64 + s) as f32;
                }
            }
            CpuStorage::F64(a) => {
                for (a, s) in a[at..at + o * k].iter_mut().zip(&sum) {
                    *a += s;
                }
            }
            _ => candle_core::bail!("accumulate: the accumulator must be f32 or f64"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        la: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> Result<()> {
        let (m, o) = lg.shape().dims2()?;
        let k = lx.shape().dims2()?.1;
        let args = xdistill_cuda_kernels::GemmAccArgs { m, o, k };
        xdistill_cuda_kernels::gemm_acc_f32(acc, la, (g, lg), (x, lx), args)
    }
}

/// [`linear`]'s backward: `grad` `[..., o]` as rows `[m, o]` gives `dx = grad · w` (shaped as
/// `x`, contiguous) and `dw = gradᵀ · x` `[o, k]`. Untracked where `x` and `w` are.
pub(crate) fn linear_backward(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let k = w.dim(1)?;
    let x2 = x.contiguous()?.reshape(((), k))?;
    let g = grad.contiguous()?.reshape(((), w.dim(0)?))?;
    let dx = g.matmul(w)?.reshape(x.shape())?;
    let dw = g.t()?.matmul(&x2)?;
    Ok((dx, dw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_tensors::{data, values as host, worst};
    use candle_core::{DType, Device, Var};

    fn noise(seed: u64, shape: &[usize]) -> Tensor {
        data(seed, shape, 1.0)
    }

    fn close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
        let w = worst(a, b);
        assert!(w <= tol, "{what}: off by {w:e} (relative to the largest)");
    }

    /// [`linear`] against candle's `x · wᵀ` through autograd, in f64: values and the gradients
    /// of input and weight, for rows, `[B, T, k]`, a transposed (non-contiguous) input, and a
    /// weight read through a cast (the trainer's bf16 copies), where the gradient reaches
    /// the master; and f32, whose matmuls may sum in another order.
    #[test]
    fn linear_gives_candles_values_and_gradients() {
        for (case, x_shape, transposed) in [
            ("rows", vec![7usize, 5], false),
            ("batch", vec![2, 3, 5], false),
            ("transposed input", vec![2, 5, 3], true),
        ] {
            for dt in [DType::F64, DType::F32] {
                let x = Var::from_tensor(&noise(1, &x_shape).to_dtype(dt).unwrap()).unwrap();
                let w = Var::from_tensor(&noise(2, &[4, 5]).to_dtype(dt).unwrap()).unwrap();
                let xin = if transposed {
                    x.as_tensor().transpose(1, 2).unwrap()
                } else {
                    x.as_tensor().clone()
                };
                let mut out_shape = xin.dims().to_vec();
                *out_shape.last_mut().unwrap() = 4;
                let r = noise(3, &out_shape).to_dtype(dt).unwrap();
                let ours = linear(&xin, w.as_tensor()).unwrap();
                let theirs = xin.broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap();
                let tol = if dt == DType::F64 { 1e-14 } else { 1e-6 };
                let what = format!("{case} {dt:?}");
                close(&ours, &theirs, tol, &format!("{what}: values"));
                let g1 = (&ours * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&theirs * &r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                for (v, name) in [(&x, "input"), (&w, "weight")] {
                    let (a, b) = (g1.get(v.as_tensor()), g2.get(v.as_tensor()));
                    close(
                        a.unwrap(),
                        b.unwrap(),
                        tol,
                        &format!("{what}: {name} gradient"),
                    );
                }
            }
        }
        // Through a cast: the gradient reaches the f64 master.
        let master = Var::from_tensor(&noise(4, &[4, 5])).unwrap();
        let x = noise(5, &[6, 5]).to_dtype(DType::F32).unwrap();
        let w = master.as_tensor().to_dtype(DType::F32).unwrap();
        let g = linear(&x, &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let got = g.get(master.as_tensor()).expect("the master's gradient");
        // d(Σ x·wᵀ)/dw[o, k] = Σ_rows x[row, k].
        let want = x.sum_keepdim(0).unwrap().broadcast_as((4, 5)).unwrap();
        close(
            got,
            &want.to_dtype(DType::F64).unwrap(),
            1e-6,
            "through a cast",
        );
        // Bad shapes are errors.
        assert!(linear(&noise(6, &[3, 4]), &noise(7, &[4, 5])).is_err());
    }

    /// [`linear_into`] gives [`linear`]'s values and input gradient, and sums the weight's
    /// gradient into its sink over two backward passes (f64, to rounding; an f32 sink of f32
    /// operands to f32's); a sink of the wrong shape is an error.
    #[test]
    fn linear_into_sums_the_weight_gradient_in_its_sink() {
        for (dt, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-6)] {
            let w = Var::from_tensor(&noise(2, &[4, 5]).to_dtype(dt).unwrap()).unwrap();
            let sink = Tensor::zeros((4, 5), dt, &Device::Cpu).unwrap();
            let mut want_dw: Option<Tensor> = None;
            for seed in [10, 20] {
                let x = Var::from_tensor(&noise(seed, &[2, 3, 5]).to_dtype(dt).unwrap()).unwrap();
                let r = noise(seed + 1, &[2, 3, 4]).to_dtype(dt).unwrap();
                let ours = linear_into(x.as_tensor(), w.as_tensor(), &sink).unwrap();
                let theirs = linear(x.as_tensor(), w.as_tensor()).unwrap();
                close(&ours, &theirs, tol, "values");
                let g1 = (&ours * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&theirs * &r)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                assert!(
                    g1.get(w.as_tensor()).is_none(),
                    "the weight's gradient is the sink's"
                );
                let (a, b) = (g1.get(x.as_tensor()), g2.get(x.as_tensor()));
                close(a.unwrap(), b.unwrap(), tol, "input gradient");
                let dw = g2.get(w.as_tensor()).unwrap().clone();
                want_dw = Some(match want_dw {
                    Some(s) => (s + dw).unwrap(),
                    None => dw,
                });
            }
            close(
                &sink,
                want_dw.as_ref().unwrap(),
                tol,
                &format!("{dt:?} sink"),
            );
        }
        let x = noise(1, &[3, 5]);
        assert!(linear_into(&x, &noise(2, &[4, 5]), &noise(3, &[5, 4])).is_err());
    }

    /// [`seed`] gives what differentiating `Σᵢ Σ outᵢ ∘ gradᵢ` gives (f64, exact): several outputs
    /// of one graph sharing a leaf, and an output that is itself a leaf; a gradient of the
    /// wrong shape is an error.
    #[test]
    fn seed_gives_the_surrogates_gradients() {
        let a = Var::from_tensor(&noise(1, &[3, 4])).unwrap();
        let b = Var::from_tensor(&noise(2, &[4, 2])).unwrap();
        let h = a.as_tensor().matmul(b.as_tensor()).unwrap();
        let outs = [h.tanh().unwrap(), (&h * 3.0).unwrap().exp().unwrap()];
        let grads = [noise(3, &[3, 2]), noise(4, &[3, 2])];
        let bg = noise(5, &[4, 2]);
        let seeds = [
            (&outs[0], &grads[0]),
            (&outs[1], &grads[1]),
            (b.as_tensor(), &bg),
        ];
        let got = seed(&seeds).unwrap();
        let mut surrogate = Tensor::new(0f64, &Device::Cpu).unwrap();
        for (o, g) in seeds {
            surrogate = (surrogate + (o * g).unwrap().sum_all().unwrap()).unwrap();
        }
        let want = surrogate.backward().unwrap();
        for (v, name) in [(&a, "a"), (&b, "b")] {
            let (x, y) = (
                host(got.get(v.as_tensor()).unwrap()),
                host(want.get(v.as_tensor()).unwrap()),
            );
            for (p, q) in x.iter().zip(&y) {
                assert!(
                    (p - q).abs() <= 1e-14 * q.abs().max(1.0),
                    "{name}: {p} vs {q}"
                );
            }
        }
        assert!(seed(&[(&outs[0], &bg)]).is_err());
        assert!(seed(&[]).unwrap().get_ids().next().is_none());
    }
}
