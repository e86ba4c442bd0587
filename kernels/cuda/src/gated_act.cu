// The gated MLP's `act(gate) · up` over `[rows, width]` and its backward, one thread per element.
// `gate` and `up` are read through a row stride, so the two halves of a fused gate_up projection
// (Phi-3's `[rows, 2·width]`) need no copy. act: 0 SiLU, 1 GELU (tanh approximation, Gemma's),
// 2 GELU (erf). f32 arithmetic, one rounding per output (the composed ops round twice).
// Backward, from the output's gradient gy: dgate = gy·up·act'(gate), dup = gy·act(gate), written
// to one buffer `[2, rows, width]` (dgate, then dup).
#include <stdint.h>

#include "dtype.cuh"

#define THREADS 256
#define SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_C 0.044715f
#define SQRT_HALF 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

// act(g) and act'(g).
__device__ __forceinline__ void activate(float g, int act, float &a, float &da) {
    if (act == 0) {
        const float s = 1.0f / (1.0f + expf(-g));
        a = g * s;
        da = s * (1.0f + g * (1.0f - s));
    } else if (act == 1) {
        const float t = tanhf(SQRT_2_OVER_PI * (g + GELU_C * g * g * g));
        a = 0.5f * g * (1.0f + t);
        da = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * g * g);
    } else {
        const float e = erff(g * SQRT_HALF);
        a = 0.5f * g * (1.0f + e);
        da = 0.5f * (1.0f + e) + g * expf(-0.5f * g * g) * INV_SQRT_2PI;
    }
}

template <typename T>
__device__ void gated_act_fwd(const T *__restrict__ gate, int64_t gate_rs, const T *__restrict__ up, int64_t up_rs,
                              T *__restrict__ y, uint32_t rows, uint32_t width, int act) {
    const uint64_t idx = (uint64_t)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (uint64_t)rows * width) return;
    const uint64_t r = idx / width, i = idx % width;
    float a, da;
    activate(to_f32(gate[r * gate_rs + i]), act, a, da);
    y[idx] = from_f32<T>(a * to_f32(up[r * up_rs + i]));
}

template <typename T>
__device__ void gated_act_bwd(const T *__restrict__ gy, const T *__restrict__ gate, int64_t gate_rs,
                              const T *__restrict__ up, int64_t up_rs, T *__restrict__ out, uint32_t rows,
                              uint32_t width, int act) {
    const uint64_t n = (uint64_t)rows * width;
    const uint64_t idx = (uint64_t)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= n) return;
    const uint64_t r = idx / width, i = idx % width;
    float a, da;
    activate(to_f32(gate[r * gate_rs + i]), act, a, da);
    const float g = to_f32(gy[idx]);
    out[idx] = from_f32<T>(g * to_f32(up[r * up_rs + i]) * da);
    out[n + idx] = from_f32<T>(g * a);
}

#define GATED_ACT(SUFFIX, T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) gated_act_fwd_##SUFFIX(                                    \
        const T *gate, int64_t gate_rs, const T *up, int64_t up_rs, T *y, uint32_t rows, uint32_t width, int act) {  \
        gated_act_fwd<T>(gate, gate_rs, up, up_rs, y, rows, width, act);                                              \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        gated_act_bwd_##SUFFIX(const T *gy, const T *gate, int64_t gate_rs, const T *up, int64_t up_rs, T *out,      \
                               uint32_t rows, uint32_t width, int act) {                                             \
        gated_act_bwd<T>(gy, gate, gate_rs, up, up_rs, out, rows, width, act);                                        \
    }

GATED_ACT(f32, float)
GATED_ACT(bf16, __nv_bfloat16)
GATED_ACT(f16, __half)
