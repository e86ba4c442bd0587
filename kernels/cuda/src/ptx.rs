//! The embedded PTX of each kernel file (`build.rs` compiles `src/NAME.cu` to `NAME.ptx`) and the
//! one place that loads a kernel: by file, then by function name, cached per device by candle.

use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;

/// One compiled `.cu` file.
pub struct Module {
    /// Module name in candle's per-device cache.
    pub name: &'static str,
    pub ptx: &'static str,
}

pub const TOPK_ROWS: Module = Module {
    name: "xdistill_topk_rows",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/topk_rows.ptx")),
};

pub const ADAMW: Module = Module {
    name: "xdistill_adamw",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx")),
};

pub const LOG_SOFTMAX: Module = Module {
    name: "xdistill_log_softmax",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/log_softmax.ptx")),
};

pub const GRAD_ACCUMULATE: Module = Module {
    name: "xdistill_grad_accumulate",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/grad_accumulate.ptx")),
};

pub const SUM_SQUARES: Module = Module {
    name: "xdistill_sum_squares",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/sum_squares.ptx")),
};

pub const RMS_NORM: Module = Module {
    name: "xdistill_rms_norm",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/rms_norm.ptx")),
};

pub const ROPE: Module = Module {
    name: "xdistill_rope",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/rope.ptx")),
};

pub const GATED_ACT: Module = Module {
    name: "xdistill_gated_act",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/gated_act.ptx")),
};

pub const TOPK_KD: Module = Module {
    name: "xdistill_topk_kd",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/topk_kd.ptx")),
};

pub const TREE_SUM: Module = Module {
    name: "xdistill_tree_sum",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/tree_sum.ptx")),
};

pub const PHASE_MARK: Module = Module {
    name: "xdistill_phase_mark",
    ptx: include_str!(concat!(env!("OUT_DIR"), "/phase_mark.ptx")),
};

/// `function` of `module` on `dev`, loaded on first use.
pub fn function(dev: &CudaDevice, module: &Module, function: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(function, module.name, module.ptx)?
        .into_cuda_function())
}
