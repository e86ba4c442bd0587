// A host emulation of the CUDA features the kernels of ../src use, so that their logic runs
// (slowly) on a machine without a GPU: each block is run by blockDim.x std::threads, one block
// after another, with __syncthreads a block-wide barrier and the warp intrinsics (shuffles,
// ballots) exchanged through per-warp slots between warp-wide barriers. `__shared__` variables
// become function statics: one copy per kernel instantiation, shared by the block's threads,
// which is what shared memory is while one block runs at a time. Not a simulator of timing,
// memory ordering beyond barriers, or occupancy: it checks what the code computes.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(n)

struct emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;

namespace emu {
struct Block {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    uint64_t slots[1024];  // one per thread: what a warp exchange passes on
};
inline Block *block = nullptr;
inline int lane() { return threadIdx.x & 31; }
inline int warp() { return threadIdx.x >> 5; }
inline void warp_sync() { block->warps[warp()]->arrive_and_wait(); }

// Runs `kernel` (a closure calling the kernel function) over `grid` blocks of `threads` threads:
// one std::thread per thread of a block, each running its part of every block in turn, with a
// barrier between blocks (so shared memory is one block's at a time).
template <typename F>
void launch(unsigned grid, unsigned threads, F kernel) {
    gridDim.x = grid;
    blockDim.x = threads;
    Block blk;
    blk.all = std::make_unique<std::barrier<>>(threads);
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) {
        blk.warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w)));
    }
    block = &blk;
    std::barrier<> block_done(threads);
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] {
            threadIdx.x = t;
            for (unsigned b = 0; b < grid; ++b) {
                blockIdx.x = b;
                kernel();
                block_done.arrive_and_wait();
            }
        });
    }
    for (auto &t : ts) t.join();
    block = nullptr;
}
}  // namespace emu

inline void __syncthreads() { emu::block->all->arrive_and_wait(); }

// Lane l gets lane l + o's value (its own where that is past the warp), any type up to 8 bytes.
template <typename T>
inline T __shfl_down_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) <= sizeof(uint64_t));
    std::memcpy(&emu::block->slots[threadIdx.x], &v, sizeof(T));
    emu::warp_sync();
    T r = v;
    if (emu::lane() + o < 32) std::memcpy(&r, &emu::block->slots[threadIdx.x + o], sizeof(T));
    emu::warp_sync();
    return r;
}
// Lane l gets lane (l xor m)'s value: the butterfly of a warp-wide reduction.
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
    static_assert(sizeof(T) <= sizeof(uint64_t));
    std::memcpy(&emu::block->slots[threadIdx.x], &v, sizeof(T));
    emu::warp_sync();
    T r;
    std::memcpy(&r, &emu::block->slots[emu::warp() * 32 + (emu::lane() ^ m)], sizeof(T));
    emu::warp_sync();
    return r;
}
inline uint32_t __ballot_sync(unsigned, bool p) {
    emu::block->slots[threadIdx.x] = p;
    emu::warp_sync();
    uint32_t bits = 0;
    int base = emu::warp() * 32;
    for (int l = 0; l < 32; ++l) bits |= (emu::block->slots[base + l] ? 1u : 0u) << l;
    emu::warp_sync();
    return bits;
}
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
inline uint32_t atomicAdd(uint32_t *p, uint32_t v) { return std::atomic_ref<uint32_t>(*p).fetch_add(v); }
inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Single roundings, as the _rn intrinsics (the host compiles without FMA contraction: -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
using std::min;
