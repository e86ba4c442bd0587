// Host stand-in for CUDA's bf16 type (see cuda_runtime_emu.h): storage and conversions.
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
    uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even, as CUDA's __float2bfloat16.
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{uint16_t(u >> 16)};
}
