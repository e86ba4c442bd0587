//! The GPU check's host-side tools, where no GPU is: `bench/cuda_calls.c` (the driver calls
//! bench-step's timed steps make, `scripts/gpu-check.sh` step 4) built as the bundle builds it
//! and preloaded into a program linked against a stand-in libcuda: it counts exactly the calls
//! made between cuProfilerStart and cuProfilerStop, by kind, and passes every call on; and
//! `bench/ncu_kernels.py` (step p's table of an `ncu` log) cutting launches by the phase marks
//! (`xdistill_shared::profiling`); and every script a GPU call runs parses (a syntax error
//! found on a lent machine costs its whole call).

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

/// The files of `dir` (under the repository) ending in `ext`, sorted.
fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(repo().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    out.sort();
    out
}

/// Every shell script (`bash -n`) and Python file (compiled by `python3`, nothing imported or
/// run, so no PyTorch needed) the GPU check and the benchmarks run parses; a file broken on
/// purpose is refused by the same check (the test can fail).
#[test]
fn the_gpu_checks_scripts_parse() {
    let shell = files("scripts", "sh");
    let python: Vec<PathBuf> = ["bench", "scripts", "scripts/checks"]
        .iter()
        .flat_map(|d| files(d, "py"))
        .collect();
    assert!(
        shell.iter().any(|p| p.ends_with("scripts/gpu-check.sh"))
            && python.iter().any(|p| p.ends_with("bench/torch_step.py")),
        "{shell:?} {python:?}"
    );
    let bash_n = |p: &Path| Command::new("bash").arg("-n").arg(p).output().unwrap();
    // All compiled in memory by one interpreter (no __pycache__ written into the checkout).
    let compiles = |ps: &[PathBuf]| {
        Command::new("python3")
            .args([
                "-c",
                "import sys\nfor f in sys.argv[1:]: compile(open(f).read(), f, 'exec')",
            ])
            .args(ps)
            .output()
            .expect("python3 runs")
    };
    for p in &shell {
        let o = bash_n(p);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{}: {err}", p.display());
    }
    let o = compiles(&python);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = tempfile::tempdir().unwrap();
    let (bad_sh, bad_py) = (dir.path().join("bad.sh"), dir.path().join("bad.py"));
    std::fs::write(&bad_sh, "if true; then\n  echo unclosed\n").unwrap();
    std::fs::write(&bad_py, "def f(:\n    pass\n").unwrap();
    assert!(!bash_n(&bad_sh).status.success());
    assert!(!compiles(&[python[0].clone(), bad_py]).status.success());
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

/// A per-launch `ncu --csv` log as step p writes it: ncu's own lines, then one row per launch.
fn ncu_csv(launches: &[(&str, &str, &str)]) -> String {
    let mut csv = String::from(
        "==PROF== Connected to process 4242 (/tmp/trainer)\n==PROF== Disconnected\n\
         \"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\
         \"Stream\",\"Block Size\",\"Grid Size\",\"Device\",\"CC\",\"Section Name\",\
         \"Metric Name\",\"Metric Unit\",\"Metric Value\"\n",
    );
    for (i, (name, unit, value)) in launches.iter().enumerate() {
        csv.push_str(&format!(
            "\"{i}\",\"4242\",\"trainer\",\"127.0.0.1\",\"{name}\",\"1\",\"7\",\
             \"(256, 1, 1)\",\"(8, 1, 1)\",\"0\",\"9.0\",\"Command line profiler metrics\",\
             \"gpu__time_duration.sum\",\"{unit}\",\"{value}\"\n"
        ));
    }
    csv
}

#[test]
fn ncu_kernels_cuts_launches_by_phase_marks() {
    // Two steps' launches: work before any mark, phases with a nested region (accumulate
    // inside backward, the backward's mark again after it), times in ns and us with ncu's
    // thousands separators.
    let step: &[(&str, &str, &str)] = &[
        ("cast_f32_bf16", "nsecond", "1,500"),
        ("xd_phase_forward", "nsecond", "900"),
        ("void gemm_kernel<bf16>(int, float)", "usecond", "12.5"),
        ("rms_norm_fwd_bf16", "nsecond", "2,000"),
        ("xd_phase_none", "nsecond", "800"),
        ("xd_phase_backward", "nsecond", "800"),
        ("badd_bf16", "nsecond", "4,000"),
        ("xd_phase_accumulate", "nsecond", "700"),
        ("grad_accumulate_bf16", "usecond", "3"),
        ("xd_phase_backward", "nsecond", "700"),
        ("badd_bf16", "nsecond", "6,000"),
        ("xd_phase_none", "nsecond", "700"),
    ];
    let launches: Vec<_> = step.iter().chain(step).copied().collect();
    // The reference: each launch goes to the last mark before it, the marks to none, in µs.
    let mut want: std::collections::BTreeMap<&str, (u32, f64)> = Default::default();
    let mut phase = "none";
    for (name, unit, value) in &launches {
        if let Some(p) = name.strip_prefix("xd_phase_") {
            phase = p;
            continue;
        }
        let v: f64 = value.replace(',', "").parse().unwrap();
        let us = if *unit == "usecond" { v } else { v / 1e3 };
        let e = want.entry(phase).or_default();
        e.0 += 1;
        e.1 += us;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ncu.csv");
    std::fs::write(&log, ncu_csv(&launches)).unwrap();
    let out = Command::new("python3")
        .arg(repo().join("bench/ncu_kernels.py"))
        .arg(&log)
        .args(["--per", "2", "--phases", "--label", "step"])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let mut got: std::collections::BTreeMap<String, (u64, f64)> = Default::default();
    let mut total = None;
    for line in stdout.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        match v["phase"].as_str() {
            Some(p) => {
                got.insert(
                    p.to_string(),
                    (
                        v["launches"].as_u64().unwrap(),
                        v["kernel_ms"].as_f64().unwrap(),
                    ),
                );
            }
            None => {
                total = Some((
                    v["launches"].as_u64().unwrap(),
                    v["kernel_ms"].as_f64().unwrap(),
                ))
            }
        }
    }
    assert_eq!(got.len(), want.len(), "{stdout}");
    for (p, (n, us)) in &want {
        let (gn, gms) = got[*p];
        assert_eq!(gn, u64::from(*n) / 2, "{p}: {stdout}");
        assert!(
            (gms - us / 2.0 / 1e3).abs() < 1e-6,
            "{p}: {gms} ms, {stdout}"
        );
    }
    // The marks are left out of the totals too.
    let (n, us) = want.values().fold((0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    let (tn, tms) = total.expect("the totals' line");
    assert_eq!(tn, u64::from(n) / 2);
    // (Rounded to the µs there.)
    assert!((tms - us / 2.0 / 1e3).abs() <= 5e-4, "{tms}: {stdout}");
    assert!(!stdout.contains("xd_phase"), "{stdout}");

    // A log without marks is refused with what to set.
    std::fs::write(&log, ncu_csv(&step[..1])).unwrap();
    let out = Command::new("python3")
        .arg(repo().join("bench/ncu_kernels.py"))
        .arg(&log)
        .arg("--phases")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("XDISTILL_PHASE_MARKS=on"));
}
