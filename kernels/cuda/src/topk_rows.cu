// Per row of logits: the log-softmax statistics and the top k, one block of 1024 threads per row,
// with no host round trip and no sort of the whole row.
//
// For row r (its first `valid` columns; the rest is LM-head padding), with z = x / temperature
// in f32:
//   lse[r]    = log Σ exp(z)                     (a running max and sum per thread, then a tree)
//   target[r] = z[targets[r]] − lse[r]
//   rank[r]   = #{ v : z[v] ≥ z[targets[r]] }    (when ranks are asked for)
//   ids[r, :k], vals[r, :k]: the k largest z, by descending value, ties by ascending id; vals
//   are z − lse (log-probs) or z (scaled logits).
// The k-th largest value is found by a radix select on the order-preserving 32-bit keys of z
// (four 8-bit digits; the first digit's histogram is counted in the logsumexp's pass; digits
// whose z bits are 0 in every key sharing the prefix, as the low 16 of bf16 logits at
// temperature 1, are known and not counted), the elements above it gathered and the first ones
// equal to it compacted in id order, and those k sorted in shared memory (bitonic, k ≤ 4096). A histogram's increments are merged per warp first (lanes with the same
// digit: one atomic): a row's leading digits fall into a few bins, where one shared atomic per
// element serialised; past the first digit, a warp none of whose keys shares the prefix found so
// far counts nothing.
//
// Deterministic and batch-invariant by construction: a row's results depend on that row alone,
// every sum runs in a fixed order, ties are broken by id, and the order in which the compaction
// places the keys above the k-th is undone by the sort (by key, then id: a total order).
#include <stdint.h>

#include "dtype.cuh"

#define THREADS 1024
#define WARPS (THREADS / 32)
#define MAX_K 4096
// Elements a thread loads before it uses any of them, in the passes over a row: independent
// loads in flight instead of one (a block has one row; without them the passes waited on
// memory latency), and, in the logsumexp, as many independent running sums.
#define UNROLL 4

// Larger float, larger key (the IEEE total order: -0 below +0).
__device__ __forceinline__ uint32_t key_of(float z) {
    uint32_t b = __float_as_uint(z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Combines two (max, Σ exp(· − max)) pairs.
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
    else { s += s2 * expf(m2 - m); }
}

// Adds each lane's `bin` (256: none) to `hist`, one atomic per distinct bin of the warp. Every
// lane of the warp calls it together.
__device__ __forceinline__ void count_in(uint32_t *hist, uint32_t bin, int lane) {
    const uint32_t peers = __match_any_sync(0xffffffffu, bin);
    if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (uint32_t)__popc(peers));
}

// Whether (ka, ia) comes before (kb, ib): larger key first, then smaller id.
__device__ __forceinline__ bool before(uint32_t ka, uint32_t ia, uint32_t kb, uint32_t ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// z = x / temperature; with UNIT (temperature 1, the kernels the host picks then) x itself, the
// same value without a division's dozen instructions per element per pass.
template <bool UNIT, typename T>
__device__ __forceinline__ float scaled(T x, float temperature) {
    return UNIT ? to_f32(x) : to_f32(x) / temperature;
}

// The keys of a thread's UNROLL columns first, first + THREADS, …: all loads issued before any
// is used (0 past `valid`).
template <bool UNIT, typename T>
__device__ __forceinline__ void load_keys(const T *__restrict__ x, uint32_t first, uint32_t valid, float temperature,
                                          uint32_t (&keys)[UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const uint32_t i = first + u * THREADS;
        keys[u] = i < valid ? key_of(scaled<UNIT>(x[i], temperature)) : 0u;
    }
}

template <typename T, bool UNIT>
__device__ void topk_row(const T *__restrict__ logits, int64_t row_stride, const uint32_t *__restrict__ targets,
                         uint32_t n_rows, uint32_t valid, uint32_t k, float temperature, int logprobs, int want_ranks,
                         uint32_t *__restrict__ ids, float *__restrict__ vals, float *__restrict__ target_lp,
                         float *__restrict__ lse_out, uint32_t *__restrict__ ranks) {
    __shared__ float warp_m[WARPS], warp_s[WARPS];
    __shared__ uint32_t warp_a[WARPS], warp_b[WARPS];
    __shared__ uint32_t hist[256];
    __shared__ uint32_t sel_key[MAX_K], sel_id[MAX_K];
    __shared__ float row_lse;
    __shared__ uint32_t kth_bin, kth_left;
    __shared__ uint32_t n_gt;

    const uint32_t r = blockIdx.x;
    if (r >= n_rows) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const T *x = logits + (int64_t)r * row_stride;
    const uint32_t target = min(targets[r], valid - 1);
    const float z_target = scaled<UNIT>(x[target], temperature);

    // 1. logsumexp (and the target's rank): per thread, then per warp, then warp 0 over the warps;
    //    in the same read, the histogram of the keys' leading digit (step 2's first pass). The
    //    tiles span the block, so that every lane of a warp takes part in each `count_in`.
    for (int b = tid; b < 256; b += THREADS) hist[b] = 0;
    __syncthreads();
    float mu[UNROLL], su[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { mu[u] = -INFINITY; su[u] = 0.0f; }
    uint32_t at_least = 0;
    for (uint32_t tile = 0; tile < valid; tile += THREADS * UNROLL) {
        float zu[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t i = tile + u * THREADS + tid;
            zu[u] = i < valid ? scaled<UNIT>(x[i], temperature) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            uint32_t bin = 256u;
            if (tile + u * THREADS + tid < valid) {
                lse_merge(mu[u], su[u], zu[u], 1.0f);
                at_least += zu[u] >= z_target;
                bin = key_of(zu[u]) >> 24;
            }
            count_in(hist, bin, lane);
        }
    }
    float m = mu[0], s = su[0];
#pragma unroll
    for (int u = 1; u < UNROLL; ++u) lse_merge(m, s, mu[u], su[u]);
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
        at_least += __shfl_down_sync(0xffffffffu, at_least, o);
    }
    if (lane == 0) { warp_m[warp] = m; warp_s[warp] = s; warp_a[warp] = at_least; }
    __syncthreads();
    if (warp == 0) {
        m = warp_m[lane]; s = warp_s[lane]; at_least = warp_a[lane];
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
            lse_merge(m, s, m2, s2);
            at_least += __shfl_down_sync(0xffffffffu, at_least, o);
        }
        if (lane == 0) {
            n_gt = 0;
            float lse = m + logf(s);
            row_lse = lse;
            lse_out[r] = lse;
            target_lp[r] = z_target - lse;
            if (want_ranks) ranks[r] = at_least;
        }
    }
    __syncthreads();
    const float lse = row_lse;
    if (k == 0) return;

    // 2. The k-th largest key: four digits of 8 bits, most significant first (the first one's
    //    histogram from step 1). `left`: how many of the keys sharing the prefix found so far are
    //    still to be taken. A pass also finds whether the digits after its own vary among those
    //    keys: where they do not (bf16 logits at temperature 1: z's low 16 bits are 0, so the
    //    key's are the sign's, 0 or all ones), they are known and the select is over.
    uint32_t prefix = 0, left = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t rest = (1u << shift) - 1u;  // the digits after this one
        // A key's low bits xor this are z's (positive z: the key's; negative: ~the key's).
        const uint32_t fill = (prefix & 0x80000000u) ? 0u : 0xffffffffu;
        bool rest_fixed = false;
        if (shift != 24) {
            const uint32_t mask = ~((rest << 8) | 255u);  // the digits found so far
            for (int b = tid; b < 256; b += THREADS) hist[b] = 0;
            __syncthreads();
            uint32_t varies = 0;
            for (uint32_t tile = 0; tile < valid; tile += THREADS * UNROLL) {
                uint32_t keys[UNROLL];
                load_keys<UNIT>(x, tile + tid, valid, temperature, keys);
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const bool in = tile + u * THREADS + tid < valid && (keys[u] & mask) == prefix;
                    if (in) varies |= (keys[u] ^ fill) & rest;
                    // Past the first digit few keys share the prefix: a warp with none skips
                    // the match and the atomics (a warp-uniform branch).
                    if (__ballot_sync(0xffffffffu, in)) count_in(hist, in ? (keys[u] >> shift) & 255u : 256u, lane);
                }
            }
            rest_fixed = !__syncthreads_or(varies != 0);
        }  // (the first digit's histogram was complete at step 1's barriers)
        if (tid == 0) {
            uint32_t above = 0;
            int b = 255;
            for (; b > 0; --b) {
                if (above + hist[b] >= left) break;
                above += hist[b];
            }
            kth_bin = (uint32_t)b;
            kth_left = left - above;
        }
        __syncthreads();
        // kth_bin's next write waits at the next pass's two barriers: none needed after reading.
        prefix |= kth_bin << shift;
        left = kth_left;
        if (rest_fixed) {
            prefix |= fill & rest;
            break;
        }
    }
    const uint32_t kth = prefix;
    const uint32_t n_above = k - left;  // keys above kth: exactly k − (equal ones to take)

    // 3. Compaction. Each key above kth (there are n_above) takes a slot from a shared counter:
    //    the slots' order does not matter, step 4 sorts by (key, id). The first `left` keys equal
    //    to kth, in id order, follow them: an ordered compaction (a count per warp, a barrier, a
    //    scan over the warps' counts) run only over the tiles holding one while some are still
    //    to be taken; run over every tile, it was over half of the kernel's instructions.
    uint32_t base_eq = 0;
    for (uint32_t tile = 0; tile < valid; tile += THREADS * UNROLL) {
        uint32_t keys[UNROLL];
        load_keys<UNIT>(x, tile + tid, valid, temperature, keys);
        bool any_eq = false;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t i = tile + u * THREADS + tid;
            if (i < valid && keys[u] > kth) {
                const uint32_t slot = atomicAdd(&n_gt, 1u);
                sel_key[slot] = keys[u];
                sel_id[slot] = i;
            }
            any_eq |= i < valid && keys[u] == kth;
        }
        // Block-uniform: the barrier's OR and base_eq (the same sum in every thread).
        if (!__syncthreads_or(any_eq) || base_eq >= left) continue;
        const uint32_t below = (1u << lane) - 1u;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t i = tile + u * THREADS + tid;
            const bool eq = i < valid && keys[u] == kth;
            const uint32_t be = __ballot_sync(0xffffffffu, eq);
            if (lane == 0) warp_b[warp] = __popc(be);
            __syncthreads();
            uint32_t pe = base_eq + __popc(be & below), te = 0;
            for (int w = 0; w < WARPS; ++w) {
                if (w < warp) pe += warp_b[w];
                te += warp_b[w];
            }
            if (eq && pe < left) { sel_key[n_above + pe] = kth; sel_id[n_above + pe] = i; }
            base_eq += te;
            __syncthreads();
        }
    }

    // 4. Sort the k by (key descending, id ascending): bitonic over the next power of two,
    //    the padding (key 0, id max) last (written past the k: the barrier after it is also
    //    the one after the compaction).
    uint32_t p = 1;
    while (p < k) p <<= 1;
    for (uint32_t i = k + tid; i < p; i += THREADS) { sel_key[i] = 0u; sel_id[i] = 0xffffffffu; }
    __syncthreads();
    for (uint32_t size = 2; size <= p; size <<= 1) {
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (uint32_t i = tid; i < p; i += THREADS) {
                uint32_t j = i ^ stride;
                if (j <= i) continue;
                bool first_half = (i & size) == 0;
                uint32_t ki = sel_key[i], ii = sel_id[i], kj = sel_key[j], ij = sel_id[j];
                bool swap = first_half ? before(kj, ij, ki, ii) : before(ki, ii, kj, ij);
                if (swap) { sel_key[i] = kj; sel_id[i] = ij; sel_key[j] = ki; sel_id[j] = ii; }
            }
            __syncthreads();
        }
    }

    // 5. Out: ids and values, [r, 0..k).
    for (uint32_t j = tid; j < k; j += THREADS) {
        uint32_t id = sel_id[j];
        float z = scaled<UNIT>(x[id], temperature);
        ids[(int64_t)r * k + j] = id;
        vals[(int64_t)r * k + j] = logprobs ? z - lse : z;
    }
}

// Two blocks (rows) per multiprocessor, as 32 registers per thread allow: ptxas, left to itself,
// spilled the unrolled passes (sm_90, nvcc 13.0). At 32 it spills a few values outside the
// passes' loops (24–48 bytes of stack; the pass loops are free of spills but for one 8-byte
// store and load per 4,096 columns in the `_t1` kernels' compaction and a few in f32_t1's
// logsumexp pass). One kernel per dtype and temperature kind (`_t1`: temperature 1), each with
// its own shared memory.
#define TOPK_ROWS(NAME, T, UNIT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) NAME(                                                \
        const T *logits, int64_t row_stride, const uint32_t *targets, uint32_t n_rows, uint32_t valid, uint32_t k, \
        float temperature, int logprobs, int want_ranks, uint32_t *ids, float *vals, float *target_lp,            \
        float *lse, uint32_t *ranks) {                                                                            \
        topk_row<T, UNIT>(logits, row_stride, targets, n_rows, valid, k, temperature, logprobs, want_ranks, ids,  \
                          vals, target_lp, lse, ranks);                                                           \
    }

TOPK_ROWS(topk_rows_f32, float, false)
TOPK_ROWS(topk_rows_bf16, __nv_bfloat16, false)
TOPK_ROWS(topk_rows_f16, __half, false)
TOPK_ROWS(topk_rows_f32_t1, float, true)
TOPK_ROWS(topk_rows_bf16_t1, __nv_bfloat16, true)
TOPK_ROWS(topk_rows_f16_t1, __half, true)
