// Gradient accumulation for many tensors in one launch: per tensor, an f32 sum `dst` takes a
// gradient `src` (f32, bf16 or f16), widened exactly to f32, as its first value (`dst ← src`)
// or added to it (`dst ← dst + src`, one f32 add rounded on its own: candle's `s + g` after
// `g.to_dtype(f32)`, the same bits). Block b takes chunks b, b + gridDim.x, ... of a table the
// host builds: three u64 per chunk, the addresses of src and dst at the chunk's start, and its
// length (low 32 bits) with src's dtype (bits 32-33: 0 f32, 1 bf16, 2 f16) and the mode (bit
// 40: 1 adds). No two chunks write the same element, so the order of blocks does not matter.
#include <stdint.h>

#include "dtype.cuh"

template <typename T>
__device__ __forceinline__ void accumulate_chunk(const T *__restrict__ src, float *__restrict__ dst, uint32_t len,
                                                 bool add) {
    for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) {
        const float g = to_f32(src[i]);
        dst[i] = add ? __fadd_rn(dst[i], g) : g;
    }
}

extern "C" __global__ void grad_accumulate_f32(const uint64_t *__restrict__ chunks, uint32_t n_chunks) {
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const uint64_t *e = chunks + 3 * (uint64_t)c;
        float *dst = (float *)e[1];
        const uint32_t len = (uint32_t)(e[2] & 0xffffffffu);
        const uint32_t kind = (uint32_t)((e[2] >> 32) & 3u);
        const bool add = ((e[2] >> 40) & 1u) != 0;
        if (kind == 1) accumulate_chunk((const __nv_bfloat16 *)e[0], dst, len, add);
        else if (kind == 2) accumulate_chunk((const __half *)e[0], dst, len, add);
        else accumulate_chunk((const float *)e[0], dst, len, add);
    }
}
