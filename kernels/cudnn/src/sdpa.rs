//! The Rust side of the shim: a [`candle_core::CustomOp3`] over q, k, v that describes their
//! layouts to cuDNN (strides, so no transposes) and runs the cached graph on candle's stream;
//! and for training, the forward with its softmax statistics ([`sdpa_train`]) and the backward
//! ([`sdpa_backward`]), which a training pass calls by hand as it does its blockwise attention's.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};
use std::ffi::{c_char, c_void};
use std::sync::{Arc, OnceLock};

/// Which keys each query sees, besides the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Causal {
    /// Every key.
    None,
    /// Query `i` sees keys `j <= i` (queries and keys start together: `Sq == Skv`).
    TopLeft,
    /// The queries are the last `Sq` positions of the keys (a KV cache): query `i` sees keys
    /// `j <= Skv - Sq + i`.
    BottomRight,
}

/// What an attention call computes besides its inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Multiplies q·k (`head_dim^-1/2` for most models).
    pub scale: f32,
    pub causal: Causal,
    /// A key further back than this many positions (counting the query's own) is masked.
    pub window: Option<usize>,
}

/// Mirrors `XdSdpaDesc` in sdpa.cpp; every field is part of its graph cache's key (184 bytes,
/// no implicit padding).
#[repr(C)]
#[derive(Clone, Copy)]
struct Desc {
    context: u64,
    dtype: i32,
    b: i32,
    hq: i32,
    hkv: i32,
    sq: i32,
    skv: i32,
    d: i32,
    /// 0: the forward graph; 1: the backward graph (`o_stride` is also `do`'s).
    backward: i32,
    q_stride: [i64; 4],
    k_stride: [i64; 4],
    v_stride: [i64; 4],
    o_stride: [i64; 4],
    scale: f32,
    causal: i32,
    window: i32,
    stats: i32,
}

extern "C" {
    fn xd_cudnn_load(err: *mut c_char, n: usize) -> i64;
    fn xd_sdpa_prepare(desc: *const Desc, workspace: *mut i64, err: *mut c_char, n: usize) -> i32;
    fn xd_sdpa_graphs_built() -> u64;
    #[allow(clippy::too_many_arguments)]
    fn xd_sdpa_run(
        desc: *const Desc,
        stream: *mut c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *mut c_void,
        stats: *mut c_void,
        workspace: *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn xd_sdpa_backward_run(
        desc: *const Desc,
        stream: *mut c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        o: *const c_void,
        d_o: *const c_void,
        stats: *const c_void,
        dq: *mut c_void,
        dk: *mut c_void,
        dv: *mut c_void,
        workspace: *mut c_void,
        err: *mut c_char,
        n: usize,
    ) -> i32;
}

const ERR_LEN: usize = 4096;
const _: () = assert!(std::mem::size_of::<Desc>() == 184);

fn err_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// How many graphs (forward or backward, one per description: dims, strides, dtype, mask)
/// this process has built so far, the evicted ones included: what a shape bucket saves shows
/// here.
pub fn graphs_built() -> u64 {
    // SAFETY: reads a counter under the shim's lock; no arguments.
    unsafe { xd_sdpa_graphs_built() }
}

/// Loads cuDNN once per process: its version (e.g. 91300), or why it could not be loaded.
pub fn load() -> std::result::Result<i64, String> {
    static LOADED: OnceLock<std::result::Result<i64, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut err = [0u8; ERR_LEN];
            // SAFETY: the buffer outlives the call and its length is passed.
            let v = unsafe { xd_cudnn_load(err.as_mut_ptr().cast(), ERR_LEN) };
            if v < 0 {
                Err(err_text(&err))
            } else {
                Ok(v)
            }
        })
        .clone()
}

/// `softmax(scale · q kᵀ + mask) · v` for `q` [B, Hq, Sq, D] and `k`, `v` [B, Hkv, Skv, D]
/// (bf16 or f16; `Hq` a multiple of `Hkv`: grouped-query attention needs no repeated heads).
/// Any strides: a `[B, S, H, D]` tensor's `transpose(1, 2)` goes in without a copy. Returns
/// `[B, Sq, Hq, D]`, contiguous: the layout the output projection reads. Inference only (no
/// backward). Fails when cuDNN is missing or does not support the case.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, params: Params) -> Result<Tensor> {
    q.apply_op3_no_bwd(k, v, &Sdpa(params))
}

struct Sdpa(Params);

/// `l`'s strides in elements, `[B, H, S, D]`. With one batch row the batch stride is never
/// used, so it is given as the rest's extent whatever it is: a view into a larger buffer (a
/// packed forward's sequence) then has the graph key of any other view of its shape, instead
/// of one per size of the buffer around it.
fn strides(l: &Layout) -> [i64; 4] {
    let s = l.stride();
    let d = l.dims();
    let batch = match d[0] {
        1 => (d[1] * d[2] * d[3]) as i64,
        _ => s[0] as i64,
    };
    [batch, s[1] as i64, s[2] as i64, s[3] as i64]
}

/// The description of an attention over `q` [B, Hq, Sq, D] and `k`, `v` [B, Hkv, Skv, D]
/// (checked) with the output in `[B, Sq, Hq, D]` contiguous; `stats` and `backward` unset.
fn describe(
    context: u64,
    dtype: i32,
    params: Params,
    (ql, kl, vl): (&Layout, &Layout, &Layout),
) -> Result<Desc> {
    let (b, hq, sq, d) = ql.shape().dims4()?;
    let (kb, hkv, skv, kd) = kl.shape().dims4()?;
    if kl.shape() != vl.shape() || kb != b || kd != d || hkv == 0 || hq % hkv != 0 {
        bail!(
            "cuDNN attention: q {:?}, k {:?}, v {:?} do not fit [B, Hq, Sq, D], [B, Hkv, Skv, D]",
            ql.shape(),
            kl.shape(),
            vl.shape()
        );
    }
    if params.causal == Causal::TopLeft && sq != skv {
        bail!("cuDNN attention: top-left causal mask with {sq} queries over {skv} keys");
    }
    Ok(Desc {
        context,
        dtype,
        b: b as i32,
        hq: hq as i32,
        hkv: hkv as i32,
        sq: sq as i32,
        skv: skv as i32,
        d: d as i32,
        backward: 0,
        q_stride: strides(ql),
        k_stride: strides(kl),
        v_stride: strides(vl),
        // [B, Sq, Hq, D] contiguous, described in cuDNN's [B, H, S, D] order.
        o_stride: [(sq * hq * d) as i64, d as i64, (hq * d) as i64, 1],
        scale: params.scale,
        causal: match params.causal {
            Causal::None => 0,
            Causal::TopLeft => 1,
            Causal::BottomRight => 2,
        },
        window: params.window.map_or(0, |w| w.min(i32::MAX as usize) as i32),
        stats: 0,
    })
}

/// Builds (or finds) `desc`'s graph: the bytes of workspace its run needs.
fn prepare(desc: &Desc) -> Result<usize> {
    let mut err = [0u8; ERR_LEN];
    let mut ws_bytes = 0i64;
    // SAFETY: `desc` and the buffers outlive the call.
    if unsafe { xd_sdpa_prepare(desc, &mut ws_bytes, err.as_mut_ptr().cast(), ERR_LEN) } != 0 {
        bail!("cuDNN attention: {}", err_text(&err));
    }
    Ok(ws_bytes.max(1) as usize)
}

/// The shim's code for a dtype: 0 bf16, 1 f16.
fn dtype_code(dt: DType) -> Result<i32> {
    match dt {
        DType::BF16 => Ok(0),
        DType::F16 => Ok(1),
        dt => bail!("cuDNN attention takes bf16 or f16, not {dt:?}"),
    }
}

impl Sdpa {
    fn run<T: CudaDType + DeviceRepr>(
        &self,
        dtype: i32,
        (qs, ql): (&CudaStorage, &Layout),
        (ks, kl): (&CudaStorage, &Layout),
        (vs, vl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let (b, hq, sq, d) = ql.shape().dims4()?;
        let dev = qs.device().clone();
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().w()?;
        let context = stream.context().cu_ctx() as usize as u64;
        let desc = describe(context, dtype, self.0, (ql, kl, vl))?;
        let qkv = [
            address::<T>(qs, ql, &stream)?,
            address::<T>(ks, kl, &stream)?,
            address::<T>(vs, vl, &stream)?,
        ];
        let (o, _) = run_forward::<T>(&dev, &desc, qkv)?;
        Ok((
            CudaStorage::wrap_cuda_slice(o, dev),
            Shape::from((b, sq, hq, d)),
        ))
    }
}

/// The device address of the first element `l` describes in `s`. Work using it must be queued
/// on `stream` (candle's) while the storage lives.
fn address<T: CudaDType + DeviceRepr>(
    s: &CudaStorage,
    l: &Layout,
    stream: &Arc<CudaStream>,
) -> Result<u64> {
    let slice = s.as_cuda_slice::<T>()?.slice(l.start_offset()..);
    let (p, _sync) = slice.device_ptr(stream);
    // cuDNN's graphs assume 16-byte aligned tensors (a view starting mid-row may not be).
    if !p.is_multiple_of(16) {
        bail!("cuDNN attention: an operand's address {p:#x} is not 16-byte aligned");
    }
    Ok(p)
}

/// Runs the forward graph of `desc` on `dev`'s stream over q, k, v at the device addresses
/// `qkv`: the output `[B, Sq, Hq, D]` and, when `desc.stats` is set, the softmax statistics
/// `[B, Hq, Sq]` (f32).
fn run_forward<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    desc: &Desc,
    qkv: [u64; 3],
) -> Result<(CudaSlice<T>, Option<CudaSlice<f32>>)> {
    let ws_bytes = prepare(desc)?;
    let (b, hq, sq, d) = (
        desc.b as usize,
        desc.hq as usize,
        desc.sq as usize,
        desc.d as usize,
    );
    let stream = dev.cuda_stream();
    // SAFETY: every element of both is written by the attention below.
    let mut o = unsafe { dev.alloc::<T>(b * sq * hq * d)? };
    let mut stats = match desc.stats {
        0 => None,
        _ => Some(unsafe { dev.alloc::<f32>(b * hq * sq)? }),
    };
    let mut ws = dev.alloc_zeros::<u8>(ws_bytes)?;
    let mut err = [0u8; ERR_LEN];
    let rc = {
        let (op, _og) = o.device_ptr_mut(&stream);
        let sp = stats.as_mut().map(|s| s.device_ptr_mut(&stream));
        let (wp, _wg) = ws.device_ptr_mut(&stream);
        let sp = sp
            .as_ref()
            .map_or(std::ptr::null_mut(), |(p, _)| *p as *mut c_void);
        // SAFETY: `qkv` and the buffers are live device allocations of the sizes `desc`
        // describes, ordered on candle's stream.
        unsafe {
            xd_sdpa_run(
                desc,
                stream.cu_stream() as *mut c_void,
                qkv[0] as *const c_void,
                qkv[1] as *const c_void,
                qkv[2] as *const c_void,
                op as *mut c_void,
                sp,
                wp as *mut c_void,
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        }
    };
    if rc != 0 {
        bail!("cuDNN attention: {}", err_text(&err));
    }
    Ok((o, stats))
}

impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "cudnn-sdpa"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("cuDNN attention runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
        vs: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        if ks.dtype() != qs.dtype() || vs.dtype() != qs.dtype() {
            bail!("cuDNN attention: q, k and v must share a dtype");
        }
        let code = dtype_code(qs.dtype())?;
        match qs.dtype() {
            DType::BF16 => self.run::<half::bf16>(code, (qs, ql), (ks, kl), (vs, vl)),
            _ => self.run::<half::f16>(code, (qs, ql), (ks, kl), (vs, vl)),
        }
    }
}

/// A tensor's device address (its layout's start) on the CUDA device, with its storage held
/// read-locked for as long as the borrow lives.
struct Operand<'a> {
    storage: candle_core::StorageRef<'a>,
    layout: &'a Layout,
}

impl<'a> Operand<'a> {
    fn of(t: &'a Tensor) -> Operand<'a> {
        let (storage, layout) = t.storage_and_layout();
        Operand { storage, layout }
    }

    fn cuda(&self) -> Result<&CudaStorage> {
        match &*self.storage {
            Storage::Cuda(s) => Ok(s),
            _ => bail!("cuDNN attention runs on CUDA devices only"),
        }
    }

    /// The device address of the layout's first element.
    fn ptr<T: CudaDType + DeviceRepr>(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        address::<T>(self.cuda()?, self.layout, stream)
    }
}

/// Builds (or finds) both graphs of training over `q`, `k`, `v` as [`sdpa_train`] and
/// [`sdpa_backward`] will take them, without running either: an error says cuDNN does not
/// support the case (e.g. a backward with heads of 256 before Hopper), before any work is done
/// with it, so that the caller can take another kernel for both directions.
pub fn prepare_train(q: &Tensor, k: &Tensor, v: &Tensor, params: Params) -> Result<()> {
    if let Err(why) = load() {
        bail!("cuDNN attention: {why}");
    }
    let dtype = dtype_code(q.dtype())?;
    let (qo, ko, vo) = (Operand::of(q), Operand::of(k), Operand::of(v));
    let stream = qo.cuda()?.device().cuda_stream();
    stream.context().bind_to_thread().w()?;
    let context = stream.context().cu_ctx() as usize as u64;
    let mut desc = describe(context, dtype, params, (qo.layout, ko.layout, vo.layout))?;
    desc.stats = 1;
    prepare(&desc)?;
    // The backward's description: the forward's with `backward` set and no statistics written
    // (as `train_backward` makes it).
    desc.stats = 0;
    desc.backward = 1;
    prepare(&desc)?;
    Ok(())
}

/// The forward of training: `softmax(scale · q kᵀ + mask) · v` as [`sdpa`] (`o` `[B, Sq, Hq,
/// D]`, contiguous) and the softmax statistics the backward reads: f32 `[B, Hq, Sq, 1]`, each
/// query's log-sum-exp of its scaled, masked scores. Untracked (no gradient graph): the caller
/// runs [`sdpa_backward`] by hand.
pub fn sdpa_train(q: &Tensor, k: &Tensor, v: &Tensor, params: Params) -> Result<(Tensor, Tensor)> {
    let (b, hq, sq, d) = q.dims4()?;
    match q.dtype() {
        DType::BF16 => train_forward::<half::bf16>(q, k, v, params, (b, hq, sq, d)),
        _ => train_forward::<half::f16>(q, k, v, params, (b, hq, sq, d)),
    }
}

fn train_forward<T: CudaDType + DeviceRepr>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: Params,
    (b, hq, sq, d): (usize, usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let dtype = dtype_code(q.dtype())?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("cuDNN attention: q, k and v must share a dtype");
    }
    let (qo, ko, vo) = (Operand::of(&q), Operand::of(&k), Operand::of(&v));
    let dev = qo.cuda()?.device().clone();
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let context = stream.context().cu_ctx() as usize as u64;
    let mut desc = describe(context, dtype, params, (qo.layout, ko.layout, vo.layout))?;
    desc.stats = 1;
    let qkv = [
        qo.ptr::<T>(&stream)?,
        ko.ptr::<T>(&stream)?,
        vo.ptr::<T>(&stream)?,
    ];
    let (o, stats) = run_forward::<T>(&dev, &desc, qkv)?;
    let Some(stats) = stats else {
        bail!("cuDNN attention: the training forward wrote no statistics");
    };
    let o = Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(o, dev.clone())),
        (b, sq, hq, d),
        BackpropOp::none(),
        false,
    );
    let stats = Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(stats, dev)),
        (b, hq, sq, 1),
        BackpropOp::none(),
        false,
    );
    Ok((o, stats))
}

/// The backward of [`sdpa_train`]: given `q` [B, Hq, Sq, D], `k`, `v` [B, Hkv, Skv, D], its `o`
/// `[B, Sq, Hq, D]` and `stats`, and the gradient `d_o` at `o` (any layout; made `[B, Sq, Hq,
/// D]` contiguous), returns dq `[B, Hq, Sq, D]` and dk, dv `[B, Hkv, Skv, D]`, contiguous;
/// grouped-query heads' dk and dv summed over the queries that share them. cuDNN's
/// deterministic algorithm: the same inputs give the same bits.
pub fn sdpa_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    o: &Tensor,
    stats: &Tensor,
    d_o: &Tensor,
    params: Params,
) -> Result<(Tensor, Tensor, Tensor)> {
    match q.dtype() {
        DType::BF16 => train_backward::<half::bf16>((q, k, v), o, stats, d_o, params),
        _ => train_backward::<half::f16>((q, k, v), o, stats, d_o, params),
    }
}

fn train_backward<T: CudaDType + DeviceRepr>(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    o: &Tensor,
    stats: &Tensor,
    d_o: &Tensor,
    params: Params,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, hq, sq, d) = q.dims4()?;
    let (_, hkv, skv, _) = k.dims4()?;
    if o.dims() != [b, sq, hq, d] || d_o.dims() != [b, sq, hq, d] {
        bail!(
            "cuDNN attention backward: o {:?} and do {:?} must be [B, Sq, Hq, D] = {:?}",
            o.dims(),
            d_o.dims(),
            [b, sq, hq, d]
        );
    }
    if stats.dims() != [b, hq, sq, 1] || stats.dtype() != DType::F32 {
        bail!("cuDNN attention backward: statistics must be f32 [B, Hq, Sq, 1]");
    }
    let dtype = dtype_code(q.dtype())?;
    for t in [k, v, o] {
        if t.dtype() != q.dtype() {
            bail!("cuDNN attention backward: q, k, v and o must share a dtype");
        }
    }
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let o = o.detach().contiguous()?;
    let d_o = d_o.detach().to_dtype(q.dtype())?.contiguous()?;
    let stats = stats.detach().contiguous()?;
    let (qo, ko, vo) = (Operand::of(&q), Operand::of(&k), Operand::of(&v));
    let (oo, doo, so) = (Operand::of(&o), Operand::of(&d_o), Operand::of(&stats));
    let dev = qo.cuda()?.device().clone();
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let context = stream.context().cu_ctx() as usize as u64;
    let mut desc = describe(context, dtype, params, (qo.layout, ko.layout, vo.layout))?;
    desc.backward = 1;
    let ws_bytes = prepare(&desc)?;
    // dq, dk and dv in one allocation (one tensor, narrowed below).
    let (nq, nkv) = (b * hq * sq * d, b * hkv * skv * d);
    // SAFETY: every element is written by the backward below.
    let mut grads = unsafe { dev.alloc::<T>(nq + 2 * nkv)? };
    let mut ws = dev.alloc_zeros::<u8>(ws_bytes)?;
    let mut err = [0u8; ERR_LEN];
    let ptrs = [
        qo.ptr::<T>(&stream)?,
        ko.ptr::<T>(&stream)?,
        vo.ptr::<T>(&stream)?,
        oo.ptr::<T>(&stream)?,
        doo.ptr::<T>(&stream)?,
        so.ptr::<f32>(&stream)?,
    ];
    let el = std::mem::size_of::<T>() as u64;
    let rc = {
        let (gp, _gg) = grads.device_ptr_mut(&stream);
        let (wp, _wg) = ws.device_ptr_mut(&stream);
        let (dq, dk, dv) = (gp, gp + nq as u64 * el, gp + (nq + nkv) as u64 * el);
        // SAFETY: live device allocations of the sizes `desc` describes (the inputs stay
        // read-locked; dq, dk, dv are disjoint parts of `grads`), ordered on candle's stream.
        unsafe {
            xd_sdpa_backward_run(
                &desc,
                stream.cu_stream() as *mut c_void,
                ptrs[0] as *const c_void,
                ptrs[1] as *const c_void,
                ptrs[2] as *const c_void,
                ptrs[3] as *const c_void,
                ptrs[4] as *const c_void,
                ptrs[5] as *const c_void,
                dq as *mut c_void,
                dk as *mut c_void,
                dv as *mut c_void,
                wp as *mut c_void,
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        }
    };
    if rc != 0 {
        bail!("cuDNN attention backward: {}", err_text(&err));
    }
    let grads = Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(grads, dev)),
        nq + 2 * nkv,
        BackpropOp::none(),
        false,
    );
    let dq = grads.narrow(0, 0, nq)?.reshape((b, hq, sq, d))?;
    let dk = grads.narrow(0, nq, nkv)?.reshape((b, hkv, skv, d))?;
    let dv = grads.narrow(0, nq + nkv, nkv)?.reshape((b, hkv, skv, d))?;
    Ok((dq, dk, dv))
}
