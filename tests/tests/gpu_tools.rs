//! The GPU check's host-side tools, where no GPU is: `bench/cuda_calls.c` (the driver calls
//! bench-step's timed steps make, `scripts/gpu-check.sh` step 4) built as the bundle builds it
//! and preloaded into a program linked against a stand-in libcuda: it counts exactly the calls
//! made between cuProfilerStart and cuProfilerStop, by kind, and passes every call on.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `cc` with `args` in `dir`; panics with its output on failure.
fn cc(dir: &Path, args: &[&str]) {
    let out = Command::new("cc")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("cc (a C compiler) runs");
    assert!(
        out.status.success(),
        "cc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn cuda_calls_counts_the_profiled_range_and_passes_calls_on() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The stand-in driver: each call adds to a counter the program prints at the end, so that
    // a call the library swallowed instead of passing on shows.
    std::fs::write(
        d.join("fake.c"),
        r#"
#include <stdint.h>
#include <stddef.h>
int real_calls = 0;
int cuStreamSynchronize(void *s) { ++real_calls; return 0; }
int cuCtxSynchronize(void) { ++real_calls; return 0; }
int cuMemcpyDtoHAsync_v2(void *d, uint64_t s, size_t n, void *st) { ++real_calls; return 0; }
int cuMemcpyHtoDAsync_v2(uint64_t d, const void *s, size_t n, void *st) { ++real_calls; return 0; }
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                   unsigned h, void *s, void **p, void **x) { ++real_calls; return 0; }
int cuMemAllocAsync(uint64_t *p, size_t n, void *s) { ++real_calls; *p = 64; return 0; }
int cuMemFreeAsync(uint64_t p, void *s) { ++real_calls; return 0; }
int cuProfilerStart(void) { ++real_calls; return 0; }
int cuProfilerStop(void) { ++real_calls; return 0; }
"#,
    )
    .unwrap();
    std::fs::write(
        d.join("main.c"),
        r#"
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
extern int real_calls;
int cuStreamSynchronize(void *s); int cuCtxSynchronize(void);
int cuMemcpyDtoHAsync_v2(void *d, uint64_t s, size_t n, void *st);
int cuMemcpyHtoDAsync_v2(uint64_t d, const void *s, size_t n, void *st);
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                   unsigned h, void *s, void **p, void **x);
int cuMemAllocAsync(uint64_t *p, size_t n, void *s); int cuMemFreeAsync(uint64_t p, void *s);
int cuProfilerStart(void); int cuProfilerStop(void);
static void launch(void) { cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0); }
int main(void) {
    uint64_t p = 0;
    launch(); cuStreamSynchronize(0);                  /* before the range: not counted */
    cuProfilerStart();
    for (int i = 0; i < 7; ++i) launch();
    cuMemcpyHtoDAsync_v2(0, 0, 0, 0);
    cuMemAllocAsync(&p, 8, 0); cuMemFreeAsync(p, 0);
    cuMemcpyDtoHAsync_v2(0, 0, 0, 0); cuStreamSynchronize(0); cuCtxSynchronize();
    cuProfilerStop();
    launch();                                          /* after: not counted */
    printf("real calls %d, allocated %d\n", real_calls, (int)p);
    return 0;
}
"#,
    )
    .unwrap();
    cc(d, &["-shared", "-fPIC", "-o", "libcuda.so", "fake.c"]);
    cc(
        d,
        &[
            "-o",
            "main",
            "main.c",
            "-L.",
            "-lcuda",
            "-Wl,-rpath,$ORIGIN",
        ],
    );
    // As scripts/build-cuda.sh --bundle builds it.
    let src = repo().join("bench/cuda_calls.c");
    cc(
        d,
        &[
            "-shared",
            "-fPIC",
            "-O2",
            "-o",
            "libcuda_calls.so",
            src.to_str().unwrap(),
            "-ldl",
        ],
    );
    let out = Command::new(d.join("main"))
        .env("LD_PRELOAD", d.join("libcuda_calls.so"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stderr.trim(),
        "cuda calls in the profiled range: waits 2 dtoh 1 htod 1 launches 7 allocs 1 frees 1 \
         (cuBLAS's and cuDNN's launches not seen)"
    );
    // Every call reached the stand-in driver (18: 2 before the range, 15 in it with its start
    // and stop, 1 after), and its results came back (the allocation's address).
    assert_eq!(stdout.trim(), "real calls 18, allocated 64");
}
