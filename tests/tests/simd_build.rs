//! The binaries' SIMD kernels are compiled at their instruction sets. A vector intrinsic runs
//! at full speed only when it is inlined into a function compiled with its features; in one
//! without them (a closure or a `Fn::call` shim of a function that was only inlined into a
//! `#[target_feature]` one) it stays an out-of-line call that passes vectors through memory,
//! and `f32::mul_add` becomes a call to libm's `fmaf`. Both happened, silently: the teacher's
//! AVX2 matmul ran ~50x slower through `fmaf` (2026-11-30), and the AVX-512 LM head's `exp2`
//! closure made six intrinsic calls per vector of logits in dev and test builds, 5 % of the
//! Rust tests' CPU samples (2026-12-01). Whether the inliner got there depends on the build
//! profile, so this checks the binaries of the build the tests run (release builds: run it with
//! `--release`).

use std::path::Path;
use std::process::Command;

/// `nm ARGS BINARY`'s lines (binutils' `nm`, which the linker's toolchain brings).
fn nm(args: &[&str], binary: &Path) -> Vec<String> {
    let out = Command::new("nm")
        .args(args)
        .arg(binary)
        .output()
        .expect("`nm` (binutils) runs");
    assert!(
        out.status.success(),
        "nm {args:?} {}: {}",
        binary.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The out-of-line AVX-512F and FMA intrinsics `binary` defines and the libm fused
/// multiply-adds it imports.
fn uninlined(binary: &Path) -> Vec<String> {
    let mut found: Vec<String> = nm(&["--defined-only", "--demangle"], binary)
        .into_iter()
        .filter(|l| {
            l.contains("core::core_arch::x86::avx512f::")
                || l.contains("core::core_arch::x86::fma::")
        })
        .collect();
    found.extend(
        nm(&["--dynamic", "--undefined-only"], binary)
            .into_iter()
            .filter(|l| {
                let name = l.split_whitespace().last().unwrap_or("");
                let name = name.split('@').next().unwrap_or("");
                name == "fmaf" || name == "fma"
            }),
    );
    found
}

#[test]
#[cfg(target_arch = "x86_64")]
fn no_vector_intrinsic_or_fused_multiply_add_is_left_as_a_call() {
    for binary in [
        xdistill_testkit::teacher_binary(),
        xdistill_testkit::trainer_binary(),
    ] {
        let found = uninlined(&binary);
        assert!(
            found.is_empty(),
            "{} calls vector intrinsics or libm's fused multiply-add out of line, so a SIMD \
             kernel was compiled without its instruction set (a closure or `Fn` shim outside \
             the `#[target_feature]` function; see xdistill_cpu_kernels::simd_dispatch!):\n{}",
            binary.display(),
            found.join("\n")
        );
    }
}
