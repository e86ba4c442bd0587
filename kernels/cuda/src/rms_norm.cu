// RMSNorm over the last dimension of `[rows, dim]` rows of T (f32, bf16, f16) and its backward,
// with the statistics in f32 and one rounding per output (the composed ops round after each):
//   Llama: y = round(x·r)·w          (normalised, cast, then scaled in T, as transformers does)
//   Gemma: y = round(x·r·(1 + w))    (plus_one: scaled in f32, then cast)
// with r = 1 / sqrt(mean(x²) + eps). One warp per row; the row's sums are a butterfly over the
// warp (every lane ends with the same bits), so a row's result depends on that row alone.
//
// Backward, from the output's gradient g (dn = g·w, or g·(1 + w)):
//   dx = r·dn − x·r³·Σ(dn·x)/dim                                 (rms_norm_bwd_*: a warp per row)
//   dw = Σ_rows g·round(x·r)  (Llama)  or  Σ_rows g·x·r (Gemma)    (two passes over columns:
// per group of rows a partial sum in f32, then the groups in order: deterministic, no atomics).
#include <stdint.h>

#include "dtype.cuh"

#define THREADS 256
#define ROWS_PER_BLOCK (THREADS / 32)

// The sum over the warp, the same bits in every lane (each step adds a pair in both orders).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// 1 / sqrt(mean(x²) + eps) of one row, in every lane of the warp.
template <typename T>
__device__ __forceinline__ float row_rstd(const T *__restrict__ xr, uint32_t dim, float eps, int lane) {
    float ss = 0.0f;
    for (uint32_t i = lane; i < dim; i += 32) {
        float v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

// The weight's factor: w, or 1 + w (Gemma).
__device__ __forceinline__ float scale_of(float w, int plus_one) { return plus_one ? 1.0f + w : w; }

template <typename T>
__device__ void rms_norm_fwd(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y, uint32_t rows,
                             uint32_t dim, float eps, int plus_one) {
    const uint32_t row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // the whole warp: one row per warp
    const T *xr = x + (uint64_t)row * dim;
    T *yr = y + (uint64_t)row * dim;
    const float r = row_rstd(xr, dim, eps, lane);
    for (uint32_t i = lane; i < dim; i += 32) {
        const float n = to_f32(xr[i]) * r, wi = to_f32(w[i]);
        yr[i] = plus_one ? from_f32<T>(n * (1.0f + wi)) : from_f32<T>(to_f32(from_f32<T>(n)) * wi);
    }
}

// dx of each row, and r per row (f32) for the weight's gradient.
template <typename T>
__device__ void rms_norm_bwd_dx(const T *__restrict__ g, const T *__restrict__ x, const T *__restrict__ w,
                                T *__restrict__ dx, float *__restrict__ rstd, uint32_t rows, uint32_t dim, float eps,
                                int plus_one) {
    const uint32_t row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T *xr = x + (uint64_t)row * dim, *gr = g + (uint64_t)row * dim;
    T *out = dx + (uint64_t)row * dim;
    const float r = row_rstd(xr, dim, eps, lane);
    float dot = 0.0f;
    for (uint32_t i = lane; i < dim; i += 32) dot += to_f32(gr[i]) * scale_of(to_f32(w[i]), plus_one) * to_f32(xr[i]);
    dot = warp_sum(dot);
    const float c = dot * (r * r * r) / (float)dim;
    for (uint32_t i = lane; i < dim; i += 32) {
        const float dn = to_f32(gr[i]) * scale_of(to_f32(w[i]), plus_one);
        out[i] = from_f32<T>(r * dn - to_f32(xr[i]) * c);
    }
    if (lane == 0) rstd[row] = r;
}

// Partial weight gradients: block b sums rows grp, grp + groups, ... of THREADS columns
// (tile = b mod tiles, grp = b / tiles) into part[grp, col].
template <typename T>
__device__ void rms_norm_dw_part(const T *__restrict__ g, const T *__restrict__ x, const float *__restrict__ rstd,
                                 float *__restrict__ part, uint32_t rows, uint32_t dim, uint32_t groups,
                                 int plus_one) {
    const uint32_t tiles = (dim + THREADS - 1) / THREADS;
    const uint32_t tile = blockIdx.x % tiles, grp = blockIdx.x / tiles;
    const uint32_t col = tile * THREADS + threadIdx.x;
    if (col >= dim || grp >= groups) return;
    float acc = 0.0f;
    for (uint32_t r = grp; r < rows; r += groups) {
        const uint64_t j = (uint64_t)r * dim + col;
        float n = to_f32(x[j]) * rstd[r];
        if (!plus_one) n = to_f32(from_f32<T>(n));
        acc += to_f32(g[j]) * n;
    }
    part[(uint64_t)grp * dim + col] = acc;
}

// dw[col] = Σ over the groups, in order.
template <typename T>
__device__ void rms_norm_dw_sum(const float *__restrict__ part, T *__restrict__ dw, uint32_t dim, uint32_t groups) {
    const uint32_t col = blockIdx.x * THREADS + threadIdx.x;
    if (col >= dim) return;
    float acc = 0.0f;
    for (uint32_t p = 0; p < groups; ++p) acc += part[(uint64_t)p * dim + col];
    dw[col] = from_f32<T>(acc);
}

#define RMS_NORM(SUFFIX, T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        rms_norm_fwd_##SUFFIX(const T *x, const T *w, T *y, uint32_t rows, uint32_t dim, float eps, int plus_one) {  \
        rms_norm_fwd<T>(x, w, y, rows, dim, eps, plus_one);                                                           \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        rms_norm_bwd_dx_##SUFFIX(const T *g, const T *x, const T *w, T *dx, float *rstd, uint32_t rows, uint32_t dim, \
                                 float eps, int plus_one) {                                                          \
        rms_norm_bwd_dx<T>(g, x, w, dx, rstd, rows, dim, eps, plus_one);                                              \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_dw_part_##SUFFIX(                                 \
        const T *g, const T *x, const float *rstd, float *part, uint32_t rows, uint32_t dim, uint32_t groups,        \
        int plus_one) {                                                                                               \
        rms_norm_dw_part<T>(g, x, rstd, part, rows, dim, groups, plus_one);                                           \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        rms_norm_dw_sum_##SUFFIX(const float *part, T *dw, uint32_t dim, uint32_t groups) {                           \
        rms_norm_dw_sum<T>(part, dw, dim, groups);                                                                    \
    }

RMS_NORM(f32, float)
RMS_NORM(bf16, __nv_bfloat16)
RMS_NORM(f16, __half)
