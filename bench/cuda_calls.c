// Counts the CUDA driver calls a process makes between cuProfilerStart and cuProfilerStop (the
// range `trainer bench-step --profiler-range` marks around its timed steps): the host's waits (stream, context
// and event synchronisations), device-to-host copies (cudarc's end with a stream
// synchronisation: each is a wait too), host-to-device copies, kernel launches and allocations.
// Loaded with LD_PRELOAD; prints one line to stderr at each cuProfilerStop:
//
//   cc -shared -fPIC -O2 -o libcuda_calls.so bench/cuda_calls.c -ldl
//   LD_PRELOAD=$PWD/libcuda_calls.so trainer bench-step --device cuda --profiler-range ...
//
// What it sees: the calls the binary makes through libcuda's exported symbols (cudarc links them
// dynamically): candle's and the project's launches, copies and waits. What it does not see:
// the kernels cuBLAS and cuDNN launch (the CUDA runtime calls the driver through a table of entry
// points, not the symbols); ncu counts those (scripts/gpu-check.sh step p). A host-to-device
// copy from pageable memory may wait too (counted apart). Checked without a GPU against a
// stand-in libcuda (launches, waits and copies inside and outside the range).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>

typedef int CUresult;

enum { SYNC, DTOH, HTOD, LAUNCH, ALLOC, FREE, KINDS };
static const char *const names[KINDS] = {"waits", "dtoh", "htod", "launches", "allocs", "frees"};
// Since the last cuProfilerStart (which zeroes them; cuProfilerStop prints them).
static atomic_ulong counts[KINDS];

static void count(int kind) { atomic_fetch_add_explicit(&counts[kind], 1, memory_order_relaxed); }

// The real function `name` (the next definition after this library's).
static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) {
        fprintf(stderr, "cuda_calls: no %s in the libraries after this one\n", name);
    }
    return f;
}

// Defines `name(params)` that counts `kind` and calls the real one with `args`.
#define WRAP(kind, name, params, args)                                       \
    CUresult name params {                                                   \
        static CUresult(*fn) params;                                         \
        if (!fn) fn = (CUresult(*) params)real(#name);                       \
        count(kind);                                                         \
        return fn ? fn args : 999; /* CUDA_ERROR_UNKNOWN */                  \
    }

WRAP(SYNC, cuStreamSynchronize, (void *s), (s))
WRAP(SYNC, cuCtxSynchronize, (void), ())
WRAP(SYNC, cuEventSynchronize, (void *e), (e))
WRAP(DTOH, cuMemcpyDtoH_v2, (void *dst, uint64_t src, size_t n), (dst, src, n))
WRAP(DTOH, cuMemcpyDtoHAsync_v2, (void *dst, uint64_t src, size_t n, void *s), (dst, src, n, s))
WRAP(HTOD, cuMemcpyHtoD_v2, (uint64_t dst, const void *src, size_t n), (dst, src, n))
WRAP(HTOD, cuMemcpyHtoDAsync_v2, (uint64_t dst, const void *src, size_t n, void *s), (dst, src, n, s))
WRAP(LAUNCH, cuLaunchKernel,
     (void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned smem,
      void *s, void **params, void **extra),
     (f, gx, gy, gz, bx, by, bz, smem, s, params, extra))
WRAP(LAUNCH, cuLaunchKernelEx, (const void *config, void *f, void **params, void **extra),
     (config, f, params, extra))
WRAP(ALLOC, cuMemAlloc_v2, (uint64_t * p, size_t n), (p, n))
WRAP(ALLOC, cuMemAllocAsync, (uint64_t * p, size_t n, void *s), (p, n, s))
WRAP(FREE, cuMemFree_v2, (uint64_t p), (p))
WRAP(FREE, cuMemFreeAsync, (uint64_t p, void *s), (p, s))

CUresult cuProfilerStart(void) {
    static CUresult (*fn)(void);
    if (!fn) fn = (CUresult(*)(void))real("cuProfilerStart");
    for (int k = 0; k < KINDS; ++k) atomic_store(&counts[k], 0);
    return fn ? fn() : 0;
}

CUresult cuProfilerStop(void) {
    static CUresult (*fn)(void);
    if (!fn) fn = (CUresult(*)(void))real("cuProfilerStop");
    fprintf(stderr, "cuda calls in the profiled range:");
    for (int k = 0; k < KINDS; ++k) fprintf(stderr, " %s %lu", names[k], atomic_load(&counts[k]));
    fprintf(stderr, " (cuBLAS's and cuDNN's launches not seen)\n");
    return fn ? fn() : 0;
}
