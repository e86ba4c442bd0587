//! `y = x · wᵀ` with every row computed as a product of exactly `block` rows computes it: the
//! packed teacher forward's linear layers (`shared/src/model/packed.rs`), batch-invariant by
//! construction. Two ways ([`GemmBlocksMode`]):
//! - **fixed algorithm** (the default): one cuBLASLt matmul over all the rows, with the
//!   algorithm cuBLASLt's heuristic gives for a product of `block` rows (asked once per dtype,
//!   `n`, `k` and `block`, and kept), restricted to algorithms without split-K. The algorithm
//!   fixes the tile, its pipeline and the order of each output's sum over `k`; the number of
//!   rows only changes how many tiles run, so a row's bits do not depend on the batch. Where the
//!   algorithm does not take the whole product, it runs block by block (the shape it was chosen
//!   for); where cuBLASLt has no algorithm without split-K, the per-block way runs.
//! - **per block**: one cuBLAS GEMM per block (cuBLAS's own choice for a block's shape), every
//!   block writing its rows of one output. A block of 1,024 rows fills a fraction of a large GPU
//!   (about 64 tiles for `n` = 1,024 on an H200's 132 multiprocessors) and the blocks run one
//!   after another: the fixed algorithm runs them as one product.
//!
//! No `.cu` of its own: the kernels are cuBLAS's, on candle's stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result, sys};
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt_result, sys as lt};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// How the blocks' products run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GemmBlocksMode {
    /// One cuBLASLt matmul over all rows, its algorithm the one chosen for one block.
    #[default]
    FixedAlgo,
    /// One cuBLAS GEMM per block.
    PerBlock,
}

/// The shape of one product: `y` `[rows, n]` = `x` `[rows, k]` · `wᵀ` (`w` `[n, k]`), in blocks of
/// `block` rows (`rows` a multiple of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmBlocksArgs {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    pub block: usize,
    pub mode: GemmBlocksMode,
}

/// `x · wᵀ` for contiguous `x` `[rows, k]` and `w` `[n, k]` of one dtype (f32, bf16 or f16;
/// products summed in f32, as candle's matmul): `[rows, n]` in the inputs' dtype, each row the
/// bits a product of `block` rows gives it.
pub fn gemm_nt_blocks(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    a: GemmBlocksArgs,
) -> Result<CudaStorage> {
    let GemmBlocksArgs {
        rows,
        k,
        n,
        block,
        mode,
    } = a;
    for (what, l, count) in [("x", lx, rows * k), ("w", lw, n * k)] {
        if !l.is_contiguous() || l.shape().elem_count() != count {
            bail!(
                "gemm_nt_blocks: {what} {:?} is not {count} contiguous elements",
                l.shape()
            );
        }
    }
    if x.dtype() != w.dtype() {
        bail!("gemm_nt_blocks: x is {:?}, w {:?}", x.dtype(), w.dtype());
    }
    if block == 0 || !rows.is_multiple_of(block) {
        bail!("gemm_nt_blocks: {rows} rows in blocks of {block}");
    }
    let fits = |v: usize| i32::try_from(v).is_ok();
    if !(fits(rows) && fits(k) && fits(n) && fits(rows * n) && fits(rows * k)) {
        bail!("gemm_nt_blocks: {rows} × {k} × {n} is out of cuBLAS's range");
    }
    let dev = x.device().clone();
    macro_rules! run {
        ($t:ty) => {{
            let xs = x.as_cuda_slice::<$t>()?.slice(lx.start_offset()..);
            let ws = w.as_cuda_slice::<$t>()?.slice(lw.start_offset()..);
            // SAFETY: the products below write every element (`rows × n`).
            let mut y = unsafe { dev.alloc::<$t>((rows * n).max(1))? };
            if rows > 0 && n > 0 {
                let stream = dev.cuda_stream();
                let (xp, _sx) = xs.device_ptr(&stream);
                let (wp, _sw) = ws.device_ptr(&stream);
                let (yp, _sy) = y.device_ptr_mut(&stream);
                let p = Product {
                    x: xp,
                    w: wp,
                    y: yp,
                    size: std::mem::size_of::<$t>() as u64,
                    dtype: x.dtype(),
                    rows,
                    k,
                    n,
                    block,
                };
                let fixed = mode == GemmBlocksMode::FixedAlgo && fixed_algo(&dev, &p)?;
                if !fixed {
                    per_block(&dev, &p)?;
                }
            }
            CudaStorage::wrap_cuda_slice(y, dev.clone())
        }};
    }
    Ok(match x.dtype() {
        DType::F32 => run!(f32),
        DType::BF16 => run!(half::bf16),
        DType::F16 => run!(half::f16),
        other => bail!("gemm_nt_blocks takes f32, bf16 or f16, not {other:?}"),
    })
}

/// One product's device addresses and shape.
struct Product {
    x: u64,
    w: u64,
    y: u64,
    /// Bytes per element.
    size: u64,
    dtype: DType,
    rows: usize,
    k: usize,
    n: usize,
    block: usize,
}

fn cublas_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Cuda(format!("gemm_nt_blocks: {what}: {e:?}").into())
}

/// One cuBLAS GEMM per block, each into its rows of `y`.
fn per_block(dev: &CudaDevice, p: &Product) -> Result<()> {
    let blas = dev.cublas_handle();
    let ty = crate::gemm_acc::data_type(p.dtype)?;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (k, n, block) = (p.k, p.n, p.block);
    for b in 0..p.rows / block {
        let xb = p.x + (b * block * k) as u64 * p.size;
        let yb = p.y + (b * block * n) as u64 * p.size;
        // Column-major, cuBLAS's view: y_b is [n, block] (ld n), w is [k, n] (ld k, transposed:
        // [n, k]), x_b is [k, block] (ld k); y_b = wᵀ-view · x_b.
        // SAFETY: the pointers are the live contiguous storages checked by the caller (and the
        // output it allocated), of the sizes the dimensions and leading dimensions describe;
        // the handle runs on candle's stream, where every other use of these buffers is queued.
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                block as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                p.w as *const _,
                ty,
                k as i32,
                xb as *const _,
                ty,
                k as i32,
                &beta as *const f32 as *const _,
                yb as *mut _,
                ty,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cublas_err("cublasGemmEx", e))?;
    }
    Ok(())
}

/// What was decided for one (device, dtype, n, k, block): the matmul description, `w`'s layout,
/// the algorithm (none: cuBLASLt has none without split-K, the blocks run per block), and the
/// layouts of `x` and `y` per number of rows with whether the algorithm took them at once.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    w: lt::cublasLtMatrixLayout_t,
    algo: Option<lt::cublasLtMatmulAlgo_t>,
    by_rows: HashMap<usize, RowLayouts>,
}

struct RowLayouts {
    x: lt::cublasLtMatrixLayout_t,
    y: lt::cublasLtMatrixLayout_t,
    /// Whether the algorithm ran on these rows at once (checked at their first product);
    /// otherwise the rows run block by block through the block's layouts.
    whole: Option<bool>,
}

/// Every device's cuBLASLt handle and plans. Never freed (as the cuDNN graphs): nothing then
/// calls into cuBLASLt after it has unloaded at exit.
#[derive(Default)]
struct LtState {
    handles: HashMap<usize, lt::cublasLtHandle_t>,
    plans: HashMap<PlanKey, Plan>,
    /// Shapes whose plan could not be made (cuBLASLt failed): a GEMM per block, always.
    refused: std::collections::HashSet<PlanKey>,
}

/// (device ordinal, dtype, n, k, block).
type PlanKey = (usize, DType, usize, usize, usize);

// SAFETY: the handles and descriptors are only used under the mutex below, one thread at a time,
// which is all cuBLASLt asks of a handle shared between threads (its operations take the stream).
unsafe impl Send for LtState {}

static LT: Mutex<Option<LtState>> = Mutex::new(None);

/// A cuBLASLt layout of a column-major `[r, c]` matrix (leading dimension `r`).
fn layout(dtype: DType, r: usize, c: usize) -> Result<lt::cublasLtMatrixLayout_t> {
    let ty = match dtype {
        DType::F32 => lt::cudaDataType::CUDA_R_32F,
        DType::BF16 => lt::cudaDataType::CUDA_R_16BF,
        DType::F16 => lt::cudaDataType::CUDA_R_16F,
        other => bail!("cuBLASLt operands here are f32, bf16 or f16, not {other:?}"),
    };
    lt_result::create_matrix_layout(ty, r as u64, c as u64, r as i64)
        .map_err(|e| cublas_err("cublasLtMatrixLayoutCreate", e))
}

/// The plan for `p`'s shape: the description (products summed in f32, `w` transposed), `w`'s
/// layout and the heuristic's first algorithm for `block` rows without split-K (none where it
/// offers none, or where the one it offers splits k after all).
fn new_plan(handle: lt::cublasLtHandle_t, p: &Product) -> Result<(Plan, RowLayouts)> {
    let desc = lt_result::create_matmul_desc(
        lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        lt::cudaDataType::CUDA_R_32F,
    )
    .map_err(|e| cublas_err("cublasLtMatmulDescCreate", e))?;
    // cublasOperation_t is an int32 attribute: CUBLAS_OP_T = 1.
    let op_t: i32 = 1;
    // SAFETY: `desc` was just created; the attribute is an int32 read from a live local.
    unsafe {
        lt_result::set_matmul_desc_attribute(
            desc,
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &op_t as *const i32 as *const c_void,
            std::mem::size_of::<i32>(),
        )
    }
    .map_err(|e| cublas_err("CUBLASLT_MATMUL_DESC_TRANSA", e))?;
    // Column-major, as in `per_block`: w is [k, n] (transposed), x [k, rows], y [n, rows].
    let w = layout(p.dtype, p.k, p.n)?;
    let one = RowLayouts {
        x: layout(p.dtype, p.k, p.block)?,
        y: layout(p.dtype, p.n, p.block)?,
        whole: Some(true),
    };
    // The heuristic's best eight for one block, in its order, with no workspace and (`mask`)
    // only algorithms that do not split the sum over k (reduction scheme none).
    type Found = (lt::cublasStatus_t, Vec<lt::cublasLtMatmulHeuristicResult_t>);
    let query = |mask: Option<u32>| -> Result<Found> {
        let pref = lt_result::create_matmul_pref().map_err(|e| cublas_err("preference", e))?;
        let workspace = 0u64;
        // SAFETY: `pref` was just created; the attributes are a u64 and a u32 from live locals;
        // the heuristic writes at most `found.len()` results (zeroed first: a valid value of the
        // plain C struct; only the first `count` are read).
        unsafe {
            let set = lt_result::set_matmul_pref_attribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .and_then(|_| match &mask {
                Some(m) => lt_result::set_matmul_pref_attribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    m as *const u32 as *const c_void,
                    std::mem::size_of::<u32>(),
                ),
                None => Ok(()),
            });
            let mut found = [std::mem::zeroed::<lt::cublasLtMatmulHeuristicResult_t>(); 8];
            let mut count = 0i32;
            let status = match set {
                Ok(()) => lt::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    w,
                    one.x,
                    one.y,
                    one.y,
                    pref,
                    found.len() as i32,
                    found.as_mut_ptr(),
                    &mut count,
                ),
                Err(e) => e.0,
            };
            let _ = lt_result::destroy_matmul_pref(pref);
            Ok((status, found[..count.clamp(0, 8) as usize].to_vec()))
        }
    };
    // The first that says it does not split k: among those the reduction mask lets through
    // (mask 0: scheme none only), else among all.
    let pick = |found: &[lt::cublasLtMatmulHeuristicResult_t]| {
        found
            .iter()
            .filter(|h| h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .find(|h| splits_k(&h.algo) == Some(false))
            .map(|h| h.algo)
    };
    let (mut status, found) = query(Some(0))?;
    let mut candidates = found.len();
    let mut algo = pick(&found);
    if algo.is_none() {
        let (s, found) = query(None)?;
        (status, candidates, algo) = (s, found.len(), pick(&found));
    }
    if algo.is_none() {
        tracing::warn!(
            dtype = ?p.dtype,
            block = p.block,
            n = p.n,
            k = p.k,
            status = ?status,
            candidates,
            "packed GEMM: cuBLASLt offers no algorithm without split-K for this shape; one \
             cuBLAS GEMM per block instead"
        );
    }
    Ok((
        Plan {
            desc,
            w,
            algo,
            by_rows: HashMap::new(),
        },
        one,
    ))
}

/// Whether `algo` splits the sum over k (its SPLITK_NUM above 1 or a reduction scheme); `None`
/// where cuBLASLt does not say.
fn splits_k(algo: &lt::cublasLtMatmulAlgo_t) -> Option<bool> {
    let attr = |a: lt::cublasLtMatmulAlgoConfigAttributes_t| -> Option<u32> {
        let mut v = 0u32;
        let mut written = 0usize;
        // SAFETY: `algo` is a live algorithm; the buffer is a u32 (both attributes are 32-bit).
        let status = unsafe {
            lt::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                a,
                &mut v as *mut u32 as *mut c_void,
                std::mem::size_of::<u32>(),
                &mut written,
            )
        };
        (status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && written == 4).then_some(v)
    };
    let split = attr(lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)?;
    let scheme =
        attr(lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)?;
    Some(split > 1 || scheme != 0)
}

/// The product by the fixed algorithm, over all rows at once or block by block. False where this
/// shape has no such algorithm (the caller runs [`per_block`]).
fn fixed_algo(dev: &CudaDevice, p: &Product) -> Result<bool> {
    use candle_core::backend::BackendDevice;
    let ordinal = match dev.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
        other => bail!("gemm_nt_blocks: {other:?} is not a CUDA device"),
    };
    let stream = dev.cuda_stream();
    let key = (ordinal, p.dtype, p.n, p.k, p.block);
    let mut guard = LT.lock().unwrap_or_else(|e| e.into_inner());
    let state = guard.get_or_insert_with(LtState::default);
    if state.refused.contains(&key) {
        return Ok(false);
    }
    // A handle and a plan, or (cuBLASLt failing to make either) this shape refused for good:
    // before any product of it ran, so that its rows always take the same way.
    let made = match state.handles.get(&ordinal) {
        Some(&h) => Ok(h),
        None => stream
            .context()
            .bind_to_thread()
            .map_err(|e| cublas_err("binding the context", e))
            .and_then(|_| lt_result::create_handle().map_err(|e| cublas_err("cublasLtCreate", e)))
            .inspect(|&h| {
                state.handles.insert(ordinal, h);
            }),
    }
    .and_then(|handle| {
        if let std::collections::hash_map::Entry::Vacant(e) = state.plans.entry(key) {
            let (mut plan, one) = new_plan(handle, p)?;
            plan.by_rows.insert(p.block, one);
            e.insert(plan);
        }
        Ok(handle)
    });
    let handle = match made {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(
                dtype = ?p.dtype,
                block = p.block,
                n = p.n,
                k = p.k,
                "packed GEMM: cuBLASLt failed ({e}); one cuBLAS GEMM per block for this shape"
            );
            state.refused.insert(key);
            return Ok(false);
        }
    };
    let plan = state.plans.get_mut(&key).expect("made above");
    let Some(algo) = plan.algo else {
        return Ok(false);
    };
    if let std::collections::hash_map::Entry::Vacant(e) = plan.by_rows.entry(p.rows) {
        e.insert(RowLayouts {
            x: layout(p.dtype, p.k, p.rows)?,
            y: layout(p.dtype, p.n, p.rows)?,
            whole: None,
        });
    }
    let cu_stream = stream.cu_stream() as lt::cudaStream_t;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (desc, w) = (plan.desc, plan.w);
    // y = wᵀ-view · x over `rows` columns (cuBLAS's view) by `algo`, no workspace.
    // SAFETY: the pointers are the live contiguous storages the caller checked and allocated, of
    // the sizes the layouts describe (`rows` or `block` columns from the given offsets); the
    // matmul is queued on candle's stream, where every other use of these buffers is queued.
    let run = |x: u64, y: u64, xl, yl| unsafe {
        lt_result::matmul(
            handle,
            desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            p.w as *const c_void,
            w,
            x as *const c_void,
            xl,
            y as *const c_void,
            yl,
            y as *mut c_void,
            yl,
            &algo,
            std::ptr::null_mut(),
            0,
            cu_stream,
        )
    };
    let whole = plan.by_rows[&p.rows].whole;
    if whole != Some(false) {
        let l = &plan.by_rows[&p.rows];
        match run(p.x, p.y, l.x, l.y) {
            Ok(()) => {
                plan.by_rows.get_mut(&p.rows).expect("present").whole = Some(true);
                return Ok(true);
            }
            Err(e) if whole.is_none() => {
                tracing::warn!(
                    dtype = ?p.dtype,
                    block = p.block,
                    n = p.n,
                    k = p.k,
                    rows = p.rows,
                    error = ?e,
                    "packed GEMM: the fixed algorithm refused these rows at once; it runs them \
                     block by block"
                );
                plan.by_rows.get_mut(&p.rows).expect("present").whole = Some(false);
            }
            Err(e) => return Err(cublas_err("cublasLtMatmul", e)),
        }
    }
    let one = &plan.by_rows[&p.block];
    for b in 0..p.rows / p.block {
        let xb = p.x + (b * p.block * p.k) as u64 * p.size;
        let yb = p.y + (b * p.block * p.n) as u64 * p.size;
        run(xb, yb, one.x, one.y).map_err(|e| cublas_err("cublasLtMatmul", e))?;
    }
    Ok(true)
}
