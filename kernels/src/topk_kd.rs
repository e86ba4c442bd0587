//! Each row's same-tokenizer distillation divergence over the teacher's top-k set K, fused over
//! the row's logits, with a fused backward: the loss reads the `[rows, V]` logits once forward
//! and once backward and writes only their gradient, instead of a `[rows, V]` f32 copy, its
//! log-softmax, a gather and their backwards (llm.c's fused classifier, for top-k targets).
//! The next-token cross-entropy is its k = 1 case ([`TopkKd::cross_entropy`]).
//!
//! On CUDA it runs `kernels/cuda/src/topk_kd.cu`; on the CPU an f64 reference of the same
//! definitions, which the trainer's tests hold against its composed losses (`loss::kl`) and the
//! GPU tests hold the kernel against. The formulas (every divergence and tail mode) are in
//! topk_kd.cu's header and docs/losses.md.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use xdistill_shared::model::device_ops::{dense, storage};

/// The divergence between the teacher's and the student's distributions over K (+ tail).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KdDivergence {
    Forward,
    Reverse,
    /// Generalized JSD(β), 0 < β < 1 (β = 0 is forward KL, β = 1 reverse KL: pass those).
    Jsd(f64),
    TotalVariation,
}

/// The mass outside K.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdTail {
    /// Both sides renormalised over K.
    Renormalize,
    /// One more entry `log(1 − Σ_K p)` on both sides, `1 − Σ_K p` floored.
    Bucket,
    /// Teacher values as given, the student's full-vocabulary log-probs at K.
    Ignore,
}

/// One loss: what [`topk_kd`] computes per row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopkKd {
    pub divergence: KdDivergence,
    pub tail: KdTail,
    /// τ: the student's logits are divided by it (the teacher's log-probs come at τ already).
    pub temperature: f64,
    /// The smallest `1 − Σ_K p` the bucket keeps (below, no gradient flows through the tail).
    pub tail_floor: f64,
}

impl TopkKd {
    /// The cross-entropy `lse(z) − z_y` as a k = 1 loss: teacher log-prob 0 at the target.
    pub fn cross_entropy() -> TopkKd {
        TopkKd {
            divergence: KdDivergence::Forward,
            tail: KdTail::Ignore,
            temperature: 1.0,
            tail_floor: 0.0,
        }
    }

    /// The fused op runs for these logits where the other fused ops do
    /// ([`xdistill_shared::model::device_ops::applies`]): a CUDA device with the project's
    /// kernels on, in f32, bf16 or f16 (elsewhere the composed losses run), or wherever a test
    /// forces them in its thread (on the CPU, the f64 reference).
    pub fn runs_on(logits: &Tensor) -> bool {
        xdistill_shared::model::device_ops::applies(logits)
    }
}

/// Per row of `logits` `[rows, V]`, with the teacher's `ids` `[rows, k]` (u32, distinct within
/// a row, below V) and log-probs `lts` `[rows, k]` (floored, ≤ 0): `[rows, 4]` in the loss's
/// dtype (f64 for f64 logits, else f32) = [divergence, teacher mass on K, student mass on K,
/// logsumexp of z/τ]. Only the first column has a gradient (the logits').
pub fn topk_kd(logits: &Tensor, ids: &Tensor, lts: &Tensor, loss: TopkKd) -> Result<Tensor> {
    let (rows, _v) = logits.dims2()?;
    let (r2, k) = ids.dims2()?;
    if r2 != rows || lts.dims() != [rows, k] || k == 0 {
        bail!(
            "topk_kd: ids {:?} and log-probs {:?} for logits {:?}",
            ids.dims(),
            lts.dims(),
            logits.dims()
        );
    }
    if ids.dtype() != DType::U32 {
        bail!("topk_kd: ids must be u32");
    }
    if !(loss.temperature > 0.0 && loss.temperature.is_finite()) {
        bail!("topk_kd: temperature {} is not positive", loss.temperature);
    }
    if let KdDivergence::Jsd(b) = loss.divergence {
        if !(b > 0.0 && b < 1.0) {
            bail!("topk_kd: JSD's beta {b} must be in (0, 1)");
        }
    }
    let acc = if logits.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let op = Op {
        ids: ids.contiguous()?,
        lts: lts.to_dtype(acc)?.contiguous()?,
        loss,
    };
    logits.contiguous()?.apply_op1(op)
}

/// The op and its backward share the teacher's side.
#[derive(Clone)]
struct Op {
    ids: Tensor,
    lts: Tensor,
    loss: TopkKd,
}

/// One row's k-way sums, as the kernel's `RowSums` (f64).
#[derive(Debug, Default, Clone, Copy)]
struct Row {
    lse: f64,
    lse_t: f64,
    lse_s: f64,
    tail_live: bool,
    d: f64,
    a_tail: f64,
    sum_w: f64,
}

fn logsumexp(x: impl Iterator<Item = f64> + Clone) -> f64 {
    let m = x.clone().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + x.map(|v| (v - m).exp()).sum::<f64>().ln()
}

impl TopkKd {
    /// `log(1 − e^x)` with `1 − e^x` floored, and whether the floor let the gradient through.
    fn tail_of(&self, x: f64) -> (f64, bool) {
        let x_max = (-self.tail_floor).ln_1p();
        let live = x < x_max;
        let y = if live { x } else { x_max };
        let v = if y < -std::f64::consts::LN_2 {
            (-y.exp()).ln_1p()
        } else {
            (-y.exp_m1()).ln()
        };
        (v, live)
    }

    /// One entry's term and its derivative in s.
    fn term(&self, t: f64, s: f64) -> (f64, f64) {
        let (et, es) = (t.exp(), s.exp());
        match self.divergence {
            KdDivergence::Forward => (et * (t - s), -et),
            KdDivergence::Reverse => (es * (s - t), es * (s - t + 1.0)),
            KdDivergence::Jsd(beta) => {
                let m = logsumexp([t + beta.ln(), s + (1.0 - beta).ln()].into_iter());
                (
                    beta * et * (t - m) + (1.0 - beta) * es * (s - m),
                    (1.0 - beta) * es * (s - m),
                )
            }
            KdDivergence::TotalVariation => {
                let diff = et - es;
                (
                    0.5 * diff.abs(),
                    if diff >= 0.0 { -0.5 * es } else { 0.5 * es },
                )
            }
        }
    }

    fn t_of(&self, r: &Row, lt: f64) -> f64 {
        if self.tail == KdTail::Renormalize {
            lt - r.lse_t
        } else {
            lt
        }
    }

    fn s_of(&self, r: &Row, u: f64) -> f64 {
        if self.tail == KdTail::Renormalize {
            u - r.lse_s
        } else {
            u
        }
    }

    fn w_of(&self, r: &Row, u: f64, a: f64) -> f64 {
        if self.tail == KdTail::Bucket && r.tail_live {
            a - r.a_tail * u.exp() / -r.lse_s.exp_m1()
        } else {
            a
        }
    }

    /// A row's sums from its logits `z`, teacher `ids` and log-probs `lt`.
    fn row(&self, z: &[f64], ids: &[u32], lt: &[f64]) -> Row {
        let inv_t = 1.0 / self.temperature;
        let lse = logsumexp(z.iter().map(|x| x * inv_t));
        let u = |j: usize| z[ids[j] as usize] * inv_t - lse;
        let mut r = Row {
            lse,
            lse_t: logsumexp(lt.iter().copied()),
            lse_s: logsumexp((0..ids.len()).map(u)),
            ..Row::default()
        };
        if self.tail == KdTail::Bucket {
            let (tail_t, _) = self.tail_of(r.lse_t);
            let (tail_s, live) = self.tail_of(r.lse_s);
            r.tail_live = live;
            (r.d, r.a_tail) = self.term(tail_t, tail_s);
        }
        let (mut sum_a, mut sum_w) = (0.0, 0.0);
        for (j, &lt_j) in lt.iter().enumerate() {
            let (d, a) = self.term(self.t_of(&r, lt_j), self.s_of(&r, u(j)));
            r.d += d;
            sum_a += a;
            sum_w += self.w_of(&r, u(j), a);
        }
        r.sum_w = if self.tail == KdTail::Renormalize {
            sum_a
        } else {
            sum_w
        };
        r
    }

    #[cfg(feature = "cuda")]
    fn args(&self, rows: usize, vocab: usize, k: usize) -> xdistill_cuda_kernels::TopkKdArgs {
        let (div, beta) = match self.divergence {
            KdDivergence::Forward => (0, 0.0),
            KdDivergence::Reverse => (1, 0.0),
            KdDivergence::Jsd(b) => (2, b as f32),
            KdDivergence::TotalVariation => (3, 0.0),
        };
        xdistill_cuda_kernels::TopkKdArgs {
            rows,
            vocab,
            k,
            div,
            tail: match self.tail {
                KdTail::Renormalize => 0,
                KdTail::Bucket => 1,
                KdTail::Ignore => 2,
            },
            beta,
            inv_tau: (1.0 / self.temperature) as f32,
            tail_floor: self.tail_floor as f32,
        }
    }
}

/// Host values of a tensor the op carries (ids or teacher log-probs).
fn carried_f64(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

fn carried_ids(t: &Tensor) -> Result<Vec<u32>> {
    t.flatten_all()?.to_vec1::<u32>()
}

impl CustomOp1 for Op {
    fn name(&self) -> &'static str {
        "xdistill-topk-kd"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, v) = l.shape().dims2()?;
        let k = self.ids.dim(1)?;
        let z = dense(s, l)?;
        let (ids, lt) = (carried_ids(&self.ids)?, carried_f64(&self.lts)?);
        if ids.iter().any(|&i| i as usize >= v) {
            bail!("topk_kd: an id is not below the vocabulary {v}");
        }
        let mut out = Vec::with_capacity(rows * 4);
        for r in 0..rows {
            let row = self.loss.row(
                &z[r * v..(r + 1) * v],
                &ids[r * k..(r + 1) * k],
                &lt[r * k..(r + 1) * k],
            );
            out.extend([row.d, row.lse_t.exp(), row.lse_s.exp(), row.lse]);
        }
        let dt = if s.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        Ok((storage(out, dt)?, Shape::from_dims(&[rows, 4])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::Storage;
        let (rows, v) = l.shape().dims2()?;
        let k = self.ids.dim(1)?;
        let (is, il) = self.ids.storage_and_layout();
        let (ls, ll) = self.lts.storage_and_layout();
        let (Storage::Cuda(is), Storage::Cuda(ls)) = (&*is, &*ls) else {
            bail!("topk_kd: the teacher's ids and log-probs must be on the logits' device");
        };
        let out = xdistill_cuda_kernels::topk_kd_fwd(
            (s, l),
            (is, il),
            (ls, ll),
            self.loss.args(rows, v, k),
        )?;
        Ok((out, Shape::from_dims(&[rows, 4])))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.to_dtype(res.dtype())?.contiguous()?;
        Ok(Some(arg.apply_op3_no_bwd(res, &g, &Bwd(self.clone()))?))
    }
}

/// `(z, res, g)` → the logits' gradient from the first column of `g`.
struct Bwd(Op);

impl CustomOp3 for Bwd {
    fn name(&self) -> &'static str {
        "xdistill-topk-kd-bwd"
    }

    fn cpu_fwd(
        &self,
        zs: &CpuStorage,
        zl: &Layout,
        _res: &CpuStorage,
        _rl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let loss = &self.0.loss;
        let (rows, v) = zl.shape().dims2()?;
        let k = self.0.ids.dim(1)?;
        let z = dense(zs, zl)?;
        let g = dense(gs, gl)?;
        let (ids, lt) = (carried_ids(&self.0.ids)?, carried_f64(&self.0.lts)?);
        let inv_t = 1.0 / loss.temperature;
        let mut dz = vec![0.0; rows * v];
        for r in 0..rows {
            let (zr, idr, ltr) = (
                &z[r * v..(r + 1) * v],
                &ids[r * k..(r + 1) * k],
                &lt[r * k..(r + 1) * k],
            );
            let row = loss.row(zr, idr, ltr);
            let c = g[r * 4] * inv_t;
            let out = &mut dz[r * v..(r + 1) * v];
            if loss.tail != KdTail::Renormalize {
                for (o, &x) in out.iter_mut().zip(zr) {
                    *o = -c * (x * inv_t - row.lse).exp() * row.sum_w;
                }
            }
            for j in 0..k {
                let u = zr[idr[j] as usize] * inv_t - row.lse;
                let s = loss.s_of(&row, u);
                let (_, a) = loss.term(loss.t_of(&row, ltr[j]), s);
                out[idr[j] as usize] = if loss.tail == KdTail::Renormalize {
                    c * (a - s.exp() * row.sum_w)
                } else {
                    c * (loss.w_of(&row, u, a) - u.exp() * row.sum_w)
                };
            }
        }
        Ok((storage(dz, zs.dtype())?, zl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        zs: &candle_core::CudaStorage,
        zl: &Layout,
        rs: &candle_core::CudaStorage,
        rl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::Storage;
        let (rows, v) = zl.shape().dims2()?;
        let k = self.0.ids.dim(1)?;
        let (is, il) = self.0.ids.storage_and_layout();
        let (ls, ll) = self.0.lts.storage_and_layout();
        let (Storage::Cuda(is), Storage::Cuda(ls)) = (&*is, &*ls) else {
            bail!("topk_kd: the teacher's ids and log-probs must be on the logits' device");
        };
        let dz = xdistill_cuda_kernels::topk_kd_bwd(
            (zs, zl),
            (is, il),
            (ls, ll),
            (rs, rl),
            (gs, gl),
            self.0.loss.args(rows, v, k),
        )?;
        Ok((dz, zl.shape().clone()))
    }
}
