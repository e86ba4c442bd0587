//! The CUDA kernels' logic on a machine without a GPU: each `.cu` compiled for the host against
//! `emulate/cuda_runtime_emu.h` (a block's threads as fibers with real barriers and warp
//! exchanges) and checked against a double-precision reference by `emulate/run.sh` (g++ with
//! C++20). The GPU itself runs the same checks in `shared/tests/cuda_kernels.rs`
//! (`scripts/gpu-check.sh`). About 12 s on an idle 2-core Xeon (2026-12-01): 9.3 s of
//! compilation, 2.3 s of runs. `topk_rows`' 1,024-thread blocks ran 4.5 s while fibers switched
//! by `swapcontext` (85 % of it: a signal-mask system call at every switch), 0.7 s by
//! `_setjmp`/`_longjmp` (the test 18.7 -> 11.7 s).

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
