//! Compiles the cuDNN shim (src/sdpa.cpp) when the `cuda` feature is on. The headers come from
//! PyPI wheels that `scripts/build-cuda.sh` unpacks (the cuDNN frontend, cuDNN's own, CUDA's);
//! it passes their folders in `XDISTILL_CUDNN_INCLUDE` (`:`-separated) and `CUDA_HOME`.
fn main() {
    println!("cargo:rerun-if-changed=src/sdpa.cpp");
    println!("cargo:rerun-if-env-changed=XDISTILL_CUDNN_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let Some(dirs) = std::env::var_os("XDISTILL_CUDNN_INCLUDE") else {
        panic!(
            "XDISTILL_CUDNN_INCLUDE is not set: build the CUDA variant with scripts/build-cuda.sh, \
             which fetches the cuDNN headers and sets it"
        );
    };
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .file("src/sdpa.cpp")
        .warnings(false)
        // The frontend is header-only and large: optimise it even in debug builds, once.
        .opt_level(2);
    for dir in std::env::split_paths(&dirs) {
        build.include(dir);
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        build.include(std::path::Path::new(&home).join("include"));
    }
    build.compile("xdistill_cudnn_sdpa");
    // The shim dlopens cuDNN and the CUDA runtime itself (the frontend's dynamic loading).
    println!("cargo:rustc-link-lib=dl");
}
