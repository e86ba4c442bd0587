//! The CUDA kernels' logic on a machine without a GPU: each `.cu` compiled for the host against
//! `emulate/cuda_runtime_emu.h` (a block's threads as fibers with real barriers and warp
//! exchanges) and checked against a double-precision reference by `emulate/run.sh` (g++ with
//! C++20). The GPU itself runs the same checks in `shared/tests/cuda_kernels.rs`
//! (`scripts/gpu-check.sh`). About 9 s on an idle 2-core machine: 7 s of compilation, 2 s of runs.

use std::process::Command;

#[test]
fn kernels_equal_their_references_in_the_host_emulation() {
    let dir = std::env::temp_dir().join(format!("xdistill-cuda-emulate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/emulate/run.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(&dir)
        .output()
        .expect("bash runs emulate/run.sh");
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "emulate/run.sh failed:\n{text}");
    assert!(text.contains("all cases equal the reference"), "{text}");
}
