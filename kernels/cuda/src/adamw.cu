// One AdamW step over many f32 tensors in one launch (a multi-tensor update): block b takes
// chunks b, b + gridDim.x, ... of a table the host builds each step, each chunk a range of one
// parameter with its gradient and moments. Per element, the same f32 operations in the same
// order as the CPU's in-place kernel (kernels/src/adamw.rs), each rounded on its own (the _rn
// intrinsics: no fused multiply-add), so both give the same bits:
//   g ← widen(g)                  (f32, or a bf16 or f16 gradient widened exactly: a step of
//                                  one micro-batch keeps the compute copies' gradients as the
//                                  backward made them, trainer/src/optim/accumulate.rs)
//   g ← g·s + 0                   (only when the step clips; as candle's affine)
//   m ← β1·m + (1−β1)·g
//   v ← β2·v + (1−β2)·g²
//   p ← p·decay − lr·(m·ibc1) / (√(v·ibc2) + ε)
//   c ← round(p)                  (only with a compute copy: bf16 or f16, to nearest even, as
//                                  candle's cast rounds; the forward then reads it in place)
// Chunk table: six u64 per chunk: the addresses of p, g, m, v and of the compute copy (0:
// none) at the chunk's start, and the chunk's length (bits 0-23) with the gradient's dtype
// (bits 24-25: 0 f32, 1 bf16, 2 f16) and the tensor's decay factor `1 − lr·wd` (high 32, f32
// bits). `copy_kind`: 1 the copies are bf16, 2 f16.
#include <stdint.h>

#include "dtype.cuh"

// The step's scalars, the same for every chunk.
struct AdamWArgs {
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, ibc1, ibc2, eps, scale;
    int clip, copy_kind;
};

template <typename G>
__device__ __forceinline__ void adamw_chunk(float *__restrict__ p, const G *__restrict__ g, float *__restrict__ m,
                                            float *__restrict__ v, uint64_t copy, uint32_t len, float decay,
                                            const AdamWArgs &a) {
    for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) {
        float gi = to_f32(g[i]);
        if (a.clip) gi = __fadd_rn(__fmul_rn(gi, a.scale), 0.0f);
        float mi = __fadd_rn(__fmul_rn(a.beta1, m[i]), __fmul_rn(a.one_minus_beta1, gi));
        float vi = __fadd_rn(__fmul_rn(a.beta2, v[i]), __fmul_rn(a.one_minus_beta2, __fmul_rn(gi, gi)));
        float step = __fdiv_rn(__fmul_rn(a.lr, __fmul_rn(mi, a.ibc1)), __fadd_rn(__fsqrt_rn(__fmul_rn(vi, a.ibc2)), a.eps));
        const float pi = __fsub_rn(__fmul_rn(p[i], decay), step);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (copy != 0 && a.copy_kind == 1) ((__nv_bfloat16 *)copy)[i] = from_f32<__nv_bfloat16>(pi);
        if (copy != 0 && a.copy_kind == 2) ((__half *)copy)[i] = from_f32<__half>(pi);
    }
}

extern "C" __global__ void adamw_f32(const uint64_t *__restrict__ chunks, uint32_t n_chunks, float lr, float beta1,
                                     float one_minus_beta1, float beta2, float one_minus_beta2, float ibc1,
                                     float ibc2, float eps, int clip, float scale, int copy_kind) {
    const AdamWArgs a{lr, beta1, one_minus_beta1, beta2, one_minus_beta2, ibc1, ibc2, eps, scale, clip, copy_kind};
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const uint64_t *e = chunks + 6 * (uint64_t)c;
        float *p = (float *)e[0];
        float *m = (float *)e[2];
        float *v = (float *)e[3];
        const uint64_t copy = e[4];
        const uint32_t len = (uint32_t)(e[5] & 0xffffffu);
        const uint32_t grad_kind = (uint32_t)((e[5] >> 24) & 3u);
        const float decay = __uint_as_float((uint32_t)(e[5] >> 32));
        if (grad_kind == 1) adamw_chunk(p, (const __nv_bfloat16 *)e[1], m, v, copy, len, decay, a);
        else if (grad_kind == 2) adamw_chunk(p, (const __half *)e[1], m, v, copy, len, decay, a);
        else adamw_chunk(p, (const float *)e[1], m, v, copy, len, decay, a);
    }
}
