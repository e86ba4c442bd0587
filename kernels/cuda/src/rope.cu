// Rotary position embedding (rotate-half form) on the heads of `[B, T, H, D]` positions, read and
// written through strides, so one kernel both rotates and moves the heads: the projections'
// `[B, T, H, D]` in, attention's `[B, H, T, D]` out (or any other arrangement of the three
// outer axes), no transposed copy first. The first 2·half dims of each head rotate, pairing
// dim j with dim j + half; the rest pass through (partial rotary):
//   y[j]        = x[j]·cos − x[j + half]·sin
//   y[j + half] = x[j + half]·cos + x[j]·sin          (j < half)
// with cos and sin from `[T, half]` tables, or `[B, T, half]` ones (per-row positions). The
// backward is the same kernel with the rotation inverted (sin_sign = −1: the transpose of a
// rotation), the gradient read in the output's arrangement and written in the input's.
// One thread per rotated pair or passed-through dim, f32 arithmetic, one rounding per output.
#include <stdint.h>

#include "dtype.cuh"

#define THREADS 256

// Where the (b, t, h) row of D values starts, in elements: strides of the three outer axes.
struct Strides {
    int64_t b, t, h;
};

template <typename T>
__device__ void rope(const T *__restrict__ x, Strides xs, const T *__restrict__ cos, const T *__restrict__ sin,
                     int64_t table_b, T *__restrict__ y, Strides ys, uint32_t nb, uint32_t nt, uint32_t nh,
                     uint32_t d, uint32_t half, float sin_sign) {
    const uint32_t per_row = d - half;  // half pairs, d − 2·half passed through
    const uint64_t idx = (uint64_t)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (uint64_t)nb * nt * nh * per_row) return;
    const uint32_t j = idx % per_row;
    const uint64_t row = idx / per_row;
    const uint32_t h = row % nh, t = (row / nh) % nt, b = row / ((uint64_t)nh * nt);
    const T *in = x + b * xs.b + t * xs.t + h * xs.h;
    T *out = y + b * ys.b + t * ys.t + h * ys.h;
    if (j < half) {
        const uint64_t at = b * table_b + (uint64_t)t * half + j;
        const float c = to_f32(cos[at]), s = sin_sign * to_f32(sin[at]);
        const float x1 = to_f32(in[j]), x2 = to_f32(in[j + half]);
        out[j] = from_f32<T>(x1 * c - x2 * s);
        out[j + half] = from_f32<T>(x2 * c + x1 * s);
    } else {
        out[j + half] = in[j + half];
    }
}

#define ROPE(SUFFIX, T)                                                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        rope_##SUFFIX(const T *x, int64_t xs_b, int64_t xs_t, int64_t xs_h, const T *cos, const T *sin,             \
                      int64_t table_b, T *y, int64_t ys_b, int64_t ys_t, int64_t ys_h, uint32_t nb, uint32_t nt,      \
                      uint32_t nh, uint32_t d, uint32_t half, float sin_sign) {                                       \
        rope<T>(x, Strides{xs_b, xs_t, xs_h}, cos, sin, table_b, y, Strides{ys_b, ys_t, ys_h}, nb, nt, nh, d, half,   \
                sin_sign);                                                                                            \
    }

ROPE(f32, float)
ROPE(bf16, __nv_bfloat16)
ROPE(f16, __half)
