// The same-tokenizer distillation loss of each row of student logits over the teacher's top-k
// set K, forward and backward, reading the row's `V` logits once per pass and never writing a
// `[rows, V]` log-softmax (llm.c's fused classifier, for top-k targets). The next-token
// cross-entropy is the case k = 1, teacher log-prob 0, forward KL, no tail, τ = 1.
//
// Row r, logits z (T: f32, bf16, f16), temperature τ, teacher ids id_j and log-probs lt_j
// (j < k; distinct ids, log-probs floored by the caller), with lse = log Σ_v exp(z_v/τ) and
// u_j = z_{id_j}/τ − lse (the student's log-probs at K):
//   tail 1 "bucket":      t = (lt_0..k−1, L(lse_t)),  s = (u_0..k−1, L(lse_s))
//   tail 2 "ignore":      t = lt,                      s = u
//   tail 0 "renormalize": t = lt − lse_t,              s = u − lse_s
// where lse_t = log Σ_j exp(lt_j), lse_s = log Σ_j exp(u_j), and L(x) = log(1 − e^x) with
// 1 − e^x floored at `tail_floor` (no gradient where the floor binds). The divergence is summed
// over the entries: forward KL e^t (t − s), reverse KL e^s (s − t), JSD(β)
// β e^t (t − m) + (1 − β) e^s (s − m) with m = log(β e^t + (1 − β) e^s), total variation
// ½ |e^t − e^s|. Outputs per row (f32): [divergence, teacher mass e^lse_t, student mass
// e^lse_s, lse]; only the first is differentiable.
//
// Backward, from the gradient g of row r's divergence: a_j = ∂D/∂s_j, then with the tail's
// chain rule the gradient at u, w_j; dz_v = (g/τ)(Σ_j w_j [v = id_j] − p_v Σ_j w_j) with
// p_v = exp(z_v/τ − lse) (renormalize: dz_{id_j} = (g/τ)(a_j − e^{s_j} Σ a), 0 elsewhere).
// One block per row; every sum in a fixed order: a row's result depends on that row alone.
//
// With `ce` (each row's next token y), the next-token cross-entropy rides along at τ = 1: the
// forward also writes [CE = lse₁ − z_y, lse₁] (columns 4 and 5, lse₁ = log Σ_v exp(z_v), from
// the same pass over the row), and the backward adds g_ce (p₁_v − [v = y]) to every column, so
// that a head chunk's two losses read the logits once each way and write one gradient. The
// backward may write its gradient over the logits (dz = z): the columns at K and y are computed
// before any column is written.
#include <stdint.h>

#include "dtype.cuh"

#define THREADS 256
#define WARPS (THREADS / 32)
// Elements a thread loads before it uses any of them in a pass over a row: independent loads in
// flight (one each before: the passes waited on memory latency, about a sixth of the memory's
// bandwidth on an H200), and in the logsumexp as many independent running sums.
#define UNROLL 4
// The columns at K the backward stages in shared memory before its pass over the row (16 KB):
// above this k it recomputes the rest from the logits afterwards, so only a gradient written
// elsewhere than the logits may have a larger k (the launcher checks).
#define STAGED_K 4096

enum { FORWARD = 0, REVERSE = 1, JSD = 2, TV = 3 };
enum { RENORMALIZE = 0, BUCKET = 1, IGNORE = 2 };

struct Loss {
    int div, tail;
    float beta, inv_tau, tail_floor;
};

// Combines two (max, Σ exp(· − max)) pairs.
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
    else { s += s2 * expf(m2 - m); }
}

__device__ __forceinline__ void warp_lse(float &m, float &s) {
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// log Σ_v exp(z_v · inv_tau) over the row, in every thread of the block; with `unit` also
// log Σ_v exp(z_v) in `lse1` from the same loads (the cross-entropy's, at τ = 1).
template <typename T>
__device__ float row_lse(const T *zr, uint32_t v, float inv_tau, bool unit, float &lse1) {
    __shared__ float wm[2][WARPS], ws[2][WARPS];
    __shared__ float total[2];
    float mu[UNROLL], su[UNROLL], mu1[UNROLL], su1[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) { mu[u] = mu1[u] = -INFINITY; su[u] = su1[u] = 0.0f; }
    for (uint32_t base = threadIdx.x; base < v; base += THREADS * UNROLL) {
        float xu[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t i = base + u * THREADS;
            xu[u] = i < v ? to_f32(zr[i]) : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * THREADS < v) {
                lse_merge(mu[u], su[u], xu[u] * inv_tau, 1.0f);
                if (unit) lse_merge(mu1[u], su1[u], xu[u], 1.0f);
            }
        }
    }
    float m = mu[0], s = su[0], m1 = mu1[0], s1 = su1[0];
#pragma unroll
    for (int u = 1; u < UNROLL; ++u) {
        lse_merge(m, s, mu[u], su[u]);
        lse_merge(m1, s1, mu1[u], su1[u]);
    }
    warp_lse(m, s);
    if (unit) warp_lse(m1, s1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        wm[0][warp] = m;
        ws[0][warp] = s;
        wm[1][warp] = m1;
        ws[1][warp] = s1;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < WARPS ? wm[0][lane] : -INFINITY;
        s = lane < WARPS ? ws[0][lane] : 0.0f;
        warp_lse(m, s);
        m1 = lane < WARPS ? wm[1][lane] : -INFINITY;
        s1 = lane < WARPS ? ws[1][lane] : 0.0f;
        if (unit) warp_lse(m1, s1);
        if (lane == 0) {
            total[0] = m + logf(s);
            total[1] = unit ? m1 + logf(s1) : total[0];
        }
    }
    __syncthreads();
    lse1 = total[1];
    return total[0];
}

// log(1 − e^x) with 1 − e^x floored at `floor`; `live` whether x is below the floor's bound
// (the gradient flows).
__device__ __forceinline__ float log1mexp_floor(float x, float floor, bool &live) {
    const float x_max = log1pf(-floor);
    live = x < x_max;
    const float y = live ? x : x_max;
    return y < -0.6931471805599453f ? log1pf(-expf(y)) : logf(-expm1f(y));
}

// One entry's divergence term and its derivative in s.
__device__ __forceinline__ void term(const Loss &L, float t, float s, float &d, float &ds) {
    const float et = expf(t), es = expf(s);
    switch (L.div) {
        case FORWARD:
            d = et * (t - s);
            ds = -et;
            break;
        case REVERSE:
            d = es * (s - t);
            ds = es * (s - t + 1.0f);
            break;
        case JSD: {
            const float a = t + logf(L.beta), b = s + logf(1.0f - L.beta);
            const float hi = fmaxf(a, b);
            const float m = hi + logf(expf(a - hi) + expf(b - hi));
            d = L.beta * et * (t - m) + (1.0f - L.beta) * es * (s - m);
            ds = (1.0f - L.beta) * es * (s - m);
            break;
        }
        default: {
            const float diff = et - es;
            d = 0.5f * fabsf(diff);
            ds = diff >= 0.0f ? -0.5f * es : 0.5f * es;
        }
    }
}

// What the k-way sums of a row give; computed by warp 0, then shared.
struct RowSums {
    float lse, lse_t, lse_s;
    float tail_t, tail_s;  // bucket's entries
    bool tail_live;        // whether the student's tail passes a gradient
    float d;               // the divergence
    float a_tail;          // ∂D/∂(student tail)
    float sum_w;           // Σ_j w_j (bucket, ignore) or Σ_j a_j (renormalize)
};

__device__ __forceinline__ float t_of(const Loss &L, const RowSums &R, float lt) {
    return L.tail == RENORMALIZE ? lt - R.lse_t : lt;
}
__device__ __forceinline__ float s_of(const Loss &L, const RowSums &R, float u) {
    return L.tail == RENORMALIZE ? u - R.lse_s : u;
}
// The gradient at u_j from a_j (bucket's tail chain rule: ∂L(lse_s)/∂u_j = −e^{u_j}/(1 − e^{lse_s})).
__device__ __forceinline__ float w_of(const Loss &L, const RowSums &R, float u, float a) {
    if (L.tail == BUCKET && R.tail_live) return a - R.a_tail * expf(u) / (-expm1f(R.lse_s));
    return a;
}

// Warp 0 (every lane returns the same sums): the row's k-way statistics, divergence and (with
// `grads`) the sum of the gradients at u.
template <typename T>
__device__ RowSums row_sums(const Loss &L, const T *__restrict__ zr, const uint32_t *__restrict__ ids,
                            const float *__restrict__ lts, uint32_t k, float lse, bool grads) {
    const int lane = threadIdx.x & 31;
    RowSums R{};
    R.lse = lse;
    float mt = -INFINITY, st = 0.0f, ms = -INFINITY, ss = 0.0f;
    for (uint32_t j = lane; j < k; j += 32) {
        lse_merge(mt, st, lts[j], 1.0f);
        lse_merge(ms, ss, to_f32(zr[ids[j]]) * L.inv_tau - lse, 1.0f);
    }
    warp_lse(mt, st);
    warp_lse(ms, ss);
    R.lse_t = mt + logf(st);
    R.lse_s = ms + logf(ss);
    float d = 0.0f, sum_a = 0.0f, sum_w = 0.0f;
    if (L.tail == BUCKET) {
        bool teacher_live;
        R.tail_t = log1mexp_floor(R.lse_t, L.tail_floor, teacher_live);
        R.tail_s = log1mexp_floor(R.lse_s, L.tail_floor, R.tail_live);
        term(L, R.tail_t, R.tail_s, d, R.a_tail);
        if (lane != 0) d = 0.0f;  // counted once in the warp's sum
    }
    for (uint32_t j = lane; j < k; j += 32) {
        const float u = to_f32(zr[ids[j]]) * L.inv_tau - lse;
        float dj, aj;
        term(L, t_of(L, R, lts[j]), s_of(L, R, u), dj, aj);
        d += dj;
        if (grads) {
            sum_a += aj;
            sum_w += w_of(L, R, u, aj);
        }
    }
    R.d = warp_sum(d);
    R.sum_w = warp_sum(L.tail == RENORMALIZE ? sum_a : sum_w);
    return R;
}

// The columns of the forward's output: [divergence, teacher mass on K, student mass on K, lse]
// and, with the cross-entropy, [CE, lse₁].
#define COLS_KD 4
#define COLS_CE 6

// `out` [rows, 4], or [rows, 6] with `ce` (each row's next token, below V; null: none).
template <typename T>
__device__ void topk_kd_fwd(const T *__restrict__ z, const uint32_t *__restrict__ ids, const float *__restrict__ lts,
                            const uint32_t *__restrict__ ce, float *__restrict__ out, uint32_t rows, uint32_t v,
                            uint32_t k, Loss L) {
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const T *zr = z + (uint64_t)r * v;
    float lse1;
    const float lse = row_lse(zr, v, L.inv_tau, ce != nullptr && L.inv_tau != 1.0f, lse1);
    if ((threadIdx.x >> 5) != 0) return;
    const RowSums R = row_sums(L, zr, ids + (uint64_t)r * k, lts + (uint64_t)r * k, k, lse, false);
    if (threadIdx.x == 0) {
        float *o = out + (uint64_t)r * (ce ? COLS_CE : COLS_KD);
        o[0] = R.d;
        o[1] = expf(R.lse_t);
        o[2] = expf(R.lse_s);
        o[3] = lse;
        if (ce) {
            o[4] = lse1 - to_f32(zr[ce[r]]);
            o[5] = lse1;
        }
    }
}

// The gradient of one row, with what it is computed from.
struct RowGrad {
    RowSums R;
    float lse, lse1;
    float c;     // g_kd / τ
    float g_ce;  // the cross-entropy's gradient (0 without it)
    uint32_t y;  // the next token (none: no column)
};

// The gradient at column x of the row (logit z_x) outside K and y: −c·p_x·Σw + g_ce·p₁_x
// (renormalize: nothing from the divergence outside K).
__device__ __forceinline__ float dense_grad(const Loss &L, const RowGrad &G, float x, bool ce) {
    const bool kd = L.tail != RENORMALIZE;
    const float p = kd || (ce && L.inv_tau == 1.0f) ? expf(x * L.inv_tau - G.lse) : 0.0f;
    float d = kd ? -G.c * p * G.R.sum_w : 0.0f;
    if (ce) d += G.g_ce * (L.inv_tau == 1.0f ? p : expf(x - G.lse1));
    return d;
}

// The gradient at K's column j (logit zk, teacher log-prob lt, id), recomputed whole in f32.
__device__ __forceinline__ float k_grad(const Loss &L, const RowGrad &G, float zk, float lt, uint32_t id, bool ce) {
    const float u = zk * L.inv_tau - G.lse;
    const float s = s_of(L, G.R, u);
    float dj, aj;
    term(L, t_of(L, G.R, lt), s, dj, aj);
    float grad = L.tail == RENORMALIZE ? G.c * (aj - expf(s) * G.R.sum_w)
                                       : G.c * (w_of(L, G.R, u, aj) - expf(u) * G.R.sum_w);
    if (ce) grad += G.g_ce * ((L.inv_tau == 1.0f ? expf(u) : expf(zk - G.lse1)) - (id == G.y ? 1.0f : 0.0f));
    return grad;
}

// dz [rows, V] (T) from the gradients of each row's divergence, g[r·g_stride], and cross-entropy,
// g[r·g_stride + g_ce] (with `ce`), and the forward's outputs `res` (its lse and lse₁). `dz` may
// be `z` (the gradient written over the logits) when k ≤ STAGED_K.
template <typename T>
__device__ void topk_kd_bwd(const T *z, const uint32_t *__restrict__ ids, const float *__restrict__ lts,
                            const uint32_t *__restrict__ ce, const float *__restrict__ res,
                            const float *__restrict__ g, uint32_t g_stride, uint32_t g_ce, T *dz, uint32_t rows,
                            uint32_t v, uint32_t k, Loss L) {
    __shared__ RowSums shared_sums;
    __shared__ float staged[STAGED_K];
    __shared__ float y_grad;
    __shared__ int y_in_k;
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const bool has_ce = ce != nullptr;
    const T *zr = z + (uint64_t)r * v;
    T *dr = dz + (uint64_t)r * v;
    const uint32_t *idr = ids + (uint64_t)r * k;
    const float *ltr = lts + (uint64_t)r * k;
    const float *rr = res + (uint64_t)r * (has_ce ? COLS_CE : COLS_KD);
    RowGrad G;
    G.lse = rr[3];
    G.lse1 = has_ce ? rr[5] : rr[3];
    G.c = g[(uint64_t)r * g_stride] * L.inv_tau;
    G.g_ce = has_ce ? g[(uint64_t)r * g_stride + g_ce] : 0.0f;
    G.y = has_ce ? ce[r] : 0xffffffffu;
    if ((threadIdx.x >> 5) == 0) {
        const RowSums R = row_sums(L, zr, idr, ltr, k, G.lse, true);
        if (threadIdx.x == 0) {
            shared_sums = R;
            y_in_k = 0;
        }
    }
    __syncthreads();
    G.R = shared_sums;
    // The columns at K and y from the logits before any column is written.
    const uint32_t staged_k = k < STAGED_K ? k : STAGED_K;
    for (uint32_t j = threadIdx.x; j < staged_k; j += THREADS) {
        staged[j] = k_grad(L, G, to_f32(zr[idr[j]]), ltr[j], idr[j], has_ce);
        if (idr[j] == G.y) y_in_k = 1;
    }
    if (has_ce && threadIdx.x == 0) y_grad = dense_grad(L, G, to_f32(zr[G.y]), true) - G.g_ce;
    __syncthreads();
    const bool reads = L.tail != RENORMALIZE || has_ce;
    // Every column as if outside K and y.
    for (uint32_t base = threadIdx.x; base < v; base += THREADS * UNROLL) {
        float zu[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t i = base + u * THREADS;
            zu[u] = i < v && reads ? to_f32(zr[i]) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t i = base + u * THREADS;
            if (i < v) dr[i] = from_f32<T>(dense_grad(L, G, zu[u], has_ce));
        }
    }
    __syncthreads();
    // The columns at K (distinct ids: one thread each), and y's where it is not in K. Past
    // STAGED_K, recomputed from the logits (`dz` is not `z` then).
    for (uint32_t j = threadIdx.x; j < k; j += THREADS) {
        const float grad = j < STAGED_K ? staged[j] : k_grad(L, G, to_f32(zr[idr[j]]), ltr[j], idr[j], has_ce);
        dr[idr[j]] = from_f32<T>(grad);
    }
    if (has_ce && threadIdx.x == 0 && !y_in_k) dr[G.y] = from_f32<T>(y_grad);
}

#define TOPK_KD(SUFFIX, T)                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
        topk_kd_fwd_##SUFFIX(const T *z, const uint32_t *ids, const float *lts, const uint32_t *ce, float *out,       \
                             uint32_t rows, uint32_t v, uint32_t k, int div, int tail, float beta, float inv_tau,    \
                             float tail_floor) {                                                                      \
        topk_kd_fwd<T>(z, ids, lts, ce, out, rows, v, k, Loss{div, tail, beta, inv_tau, tail_floor});                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) topk_kd_bwd_##SUFFIX(                                      \
        const T *z, const uint32_t *ids, const float *lts, const uint32_t *ce, const float *res, const float *g,     \
        uint32_t g_stride, uint32_t g_ce, T *dz, uint32_t rows, uint32_t v, uint32_t k, int div, int tail,           \
        float beta, float inv_tau, float tail_floor) {                                                                \
        topk_kd_bwd<T>(z, ids, lts, ce, res, g, g_stride, g_ce, dz, rows, v, k,                                      \
                       Loss{div, tail, beta, inv_tau, tail_floor});                                                   \
    }

TOPK_KD(f32, float)
TOPK_KD(bf16, __nv_bfloat16)
TOPK_KD(f16, __half)
