//! The CUDA kernels' logic on a machine without a GPU: each `.cu` compiled for the host against
//! `emulate/cuda_runtime_emu.h` (a block's threads as fibers with real barriers and warp
//! exchanges) and checked against a double-precision reference by `emulate/run.sh` (g++ with
//! C++20). The GPU itself runs the same checks in `shared/tests/cuda_kernels.rs`
//! (`scripts/gpu-check.sh`). About 16 s of CPU on an idle 2-core Xeon (2026-12-01): 9.3 s of
//! compilation, 6.4 s of runs, 4.5 of them `topk_rows`, whose 1,024-thread blocks spend about 85 %
//! of it switching fibers (perf: glibc's `swapcontext` and the signal-mask system call it makes
//! at every switch), 5 % in the kernel's own code.

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
