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
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp3, DType, InplaceOp3, Layout, Result, Shape, Tensor,
};
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
    let op = Op::new(logits, ids, lts, None, loss)?;
    logits.contiguous()?.apply_op1(op)
}

/// A head chunk's loss run without autograd, where the caller knows each row's gradient before
/// the loss (a fixed weight per row): the same tokenizer's top-k divergence and, beside it,
/// the next-token cross-entropy at τ = 1, from one pass over the logits ([`TopkKdTrain::figures`])
/// and one that writes the gradient over them ([`TopkKdTrain::grad_into_logits`]). Against the
/// two losses through autograd (each its own kernels, each gradient its own `[rows, V]` buffer,
/// and candle's fill and add of `[rows, V]` at every node that reaches the logits), the logits
/// are read twice and written once: llm.c's fused classifier.
pub struct TopkKdTrain(Op);

/// The most teacher entries per row [`TopkKdTrain`] takes: the kernel stages the gradient at K
/// before it writes over the logits.
pub const TRAIN_MAX_K: usize = 4096;

impl TopkKdTrain {
    /// For `logits` `[rows, V]`: the teacher's `ids` and `lts` as [`topk_kd()`] takes them and
    /// each row's next token `ce` `[rows]` (u32, below V) where the cross-entropy is wanted.
    pub fn new(
        logits: &Tensor,
        ids: &Tensor,
        lts: &Tensor,
        ce: Option<&Tensor>,
        loss: TopkKd,
    ) -> Result<TopkKdTrain> {
        if ids.dim(1)? > TRAIN_MAX_K {
            bail!(
                "topk_kd: k = {} is above the {TRAIN_MAX_K} a gradient written over the logits takes",
                ids.dim(1)?
            );
        }
        Ok(TopkKdTrain(Op::new(logits, ids, lts, ce, loss)?))
    }

    /// `[rows, 4]` as [`topk_kd()`]'s, or with the cross-entropy `[rows, 6]`: then also
    /// `lse₁ − z_y` (the cross-entropy) and `lse₁` (the logsumexp at τ = 1). No gradient.
    pub fn figures(&self, logits: &Tensor) -> Result<Tensor> {
        logits.contiguous()?.apply_op1_no_bwd(&self.0)
    }

    /// Writes over `logits` (contiguous, as given to [`TopkKdTrain::figures`]) the gradient of
    /// `Σ_r g[r, 0]·D_r + g[r, 1]·CE_r`, from their `figures`; `g` `[rows, 2]` (the second
    /// column is read only with the cross-entropy).
    pub fn grad_into_logits(&self, logits: &Tensor, figures: &Tensor, g: &Tensor) -> Result<()> {
        let rows = logits.dim(0)?;
        if !logits.is_contiguous() || g.dims() != [rows, 2] {
            bail!(
                "topk_kd: the gradient of {:?} logits (contiguous: {}) from {:?} row gradients",
                logits.dims(),
                logits.is_contiguous(),
                g.dims()
            );
        }
        let g = g.to_dtype(figures.dtype())?.contiguous()?;
        logits.inplace_op3(&figures.contiguous()?, &g, &IntoLogits(self.0.clone()))
    }
}

/// The op and its backward share the teacher's side (and the cross-entropy's targets).
#[derive(Clone)]
struct Op {
    ids: Tensor,
    lts: Tensor,
    ce: Option<Tensor>,
    loss: TopkKd,
}

impl Op {
    /// The checked op for `logits` `[rows, V]`.
    fn new(
        logits: &Tensor,
        ids: &Tensor,
        lts: &Tensor,
        ce: Option<&Tensor>,
        loss: TopkKd,
    ) -> Result<Op> {
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
        if let Some(y) = ce {
            if y.dims() != [rows] || y.dtype() != DType::U32 {
                bail!(
                    "topk_kd: cross-entropy targets {:?} {:?} for {rows} rows (u32 [rows])",
                    y.dims(),
                    y.dtype()
                );
            }
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
        Ok(Op {
            ids: ids.contiguous()?,
            lts: lts.to_dtype(acc)?.contiguous()?,
            ce: ce.map(Tensor::contiguous).transpose()?,
            loss,
        })
    }

    /// Output columns: 4, or 6 with the cross-entropy.
    fn cols(&self) -> usize {
        if self.ce.is_some() {
            6
        } else {
            4
        }
    }

    /// The forward's rows on the host (f64) from the logits `z` `[rows, V]`.
    fn forward_rows(&self, z: &[f64], rows: usize, v: usize) -> Result<Vec<f64>> {
        let k = self.ids.dim(1)?;
        let Carried { ids, lts: lt, ce } = self.carried(v)?;
        let mut out = Vec::with_capacity(rows * self.cols());
        for r in 0..rows {
            let zr = &z[r * v..(r + 1) * v];
            let row = self
                .loss
                .row(zr, &ids[r * k..(r + 1) * k], &lt[r * k..(r + 1) * k]);
            out.extend([row.d, row.lse_t.exp(), row.lse_s.exp(), row.lse]);
            if let Some(y) = &ce {
                let lse1 = logsumexp(zr.iter().copied());
                out.extend([lse1 - zr[y[r] as usize], lse1]);
            }
        }
        Ok(out)
    }

    /// The logits' gradient on the host (f64) from `g` `[rows, stride]`: the divergence's at
    /// column 0, the cross-entropy's at column `ce_col`.
    fn grad_rows(
        &self,
        z: &[f64],
        (rows, v): (usize, usize),
        g: &[f64],
        (stride, ce_col): (usize, usize),
    ) -> Result<Vec<f64>> {
        let loss = &self.loss;
        let k = self.ids.dim(1)?;
        let Carried { ids, lts: lt, ce } = self.carried(v)?;
        let inv_t = 1.0 / loss.temperature;
        let mut dz = vec![0.0; rows * v];
        for r in 0..rows {
            let (zr, idr, ltr) = (
                &z[r * v..(r + 1) * v],
                &ids[r * k..(r + 1) * k],
                &lt[r * k..(r + 1) * k],
            );
            let row = loss.row(zr, idr, ltr);
            let c = g[r * stride] * inv_t;
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
            if let Some(y) = &ce {
                // g_ce·(softmax(z)_v − [v = y]).
                let g_ce = g[r * stride + ce_col];
                let lse1 = logsumexp(zr.iter().copied());
                for (o, &x) in out.iter_mut().zip(zr) {
                    *o += g_ce * (x - lse1).exp();
                }
                out[y[r] as usize] -= g_ce;
            }
        }
        Ok(dz)
    }

    /// The carried ids, teacher log-probs and cross-entropy targets on the host, checked
    /// against the vocabulary `v`.
    fn carried(&self, v: usize) -> Result<Carried> {
        let ids = carried_ids(&self.ids)?;
        let ce = self.ce.as_ref().map(carried_ids).transpose()?;
        if ids
            .iter()
            .chain(ce.iter().flatten())
            .any(|&i| i as usize >= v)
        {
            bail!("topk_kd: an id is not below the vocabulary {v}");
        }
        Ok(Carried {
            ids,
            lts: carried_f64(&self.lts)?,
            ce,
        })
    }

    /// The kernels' view of the teacher's side (on the logits' CUDA device).
    #[cfg(feature = "cuda")]
    fn on_device<R>(
        &self,
        rows: usize,
        v: usize,
        run: impl FnOnce(
            xdistill_cuda_kernels::TopkKdTargets<'_>,
            xdistill_cuda_kernels::TopkKdArgs,
        ) -> Result<R>,
    ) -> Result<R> {
        use candle_core::Storage;
        let k = self.ids.dim(1)?;
        let (is, il) = self.ids.storage_and_layout();
        let (ls, ll) = self.lts.storage_and_layout();
        let (Storage::Cuda(is), Storage::Cuda(ls)) = (&*is, &*ls) else {
            bail!("topk_kd: the teacher's ids and log-probs must be on the logits' device");
        };
        let ce = self.ce.as_ref().map(|t| t.storage_and_layout());
        let ce = match &ce {
            Some((s, l)) => match &**s {
                Storage::Cuda(s) => Some((s, *l)),
                _ => bail!("topk_kd: the cross-entropy's targets must be on the logits' device"),
            },
            None => None,
        };
        let targets = xdistill_cuda_kernels::TopkKdTargets {
            ids: (is, il),
            lts: (ls, ll),
            ce,
        };
        run(targets, self.loss.args(rows, v, k))
    }
}

/// The op's teacher side on the host: ids, log-probs, and the cross-entropy's targets.
struct Carried {
    ids: Vec<u32>,
    lts: Vec<f64>,
    ce: Option<Vec<u32>>,
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
        let out = self.forward_rows(&dense(s, l)?, rows, v)?;
        let dt = if s.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        Ok((storage(out, dt)?, Shape::from_dims(&[rows, self.cols()])))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, v) = l.shape().dims2()?;
        let out = self.on_device(rows, v, |t, a| {
            xdistill_cuda_kernels::topk_kd_fwd((s, l), t, a)
        })?;
        Ok((out, Shape::from_dims(&[rows, self.cols()])))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = grad_res.to_dtype(res.dtype())?.contiguous()?;
        Ok(Some(arg.apply_op3_no_bwd(res, &g, &Bwd(self.clone()))?))
    }
}

/// `(z, res, g)` → the logits' gradient from `g` `[rows, cols]` (the divergence's column 0, the
/// cross-entropy's column 4).
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
        let dims = zl.shape().dims2()?;
        let grad = (self.0.cols(), 4);
        let dz = self
            .0
            .grad_rows(&dense(zs, zl)?, dims, &dense(gs, gl)?, grad)?;
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
        let (rows, v) = zl.shape().dims2()?;
        let g = xdistill_cuda_kernels::TopkKdGrad {
            g: (gs, gl),
            stride: self.0.cols(),
            ce_col: 4,
        };
        let dz = self.0.on_device(rows, v, |t, a| {
            xdistill_cuda_kernels::topk_kd_bwd((zs, zl), t, (rs, rl), g, a)
        })?;
        Ok((dz, zl.shape().clone()))
    }
}

/// `[TopkKdTrain::grad_into_logits]`'s op: the logits `z` overwritten by their gradient, from
/// the forward's `res` and `g` `[rows, 2]`.
struct IntoLogits(Op);

impl InplaceOp3 for IntoLogits {
    fn name(&self) -> &'static str {
        "xdistill-topk-kd-into-logits"
    }

    fn cpu_fwd(
        &self,
        zs: &mut CpuStorage,
        zl: &Layout,
        _res: &CpuStorage,
        _rl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<()> {
        let dims = zl.shape().dims2()?;
        let dz = self
            .0
            .grad_rows(&dense(zs, zl)?, dims, &dense(gs, gl)?, (2, 1))?;
        write_over(zs, zl, &dz)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        zs: &mut candle_core::CudaStorage,
        zl: &Layout,
        rs: &candle_core::CudaStorage,
        rl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let (rows, v) = zl.shape().dims2()?;
        let g = xdistill_cuda_kernels::TopkKdGrad {
            g: (gs, gl),
            stride: 2,
            ce_col: 1,
        };
        self.0.on_device(rows, v, |t, a| {
            xdistill_cuda_kernels::topk_kd_bwd_in_place(zs, zl, t, (rs, rl), g, a)
        })
    }
}

/// `vals` written over the contiguous values `l` covers of `s`, rounded to its dtype.
fn write_over(s: &mut CpuStorage, l: &Layout, vals: &[f64]) -> Result<()> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("topk_kd: a contiguous operand expected");
    };
    if b - a != vals.len() {
        bail!("topk_kd: {} values for {} places", vals.len(), b - a);
    }
    match s {
        CpuStorage::F64(x) => x[a..b].copy_from_slice(vals),
        CpuStorage::F32(x) => x[a..b]
            .iter_mut()
            .zip(vals)
            .for_each(|(o, &v)| *o = v as f32),
        CpuStorage::BF16(x) => x[a..b]
            .iter_mut()
            .zip(vals)
            .for_each(|(o, &v)| *o = half::bf16::from_f64(v)),
        CpuStorage::F16(x) => x[a..b]
            .iter_mut()
            .zip(vals)
            .for_each(|(o, &v)| *o = half::f16::from_f64(v)),
        other => bail!("topk_kd: logits of {:?}", other.dtype()),
    }
    Ok(())
}
