//! Matmuls in blocks of a fixed number of rows, for the packed forward (`packed.rs`): while a
//! [`GemmRows`] scope is alive, this thread's linear layers (serving ops) multiply blocks of
//! exactly that many rows, each the same product whatever the batch (batch-invariant by
//! construction). On CUDA one cuBLAS GEMM per block into one output ([`gemm_nt_blocks`]); the
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

/// `x [rows, k] · wᵀ` (`w` `[n, k]`, both contiguous) → `[rows, n]`, one GEMM per block of
/// `block` rows: on CUDA (f32, bf16, f16) by cuBLAS into one output.
#[cfg(feature = "cuda")]
pub(crate) fn gemm_nt_blocks(x: &Tensor, w: &Tensor, block: usize) -> Result<Tensor> {
    x.apply_op2_no_bwd(w, &GemmBlocks { block })
}

/// [`gemm_nt_blocks`] as a candle op (CUDA only).
#[cfg(feature = "cuda")]
struct GemmBlocks {
    block: usize,
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
        };
        let y = xdistill_cuda_kernels::gemm_nt_blocks((x, lx), (w, lw), args)?;
        Ok((y, candle_core::Shape::from((rows, n))))
    }
}
