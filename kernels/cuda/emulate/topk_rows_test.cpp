// ../src/topk_rows.cu run on the host (cuda_runtime_emu.h) against a double-precision reference:
// f32, bf16 (many ties) and f16 logits, odd and Qwen3-sized vocabularies with padding, k from 0
// to 4096, temperature 1 (the `_t1` kernels, as the host picks them) and others, log-probs and
// logits; rows of one value repeated (every key ties with the k-th), all negative, and signed
// zeros. Exits non-zero on the first mismatch.
//
//   kernels/cuda/emulate/run.sh        (g++ with C++20; what `cargo test` runs too)
#include "../src/topk_rows.cu"

#include "harness.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>

static int failures = 0;
#define EXPECT(cond, ...)                      \
    do {                                       \
        if (!(cond)) {                         \
            std::fprintf(stderr, __VA_ARGS__); \
            std::fprintf(stderr, "\n");        \
            ++failures;                        \
            return;                            \
        }                                      \
    } while (0)

template <typename T>
void launch(const char *name, const std::vector<T> &x, uint32_t n, uint32_t v, const std::vector<uint32_t> &tg,
            uint32_t valid, uint32_t k, float t, int logprobs, std::vector<uint32_t> &ids, std::vector<float> &vals,
            std::vector<float> &tlp, std::vector<float> &lse, std::vector<uint32_t> &ranks);

#define LAUNCH(T, F, F1)                                                                                            \
    template <>                                                                                                     \
    void launch(const char *, const std::vector<T> &x, uint32_t n, uint32_t v, const std::vector<uint32_t> &tg,      \
                uint32_t valid, uint32_t k, float t, int logprobs, std::vector<uint32_t> &ids,                      \
                std::vector<float> &vals, std::vector<float> &tlp, std::vector<float> &lse,                          \
                std::vector<uint32_t> &ranks) {                                                                     \
        ids.assign(size_t(n) * k, 0xdeadbeefu);                                                                     \
        vals.assign(size_t(n) * k, NAN);                                                                            \
        tlp.assign(n, NAN);                                                                                         \
        lse.assign(n, NAN);                                                                                         \
        ranks.assign(n, 0xdeadbeefu);                                                                               \
        auto *f = t == 1.0f ? F1 : F;                                                                               \
        emu::launch(n, THREADS, [&] {                                                                               \
            f(x.data(), int64_t(v), tg.data(), n, valid, k, t, logprobs, 1, ids.data(), vals.data(), tlp.data(),    \
              lse.data(), ranks.data());                                                                            \
        });                                                                                                         \
    }
LAUNCH(float, topk_rows_f32, topk_rows_f32_t1)
LAUNCH(__nv_bfloat16, topk_rows_bf16, topk_rows_bf16_t1)
LAUNCH(__half, topk_rows_f16, topk_rows_f16_t1)

// A row's values: uniform in ±(3 + row) by default.
using Gen = float (*)(uint32_t row, uint32_t col, std::mt19937 &rng);
static float spread(uint32_t row, uint32_t, std::mt19937 &rng) {
    return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng) * (3.0f + float(row));
}
// One value repeated: every key ties with the k-th, taken in id order over many tiles.
static float flat(uint32_t row, uint32_t, std::mt19937 &) { return row % 2 ? -1.25f : 2.5f; }
// All negative (the keys' low bits are ones), a tenth of them equal to the row's value.
static float negative(uint32_t row, uint32_t col, std::mt19937 &rng) {
    if (col % 10 == 3) return -0.75f - float(row);
    return -std::uniform_real_distribution<float>(0.5f, 4.0f)(rng);
}
// Signed zeros (−0 orders below +0) among small negatives: the k-th falls among the zeros.
static float zeros(uint32_t, uint32_t col, std::mt19937 &rng) {
    if (col % 3 == 0) return col % 2 ? -0.0f : 0.0f;
    return -std::uniform_real_distribution<float>(0.5f, 1.0f)(rng);
}

template <typename T>
void check(const char *dtype, uint32_t n, uint32_t v, uint32_t valid, uint32_t k, float t, int logprobs,
           std::mt19937 &rng, Gen gen = spread) {
    std::vector<T> x(size_t(n) * v);
    for (size_t i = 0; i < x.size(); ++i) x[i] = from_f32<T>(gen(uint32_t(i / v), uint32_t(i % v), rng));
    std::vector<uint32_t> tg(n);
    for (auto &g : tg) g = rng() % valid;
    std::vector<uint32_t> ids, ranks;
    std::vector<float> vals, tlp, lse;
    launch<T>(dtype, x, n, v, tg, valid, k, t, logprobs, ids, vals, tlp, lse, ranks);
    double worst = 0;
    for (uint32_t r = 0; r < n; ++r) {
        std::vector<float> z(valid);
        for (uint32_t i = 0; i < valid; ++i) z[i] = to_f32(x[size_t(r) * v + i]) / t;
        double m = *std::max_element(z.begin(), z.end()), s = 0;
        for (float zi : z) s += std::exp(double(zi) - m);
        double want_lse = m + std::log(s);
        std::vector<uint32_t> order(valid);
        std::iota(order.begin(), order.end(), 0u);
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
            uint32_t ka = __float_as_uint(z[a]), kb = __float_as_uint(z[b]);
            ka = (ka & 0x80000000u) ? ~ka : (ka | 0x80000000u);
            kb = (kb & 0x80000000u) ? ~kb : (kb | 0x80000000u);
            return ka > kb;  // stable: ties stay in id order
        });
        float zt = z[tg[r]];
        uint32_t want_rank = 0;
        for (float zi : z) want_rank += zi >= zt;
        std::string c = std::string(dtype) + " n " + std::to_string(n) + " v " + std::to_string(v) + " valid " +
                         std::to_string(valid) + " k " + std::to_string(k) + " row " + std::to_string(r);
        EXPECT(ranks[r] == want_rank, "%s: rank %u, want %u", c.c_str(), ranks[r], want_rank);
        for (uint32_t j = 0; j < k; ++j) {
            EXPECT(ids[size_t(r) * k + j] == order[j], "%s: place %u id %u, want %u", c.c_str(), j,
                   ids[size_t(r) * k + j], order[j]);
            double want = double(z[order[j]]) - (logprobs ? want_lse : 0.0);
            worst = worse(worst, std::fabs(vals[size_t(r) * k + j] - want));
        }
        worst = worse(worst, std::fabs(lse[r] - want_lse));
        worst = worse(worst, std::fabs(tlp[r] - (double(zt) - want_lse)));
    }
    std::printf("%-5s n %u v %6u valid %6u k %4u t %.1f %s: worst abs error %.2e\n", dtype, n, v, valid, k, t,
                logprobs ? "logprobs" : "logits  ", worst);
    EXPECT(worst < 2e-5, "%s: worst abs error %.3e", dtype, worst);
}

int main() {
    std::mt19937 rng(std::random_device{}());
    check<float>("f32", 3, 5000, 4990, 64, 0.7f, 1, rng);
    check<float>("f32", 2, 1000, 997, 997, 2.0f, 0, rng);
    check<float>("f32", 2, 300, 300, 1, 1.0f, 1, rng);
    check<float>("f32", 2, 1200, 1100, 0, 1.0f, 1, rng);
    check<__nv_bfloat16>("bf16", 3, 6000, 5999, 4096, 1.0f, 1, rng);
    check<__nv_bfloat16>("bf16", 2, 2000, 1900, 100, 1.3f, 0, rng);
    check<__half>("f16", 2, 3000, 2999, 17, 1.0f, 1, rng);
    check<__nv_bfloat16>("bf16", 1, 151936, 151669, 64, 1.0f, 1, rng);
    check<__nv_bfloat16>("bf16", 1, 151936, 151669, 64, 0.8f, 1, rng);
    check<__half>("f16", 2, 9000, 8999, 300, 1.0f, 0, rng);
    check<float>("f32", 2, 5000, 5000, 64, 1.0f, 1, rng);
    check<__nv_bfloat16>("bf16", 2, 10000, 9999, 100, 1.0f, 1, rng, flat);
    check<float>("f32", 2, 9000, 9000, 4096, 0.5f, 0, rng, flat);
    check<__nv_bfloat16>("bf16", 2, 7000, 7000, 900, 1.0f, 1, rng, negative);
    check<__half>("f16", 1, 7000, 6999, 800, 1.0f, 0, rng, negative);
    check<float>("f32", 1, 7000, 7000, 700, 1.7f, 1, rng, negative);
    check<__nv_bfloat16>("bf16", 1, 5000, 5000, 1000, 1.0f, 1, rng, zeros);
    check<float>("f32", 1, 5000, 4500, 1000, 1.0f, 0, rng, zeros);
    if (failures) {
        std::fprintf(stderr, "%d case(s) failed\n", failures);
        return 1;
    }
    std::printf("all cases equal the reference\n");
    return 0;
}
