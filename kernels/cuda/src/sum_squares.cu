// Σ g² of many f32 tensors in one launch: block b sums chunk b of a table the host builds
// (two u64 per chunk: the address of its first element and its length) in f64, threads
// strided then a fixed tree, into out[b]; the host adds a tensor's chunks in order. The same
// bits every run and for any other tensors in the table.
#include <stdint.h>

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
    sum_squares_f32(const uint64_t *__restrict__ chunks, uint32_t n_chunks, double *__restrict__ out) {
    __shared__ double warp_sum[THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const float *x = (const float *)chunks[2 * (uint64_t)c];
        const uint32_t len = (uint32_t)chunks[2 * (uint64_t)c + 1];
        double acc = 0.0;
        for (uint32_t i = threadIdx.x; i < len; i += THREADS) {
            double xi = (double)x[i];
            acc += xi * xi;
        }
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
