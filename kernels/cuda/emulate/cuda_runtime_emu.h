// A host emulation of the CUDA features the kernels of ../src use, so that their logic runs
// (slowly) on a machine without a GPU: each block's blockDim.x threads are fibers on one OS
// thread (started on their own stacks by ucontext, switched by _setjmp/_longjmp, which unlike
// swapcontext make no system call for the signal mask: switching had been 85 % of topk_rows'
// harness), switched only at barriers: __syncthreads is a block-wide barrier and the warp
// intrinsics (shuffles, ballots) exchange through per-warp slots between warp-wide barriers.
// Blocks run one after another. Within a block the scheduler always runs the first thread that
// can run in a fixed order of priority, lowest id first in one block and highest first in the
// next (alternating from launch to launch), so a missing barrier shows on either side of it: a
// read before the write it waits for (the reader runs first in one of the orders), and a write
// of the next iteration over data a slower thread has yet to read (the writer runs as far as it
// can before the reader in one of the orders). `__shared__` variables become function statics:
// one copy per kernel instantiation, which is what shared memory is while one block runs at a
// time. A GPU's shared memory starts undefined: before each block the statics of plain kernels
// are filled with 0xff bytes (they share one linker section), so a read before any write gets
// garbage; a template's statics (GCC places them in their own groups, ignoring the section)
// keep the previous block's values. Not a simulator of timing, memory ordering beyond
// barriers, or occupancy: it checks what the code computes, the same way on every run.
// Removing any one of the kernels' 20 __syncthreads fails their harness but for one: the one
// before topk_rows' bitonic sort (topk_rows is a template: the padding it orders is what the
// previous block left there); replacing either of its two __syncthreads_or by its predicate
// deadlocks the block. A std::thread per thread, as before, missed three
// (which ones by chance) and took 4× as long.
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
// Shared memory: function statics gathered in one section (a template's excepted, above), so
// that the emulation can fill them with garbage before each block (the linker names the
// section's bounds __start_emu_shared and __stop_emu_shared).
#define __shared__ static __attribute__((section("emu_shared")))
#define __restrict__
#define __launch_bounds__(...)

struct emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
// The running thread's indices: the scheduler sets them at every switch.
inline emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;

extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

namespace emu {
constexpr unsigned kMaxThreads = 1024;

// Fills every kernel's shared memory with 0xff bytes (NaN floats, the largest integers): what a
// block reads before writing it is then garbage, not the previous block's values.
inline void poison_shared() {
    if (__start_emu_shared && __stop_emu_shared) {
        std::memset(__start_emu_shared, 0xff, size_t(__stop_emu_shared - __start_emu_shared));
    }
}

// A barrier of `expected` threads: each arrival but the last parks its thread; the last one
// makes them all runnable again and goes back to the scheduler, which picks by priority.
struct Barrier {
    unsigned expected = 0, arrived = 0;
    std::vector<unsigned> waiting;
};

struct Block {
    static constexpr size_t kStack = 256 << 10;  // per thread: the kernels' locals and the closure
    std::vector<ucontext_t> ctx;  // a thread's start on its stack, entered once
    struct Resume {
        jmp_buf at;
    };
    std::vector<Resume> resume;  // where a parked thread goes on
    std::vector<bool> started;
    std::vector<std::unique_ptr<char[]>> stacks;
    uint64_t runnable[kMaxThreads / 64];  // bit t: thread t can run (neither parked nor done)
    ucontext_t first_entry;  // what a thread's first entry saves (never resumed)
    jmp_buf scheduler;       // where every thread's switch goes back to
    unsigned current = 0;
    Barrier all;
    // __syncthreads_or: the OR of generation g's predicates is or_acc[g % 2]; the last thread to
    // arrive at one clears the next one's (every thread has read it by then).
    unsigned or_gen = 0;
    int or_acc[2] = {0, 0};
    std::vector<Barrier> warps;
    uint64_t slots[kMaxThreads];  // one per thread: what a warp exchange passes on
    void (*body)(void *) = nullptr;
    void *closure = nullptr;

    void set(unsigned t, bool on) {
        if (on) runnable[t / 64] |= uint64_t(1) << (t % 64);
        else runnable[t / 64] &= ~(uint64_t(1) << (t % 64));
    }
    // The runnable thread first in the order of priority (lowest or highest id), or -1.
    int next(bool lowest_first) const {
        constexpr int words = kMaxThreads / 64;
        for (int i = 0; i < words; ++i) {
            int w = lowest_first ? i : words - 1 - i;
            if (runnable[w]) return 64 * w + (lowest_first ? __builtin_ctzll(runnable[w]) : 63 - __builtin_clzll(runnable[w]));
        }
        return -1;
    }
};
inline Block *block = nullptr;
inline unsigned launches = 0;
inline int lane() { return threadIdx.x & 31; }
inline int warp() { return threadIdx.x >> 5; }

inline void arrive_and_wait(Barrier &b) {
    Block &blk = *block;
    unsigned me = blk.current;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        for (unsigned t : b.waiting) blk.set(t, true);
        b.waiting.clear();
    } else {
        b.waiting.push_back(me);
        blk.set(me, false);
    }
    if (_setjmp(blk.resume[me].at) == 0) _longjmp(blk.scheduler, 1);
}
inline void warp_sync() { arrive_and_wait(block->warps[warp()]); }

// A thread's fiber: runs the kernel, then goes back to the scheduler for good (its stack is
// abandoned; the next block starts it afresh).
inline void thread_main() {
    block->body(block->closure);
    block->set(block->current, false);
    _longjmp(block->scheduler, 1);
}

// Runs `kernel` (a closure calling the kernel function) over `grid` blocks of `threads` threads,
// one block at a time, each thread a fiber that runs until it finishes or reaches a barrier.
template <typename F>
void launch(unsigned grid, unsigned threads, F kernel) {
    if (threads == 0 || threads > kMaxThreads) {
        std::fprintf(stderr, "emulation: %u threads per block (1 to %u)\n", threads, kMaxThreads);
        std::abort();
    }
    gridDim.x = grid;
    blockDim.x = threads;
    Block blk;
    blk.ctx.resize(threads);
    blk.resume.resize(threads);
    for (unsigned t = 0; t < threads; ++t) blk.stacks.emplace_back(new char[Block::kStack]);
    blk.body = [](void *k) { (*static_cast<F *>(k))(); };
    blk.closure = &kernel;
    block = &blk;
    for (unsigned b = 0; b < grid; ++b) {
        const bool lowest_first = (launches + b) % 2 == 0;
        blk.all = Barrier{threads};
        blk.or_gen = 0;
        blk.or_acc[0] = blk.or_acc[1] = 0;
        blk.warps.clear();
        for (unsigned w = 0; w < (threads + 31) / 32; ++w) blk.warps.push_back(Barrier{std::min(32u, threads - 32 * w)});
        std::memset(blk.runnable, 0, sizeof blk.runnable);
        blk.started.assign(threads, false);
        for (unsigned t = 0; t < threads; ++t) {
            getcontext(&blk.ctx[t]);
            blk.ctx[t].uc_stack.ss_sp = blk.stacks[t].get();
            blk.ctx[t].uc_stack.ss_size = Block::kStack;
            blk.ctx[t].uc_link = nullptr;  // thread_main never returns
            makecontext(&blk.ctx[t], thread_main, 0);
            blk.set(t, true);
        }
        blockIdx.x = b;
        poison_shared();
        unsigned parked_total = 0;
        for (int t; (t = blk.next(lowest_first)) >= 0;) {
            blk.current = unsigned(t);
            threadIdx.x = unsigned(t);
            // A thread's switch back lands here (with 1); `t` is chosen again above.
            if (_setjmp(blk.scheduler) == 0) {
                if (!blk.started[t]) {
                    blk.started[t] = true;
                    swapcontext(&blk.first_entry, &blk.ctx[t]);
                } else {
                    _longjmp(blk.resume[t].at, 1);
                }
            }
        }
        parked_total = blk.all.arrived;
        for (auto &w : blk.warps) parked_total += w.arrived;
        if (parked_total) {
            std::fprintf(stderr, "emulation: block %u deadlocked: %u threads wait at barriers that cannot complete\n", b,
                         parked_total);
            std::abort();
        }
    }
    ++launches;
    block = nullptr;
}
}  // namespace emu

inline void __syncthreads() { emu::arrive_and_wait(emu::block->all); }
// A block-wide barrier that returns whether any thread's predicate was non-zero.
inline int __syncthreads_or(int p) {
    emu::Block &blk = *emu::block;
    const unsigned g = blk.or_gen & 1;
    blk.or_acc[g] |= p != 0;
    if (blk.all.arrived + 1 == blk.all.expected) {
        blk.or_gen += 1;
        blk.or_acc[g ^ 1] = 0;
    }
    emu::arrive_and_wait(blk.all);
    return blk.or_acc[g];
}

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
// Lane l gets the mask of the warp's lanes whose value equals its own.
inline uint32_t __match_any_sync(unsigned, uint32_t v) {
    emu::block->slots[threadIdx.x] = v;
    emu::warp_sync();
    uint32_t bits = 0;
    int base = emu::warp() * 32;
    for (int l = 0; l < 32; ++l) bits |= (uint32_t(emu::block->slots[base + l]) == v ? 1u : 0u) << l;
    emu::warp_sync();
    return bits;
}
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
// 1 + the index of the lowest set bit; 0 for none.
inline int __ffs(uint32_t x) { return x ? __builtin_ctz(x) + 1 : 0; }
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
