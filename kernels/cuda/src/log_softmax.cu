// Row-wise log-softmax over the last dimension of f32 `[rows, dim]` and its backward, one block
// per row (the head + loss's hottest op after the LM-head matmul: a 152k-entry row per
// position). Forward: a running max and Σ exp per thread, a fixed tree over the block, then
// y = x − lse. Backward (the CPU kernel's, kernels/src/log_softmax.rs): gx = g − exp(y)·Σ g,
// with Σ g in f64. One read and one write per pass, no [rows, dim] temporaries; a row's result
// depends on that row alone.
#include <stdint.h>

#define THREADS 1024
#define WARPS (THREADS / 32)

__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
    else { s += s2 * expf(m2 - m); }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    log_softmax_f32(const float *__restrict__ x, float *__restrict__ y, uint32_t rows, uint32_t dim) {
    __shared__ float warp_m[WARPS], warp_s[WARPS];
    __shared__ float row_lse;
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float *xr = x + (uint64_t)r * dim;
    float *yr = y + (uint64_t)r * dim;
    float m = -INFINITY, s = 0.0f;
    for (uint32_t i = threadIdx.x; i < dim; i += THREADS) lse_merge(m, s, xr[i], 1.0f);
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    if (lane == 0) { warp_m[warp] = m; warp_s[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        m = warp_m[lane];
        s = warp_s[lane];
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
            lse_merge(m, s, m2, s2);
        }
        if (lane == 0) row_lse = m + logf(s);
    }
    __syncthreads();
    const float lse = row_lse;
    for (uint32_t i = threadIdx.x; i < dim; i += THREADS) yr[i] = xr[i] - lse;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    log_softmax_bwd_f32(const float *__restrict__ g, const float *__restrict__ y, float *__restrict__ gx,
                        uint32_t rows, uint32_t dim) {
    __shared__ double warp_sum[WARPS];
    __shared__ float row_sum;
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float *gr = g + (uint64_t)r * dim, *yr = y + (uint64_t)r * dim;
    float *out = gx + (uint64_t)r * dim;
    double acc = 0.0;
    for (uint32_t i = threadIdx.x; i < dim; i += THREADS) acc += (double)gr[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if (lane == 0) warp_sum[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < WARPS; ++w) total += warp_sum[w];
        row_sum = (float)total;
    }
    __syncthreads();
    const float sg = row_sum;
    for (uint32_t i = threadIdx.x; i < dim; i += THREADS) out[i] = gr[i] - expf(yr[i]) * sg;
}
