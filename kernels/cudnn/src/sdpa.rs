//! The Rust side of the shim: a [`candle_core::CustomOp3`] over q, k, v that describes their
//! layouts to cuDNN (strides, so no transposes) and runs the cached graph on candle's stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

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
    /// Zero: no implicit padding, so equal descriptions have equal bytes (the cache's key).
    pad: i32,
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
}

const ERR_LEN: usize = 4096;
const _: () = assert!(std::mem::size_of::<Desc>() == 184);

fn err_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
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

fn strides(l: &Layout) -> [i64; 4] {
    let s = l.stride();
    [s[0] as i64, s[1] as i64, s[2] as i64, s[3] as i64]
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
        let (kb, hkv, skv, kd) = kl.shape().dims4()?;
        if kl.shape() != vl.shape() || kb != b || kd != d || hkv == 0 || hq % hkv != 0 {
            bail!(
                "cuDNN attention: q {:?}, k {:?}, v {:?} do not fit [B, Hq, Sq, D], [B, Hkv, Skv, D]",
                ql.shape(),
                kl.shape(),
                vl.shape()
            );
        }
        if self.0.causal == Causal::TopLeft && sq != skv {
            bail!("cuDNN attention: top-left causal mask with {sq} queries over {skv} keys");
        }
        let dev = qs.device().clone();
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().w()?;
        let n = b * sq * hq * d;
        let desc = Desc {
            context: stream.context().cu_ctx() as usize as u64,
            dtype,
            b: b as i32,
            hq: hq as i32,
            hkv: hkv as i32,
            sq: sq as i32,
            skv: skv as i32,
            d: d as i32,
            pad: 0,
            q_stride: strides(ql),
            k_stride: strides(kl),
            v_stride: strides(vl),
            // [B, Sq, Hq, D] contiguous, described in cuDNN's [B, H, S, D] order.
            o_stride: [(sq * hq * d) as i64, d as i64, (hq * d) as i64, 1],
            scale: self.0.scale,
            causal: match self.0.causal {
                Causal::None => 0,
                Causal::TopLeft => 1,
                Causal::BottomRight => 2,
            },
            window: self.0.window.map_or(0, |w| w.min(i32::MAX as usize) as i32),
            stats: 0,
        };
        let mut err = [0u8; ERR_LEN];
        let mut ws_bytes = 0i64;
        // SAFETY: `desc` and the buffers outlive the call.
        if unsafe { xd_sdpa_prepare(&desc, &mut ws_bytes, err.as_mut_ptr().cast(), ERR_LEN) } != 0 {
            bail!("cuDNN attention: {}", err_text(&err));
        }
        // SAFETY: every element is written by the attention below.
        let mut o = unsafe { dev.alloc::<T>(n)? };
        let mut ws = dev.alloc_zeros::<u8>(ws_bytes.max(1) as usize)?;
        let q = qs.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let k = ks.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let v = vs.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        let rc = {
            let (qp, _qg) = q.device_ptr(&stream);
            let (kp, _kg) = k.device_ptr(&stream);
            let (vp, _vg) = v.device_ptr(&stream);
            let (op, _og) = o.device_ptr_mut(&stream);
            let (wp, _wg) = ws.device_ptr_mut(&stream);
            // SAFETY: the pointers are live device allocations of the sizes `desc` describes
            // (candle checked the layouts against the storages), ordered on candle's stream.
            unsafe {
                xd_sdpa_run(
                    &desc,
                    stream.cu_stream() as *mut c_void,
                    qp as *const c_void,
                    kp as *const c_void,
                    vp as *const c_void,
                    op as *mut c_void,
                    std::ptr::null_mut(),
                    wp as *mut c_void,
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            }
        };
        if rc != 0 {
            bail!("cuDNN attention: {}", err_text(&err));
        }
        Ok((
            CudaStorage::wrap_cuda_slice(o, dev),
            Shape::from((b, sq, hq, d)),
        ))
    }
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
        match qs.dtype() {
            DType::BF16 => self.run::<half::bf16>(0, (qs, ql), (ks, kl), (vs, vl)),
            DType::F16 => self.run::<half::f16>(1, (qs, ql), (ks, kl), (vs, vl)),
            dt => bail!("cuDNN attention takes bf16 or f16, not {dt:?}"),
        }
    }
}
