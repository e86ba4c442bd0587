// One AdamW step over many f32 tensors in one launch (a multi-tensor update): block b takes
// chunks b, b + gridDim.x, ... of a table the host builds each step, each chunk a range of one
// parameter with its gradient and moments. Per element, the same f32 operations in the same
// order as the CPU's in-place kernel (kernels/src/adamw.rs), each rounded on its own (the _rn
// intrinsics: no fused multiply-add), so both give the same bits:
//   g ← g·s + 0                   (only when the step clips; as candle's affine)
//   m ← β1·m + (1−β1)·g
//   v ← β2·v + (1−β2)·g²
//   p ← p·decay − lr·(m·ibc1) / (√(v·ibc2) + ε)
//   c ← round(p)                  (only with a compute copy: bf16 or f16, to nearest even, as
//                                  candle's cast rounds; the forward then reads it in place)
// Chunk table: six u64 per chunk: the addresses of p, g, m, v and of the compute copy (0:
// none) at the chunk's start, and the chunk's length (low 32 bits) with the tensor's decay
// factor `1 − lr·wd` (high 32, f32 bits). `copy_kind`: 1 the copies are bf16, 2 f16.
#include <stdint.h>

#include "dtype.cuh"

extern "C" __global__ void adamw_f32(const uint64_t *__restrict__ chunks, uint32_t n_chunks, float lr, float beta1,
                                     float one_minus_beta1, float beta2, float one_minus_beta2, float ibc1,
                                     float ibc2, float eps, int clip, float scale, int copy_kind) {
    for (uint32_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const uint64_t *e = chunks + 6 * (uint64_t)c;
        float *p = (float *)e[0];
        const float *g = (const float *)e[1];
        float *m = (float *)e[2];
        float *v = (float *)e[3];
        const uint64_t copy = e[4];
        const uint32_t len = (uint32_t)(e[5] & 0xffffffffu);
        const float decay = __uint_as_float((uint32_t)(e[5] >> 32));
        for (uint32_t i = threadIdx.x; i < len; i += blockDim.x) {
            float gi = g[i];
            if (clip) gi = __fadd_rn(__fmul_rn(gi, scale), 0.0f);
            float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(one_minus_beta1, gi));
            float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(one_minus_beta2, __fmul_rn(gi, gi)));
            float step = __fdiv_rn(__fmul_rn(lr, __fmul_rn(mi, ibc1)), __fadd_rn(__fsqrt_rn(__fmul_rn(vi, ibc2)), eps));
            const float pi = __fsub_rn(__fmul_rn(p[i], decay), step);
            p[i] = pi;
            m[i] = mi;
            v[i] = vi;
            if (copy != 0 && copy_kind == 1) ((__nv_bfloat16 *)copy)[i] = from_f32<__nv_bfloat16>(pi);
            if (copy != 0 && copy_kind == 2) ((__half *)copy)[i] = from_f32<__half>(pi);
        }
    }
}
