// Σ g² of many tensors (f32, bf16 or f16: a step of one micro-batch keeps the compute copies'
// gradients as the backward made them) in one launch: block b sums chunk b of a table the host
// builds (two u64 per chunk: the address of its first element, and its length (bits 0-23) with
// its dtype (bits 24-25: 0 f32, 1 bf16, 2 f16)) in f64, threads strided then a fixed tree, into
// out[b]; the host adds a tensor's chunks in order. Each element is widened exactly, so a bf16
// gradient's sum has the bits of its f32 widening's. The same bits every run and for any other
// tensors in the table.
#include <stdint.h>

#include "dtype.cuh"

#define THREADS 256

template <typename T> __device__ __forceinline__ double sum_squares_strided(const T *__restrict__ x, uint32_t len) {
    double acc = 0.0;
    for (uint32_t i = threadIdx.x; i < len; i += THREADS) {
        const double xi = (double)to_f32(x[i]);
        acc += xi * xi;
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    sum_squares(const uint64_t *__restrict__ chunks, uint32_t n_chunks, double *__restrict__ out) {
    __shared__ double warp_sum[THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const uint64_t at = chunks[2 * (uint64_t)c], word = chunks[2 * (uint64_t)c + 1];
        const uint32_t len = (uint32_t)(word & 0xffffffu), kind = (uint32_t)((word >> 24) & 3u);
        double acc = kind == 1   ? sum_squares_strided((const __nv_bfloat16 *)at, len)
                     : kind == 2 ? sum_squares_strided((const __half *)at, len)
                                 : sum_squares_strided((const float *)at, len);
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if (lane == 0) warp_sum[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int w = 0; w < THREADS / 32; ++w) total += warp_sum[w];
            out[c] = total;
        }
        __syncthreads();
    }
}
