//! Matmuls in blocks of a fixed number of rows, for the packed forward (`packed.rs`): while a
//! [`GemmRows`] scope is alive, this thread's linear layers (serving ops) compute every row as a
//! product of exactly that many rows computes it, whatever the batch (batch-invariant by
//! construction). On CUDA ([`gemm_nt_blocks`]) one cuBLASLt matmul over all rows with the
//! algorithm chosen for one block, or one cuBLAS GEMM per block ([`packed_gemm_mode`]); the
//! layers run the dense path per block elsewhere (`layers::Linear`). A scope rather than an
//! argument: the layers' code is the decoder's own, and only the linear layers see the blocks.

#[cfg(feature = "cuda")]
use candle_core::{Result, Tensor};
use std::cell::Cell;

thread_local! {
    static GEMM_ROWS: Cell<Option<usize>> = const { Cell::new(None) };
}

/// While alive, this thread's linear layers (serving ops) multiply blocks of exactly `rows`
/// rows ([`gemm_rows`]); dropped, the setting before it returns.
pub(crate) struct GemmRows(Option<usize>);

impl GemmRows {
    pub(crate) fn set(rows: usize) -> GemmRows {
        GemmRows(GEMM_ROWS.with(|c| c.replace(Some(rows))))
    }
}

impl Drop for GemmRows {
    fn drop(&mut self) {
        GEMM_ROWS.with(|c| c.set(self.0));
    }
}

/// The rows per matmul block of this thread's packed forward, if one is running.
pub(crate) fn gemm_rows() -> Option<usize> {
    GEMM_ROWS.with(Cell::get)
}

/// How the packed forward's matmuls run on CUDA: `XDISTILL_PACKED_GEMM=fixed-algo` (unset: the
/// default; one cuBLASLt matmul over all rows, its algorithm the one chosen for a block of rows,
/// without split-K) or `per-block` (one cuBLAS GEMM per block, as before 2026-11-30), read once
/// per process. Both are batch-invariant; they differ in speed (gpu-check step 3t times both).
#[cfg(feature = "cuda")]
pub fn packed_gemm_mode() -> xdistill_cuda_kernels::GemmBlocksMode {
    use xdistill_cuda_kernels::GemmBlocksMode;
    static MODE: std::sync::OnceLock<GemmBlocksMode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("XDISTILL_PACKED_GEMM").ok().as_deref() {
        None | Some("fixed-algo") => GemmBlocksMode::FixedAlgo,
        Some("per-block") => GemmBlocksMode::PerBlock,
        Some(other) => {
            tracing::warn!("XDISTILL_PACKED_GEMM: {other:?} is not fixed-algo or per-block; using fixed-algo");
            GemmBlocksMode::FixedAlgo
        }
    })
}

/// The packed GEMM mode's name for the teacher's log (`packed_gemm_mode`, CUDA builds):
/// `fixed-algo` or `per-block` (always `per-block` in a build without CUDA, and on the CPU: the
/// layer's own matmul per block).
pub fn packed_gemm_name() -> &'static str {
    #[cfg(feature = "cuda")]
    if packed_gemm_mode() == xdistill_cuda_kernels::GemmBlocksMode::FixedAlgo {
        return "fixed-algo";
    }
    "per-block"
}

/// `x [rows, k] · wᵀ` (`w` `[n, k]`, both contiguous) → `[rows, n]`, each row as a product of
/// `block` rows computes it: on CUDA (f32, bf16, f16) by cuBLAS(Lt) into one output.
#[cfg(feature = "cuda")]
pub(crate) fn gemm_nt_blocks(x: &Tensor, w: &Tensor, block: usize) -> Result<Tensor> {
    x.apply_op2_no_bwd(
        w,
        &GemmBlocks {
            block,
            mode: packed_gemm_mode(),
        },
    )
}

/// [`gemm_nt_blocks`] as a candle op (CUDA only).
#[cfg(feature = "cuda")]
struct GemmBlocks {
    block: usize,
    mode: xdistill_cuda_kernels::GemmBlocksMode,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for GemmBlocks {
    fn name(&self) -> &'static str {
        "gemm-nt-blocks"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("gemm-nt-blocks runs on CUDA (the CPU multiplies block by block)")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &candle_core::Layout,
        w: &candle_core::CudaStorage,
        lw: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let (rows, k) = lx.shape().dims2()?;
        let (n, kw) = lw.shape().dims2()?;
        if k != kw {
            candle_core::bail!("gemm-nt-blocks: x [{rows}, {k}], w [{n}, {kw}]");
        }
        let args = xdistill_cuda_kernels::GemmBlocksArgs {
            rows,
            k,
            n,
            block: self.block,
            mode: self.mode,
        };
        let y = xdistill_cuda_kernels::gemm_nt_blocks((x, lx), (w, lw), args)?;
        Ok((y, candle_core::Shape::from((rows, n))))
    }
}
