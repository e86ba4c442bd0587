// Host stand-in for CUDA's f16 type (see cuda_runtime_emu.h), through the compiler's _Float16.
#pragma once
struct __half {
    _Float16 v;
};
inline float __half2float(__half x) { return float(x.v); }
inline __half __float2half(float f) { return __half{_Float16(f)}; }
