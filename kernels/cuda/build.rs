//! Compiles each `src/*.cu` to PTX with nvcc when the `cuda` feature is on; `src/ptx.rs` embeds
//! them. nvcc comes from the PyPI toolkit `scripts/build-cuda.sh` unpacks (`CUDA_HOME`, or on
//! `PATH`); the PTX targets `compute_$CUDA_COMPUTE_CAP` (default 90: H100/H200), which newer GPUs
//! JIT-compile. No fast math: the kernels' exp, log and division are IEEE's.
use std::path::PathBuf;
use std::process::Command;

/// The kernels, one `.cu` per op.
const KERNELS: &[&str] = &[
    "topk_rows",
    "adamw",
    "sum_squares",
    "log_softmax",
    "rms_norm",
    "rope",
    "gated_act",
    "topk_kd",
    "tree_sum",
    "grad_accumulate",
    "phase_mark",
];
/// Headers the kernels include.
const HEADERS: &[&str] = &["dtype.cuh"];

fn main() {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    for k in KERNELS {
        println!("cargo:rerun-if-changed=src/{k}.cu");
    }
    for h in HEADERS {
        println!("cargo:rerun-if-changed=src/{h}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = match std::env::var_os("CUDA_HOME") {
        Some(home) => PathBuf::from(home).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for k in KERNELS {
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(format!("src/{k}.cu"))
            .arg("-o")
            .arg(out.join(format!("{k}.ptx")))
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} ({e}): build the CUDA variant with scripts/build-cuda.sh, \
                     which fetches the toolkit and sets CUDA_HOME",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed on src/{k}.cu ({status})");
    }
}
