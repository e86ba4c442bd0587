// ../src/adamw.cu and ../src/sum_squares.cu run on the host (cuda_runtime_emu.h): the
// multi-tensor AdamW against a per-element loop with the CPU kernel's operations (the same bits),
// with and without clipping, with fewer blocks than chunks, with bf16 and f16 compute copies
// (each the nearest value to the updated weight, ties to even) on some tensors, with f32 and
// bf16 and f16 gradients side by side (each widened exactly); the multi-tensor Σ g² against a
// long-double sum, and for bf16 and f16 tensors, the bits of their f32 widening's; ../src/tree_sum.cu (the data-parallel exact sum)
// against the pairwise tree's definition, recursion over halves, bit for bit, for 1 to 19
// ranks; ../src/grad_accumulate.cu (a micro-batch's gradients into their f32 sums) against
// widening and one f32 add per element, bit for bit, for f32, bf16 and f16 gradients, both
// modes, chunked tensors and fewer blocks than chunks. Exits non-zero on the first mismatch.
#include "../src/adamw.cu"
#undef THREADS
#include "../src/sum_squares.cu"
#include "../src/tree_sum.cu"
#include "../src/grad_accumulate.cu"

#include "harness.h"

#include <cstdio>
#include <random>
#include <vector>

static int failures = 0;

// A chunk table over `tensors` (sizes), `chunk` elements per chunk: (tensor, start, len).
struct Chunk {
    size_t tensor, start;
    uint32_t len;
};
static std::vector<Chunk> chunks_of(const std::vector<size_t> &sizes, size_t chunk) {
    std::vector<Chunk> out;
    for (size_t t = 0; t < sizes.size(); ++t)
        for (size_t s = 0; s < sizes[t]; s += chunk) out.push_back({t, s, uint32_t(std::min(chunk, sizes[t] - s))});
    return out;
}

static uint64_t addr(const void *p) { return uint64_t(reinterpret_cast<uintptr_t>(p)); }

// Whether `c` (a bf16 or f16 value as bits, widened by `widen`) is the nearest to `x` of its
// neighbours in the format, an even one on a tie.
template <typename W> static bool nearest(float x, uint16_t c, W widen) {
    const double d = std::fabs(double(widen(c)) - x);
    for (uint16_t n : {uint16_t(c - 1), uint16_t(c + 1)}) {
        const double dn = std::fabs(double(widen(n)) - x);
        if (dn < d || (dn == d && (c & 1))) return false;
    }
    return true;
}
static float widen_bf16(uint16_t b) { return __bfloat162float(__nv_bfloat16{b}); }
static float widen_f16(uint16_t b) {
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return float(h);
}

// A gradient stored as `kind` (0 f32, 1 bf16, 2 f16): the kernel's table points at `bits` for
// the 16-bit kinds; `g` holds the values the kernel should read (the stored ones, widened).
struct StoredGrad {
    std::vector<float> g;
    std::vector<uint16_t> bits;
    uint32_t kind;
    const void *at(size_t i) const {
        return kind == 0 ? static_cast<const void *>(g.data() + i) : static_cast<const void *>(bits.data() + i);
    }
};
static StoredGrad stored(std::vector<float> g, uint32_t kind) {
    StoredGrad s{std::move(g), {}, kind};
    for (float &x : s.g) {
        if (kind == 1) {
            s.bits.push_back(__float2bfloat16(x).bits);
            x = widen_bf16(s.bits.back());
        } else if (kind == 2) {
            const __half h = __float2half(x);
            uint16_t b;
            std::memcpy(&b, &h, 2);
            s.bits.push_back(b);
            x = widen_f16(b);
        }
    }
    return s;
}

// copy_kind: 0 no copies, 1 bf16, 2 f16 (every other tensor has one); mixed_grads: tensor t's
// gradient is f32, bf16 or f16 by t mod 3 (else all f32).
static void adamw_case(bool clip, unsigned grid, int copy_kind, bool mixed_grads, std::mt19937 &rng) {
    std::vector<size_t> sizes = {1, 1000, 4097, 70000, 3};
    std::vector<float> decays = {1.0f, 0.99999f, 1.0f, 0.9999f, 1.0f};
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<std::vector<float>> p(sizes.size()), g(sizes.size()), m(sizes.size()), v(sizes.size());
    for (size_t t = 0; t < sizes.size(); ++t) {
        for (size_t i = 0; i < sizes[t]; ++i) {
            p[t].push_back(nd(rng));
            g[t].push_back(nd(rng) * 1e-2f);
            m[t].push_back(nd(rng) * 1e-3f);
            v[t].push_back(std::fabs(nd(rng)) * 1e-5f);
        }
    }
    std::vector<StoredGrad> gs;
    for (size_t t = 0; t < sizes.size(); ++t) gs.push_back(stored(g[t], mixed_grads ? uint32_t(t % 3) : 0));
    auto wp = p, wm = m, wv = v;  // the reference's copies
    const float lr = 3e-4f, b1 = 0.9f, b2 = 0.999f, c1 = 1.0f - b1, c2 = 1.0f - b2, eps = 1e-8f;
    const float ibc1 = float(1.0 / (1.0 - 0.9 * 0.9 * 0.9)), ibc2 = float(1.0 / (1.0 - 0.999 * 0.999 * 0.999));
    const float scale = 0.37f;
    const uint16_t unset = 0xffff;  // a NaN in both formats: never the nearest to a weight
    std::vector<std::vector<uint16_t>> copies(sizes.size());
    for (size_t t = 0; t < sizes.size(); ++t) copies[t].assign(sizes[t], unset);
    auto has_copy = [&](size_t t) { return copy_kind != 0 && t % 2 == 1; };
    auto cs = chunks_of(sizes, 4096);
    std::vector<uint64_t> table;
    for (auto &c : cs) {
        uint32_t dbits;
        std::memcpy(&dbits, &decays[c.tensor], 4);
        const uint64_t copy = has_copy(c.tensor) ? addr(copies[c.tensor].data() + c.start) : 0;
        const StoredGrad &sg = gs[c.tensor];
        table.insert(table.end(), {addr(p[c.tensor].data() + c.start), addr(sg.at(c.start)),
                                   addr(m[c.tensor].data() + c.start), addr(v[c.tensor].data() + c.start), copy,
                                   uint64_t(c.len) | (uint64_t(sg.kind) << 24) | (uint64_t(dbits) << 32)});
    }
    emu::launch(grid, 256, [&] {
        adamw_f32(table.data(), uint32_t(cs.size()), lr, b1, c1, b2, c2, ibc1, ibc2, eps, clip, scale, copy_kind);
    });
    size_t diffs = 0;
    for (size_t t = 0; t < sizes.size(); ++t) {
        for (size_t i = 0; i < sizes[t]; ++i) {
            float gi = gs[t].g[i];
            if (clip) gi = gi * scale + 0.0f;
            float mi = b1 * wm[t][i] + c1 * gi;
            float vi = b2 * wv[t][i] + c2 * (gi * gi);
            float want = wp[t][i] * decays[t] - lr * (mi * ibc1) / (std::sqrt(vi * ibc2) + eps);
            diffs += p[t][i] != want || m[t][i] != mi || v[t][i] != vi;
            const uint16_t c = copies[t][i];
            if (!has_copy(t))
                diffs += c != unset;
            else if (copy_kind == 1)
                diffs += !nearest(want, c, widen_bf16);
            else
                diffs += !nearest(want, c, widen_f16);
        }
    }
    std::printf("adamw clip %d grid %u copies %d mixed gradients %d (%zu chunks): %zu elements differ\n", clip, grid,
                copy_kind, mixed_grads, cs.size(), diffs);
    if (diffs) ++failures;
}

static void sum_squares_case(unsigned grid, std::mt19937 &rng) {
    std::vector<size_t> sizes = {5, 65536, 200003, 1};
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<std::vector<float>> x(sizes.size());
    for (size_t t = 0; t < sizes.size(); ++t)
        for (size_t i = 0; i < sizes[t]; ++i) x[t].push_back(nd(rng));
    auto cs = chunks_of(sizes, 65536);
    // Each tensor's sum over the table of `xs` (their dtypes in the chunks' length words).
    auto run = [&](const std::vector<StoredGrad> &xs) {
        std::vector<uint64_t> table;
        for (auto &c : cs)
            table.insert(table.end(),
                         {addr(xs[c.tensor].at(c.start)), uint64_t(c.len) | (uint64_t(xs[c.tensor].kind) << 24)});
        std::vector<double> out(cs.size(), -1.0);
        emu::launch(grid, 256, [&] { sum_squares(table.data(), uint32_t(cs.size()), out.data()); });
        std::vector<double> got(sizes.size(), 0.0);
        for (size_t i = 0; i < cs.size(); ++i) got[cs[i].tensor] += out[i];
        return got;
    };
    std::vector<StoredGrad> f32s, mixed, widened;
    for (size_t t = 0; t < sizes.size(); ++t) {
        f32s.push_back(stored(x[t], 0));
        mixed.push_back(stored(x[t], uint32_t(t % 3)));
        widened.push_back(stored(mixed.back().g, 0));
    }
    const auto got = run(f32s);
    double worst = 0;
    for (size_t t = 0; t < sizes.size(); ++t) {
        long double want = 0;
        for (float xi : x[t]) want += (long double)xi * xi;
        worst = worse(worst, double(std::fabs((long double)got[t] - want) / want));
    }
    // bf16 and f16 tensors: the bits of their values widened to f32.
    const auto a = run(mixed), b = run(widened);
    size_t differ = 0;
    for (size_t t = 0; t < sizes.size(); ++t) differ += std::memcmp(&a[t], &b[t], sizeof(double)) != 0;
    std::printf("sum_squares grid %u (%zu chunks): worst relative error %.2e; bf16/f16 tensors unlike their f32 "
                "widening: %zu\n",
                grid, cs.size(), worst, differ);
    if (!(worst < 1e-12) || differ) ++failures;
}

// The tree's definition (trainer/src/dist/tree.rs's reference): split at the largest power of
// two below the count, each half summed the same way, in f32.
static float tree_ref(const float *const *leaves, size_t count, size_t i) {
    if (count == 1) return leaves[0][i];
    size_t split = 1;
    while (split * 2 < count) split *= 2;
    return tree_ref(leaves, split, i) + tree_ref(leaves + split, count - split, i);
}

static void tree_sum_case(uint32_t world, size_t n, unsigned grid, std::mt19937 &rng) {
    // Values spanning magnitudes, so that the order of additions shows in the bits.
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-4, 4);
    std::vector<float> parts(world * n);
    for (float &x : parts) x = u(rng) * std::pow(10.0f, float(e(rng)));
    std::vector<float> out(n, -7.0f);
    emu::launch(grid, 64, [&] { tree_sum_f32(parts.data(), out.data(), n, world); });
    std::vector<const float *> leaves;
    for (uint32_t r = 0; r < world; ++r) leaves.push_back(parts.data() + r * n);
    size_t diffs = 0, fold_diffs = 0;
    for (size_t i = 0; i < n; ++i) {
        diffs += out[i] != tree_ref(leaves.data(), world, i);
        float fold = 0.0f;
        for (uint32_t r = 0; r < world; ++r) fold += leaves[r][i];
        fold_diffs += out[i] != fold;
    }
    std::printf("tree_sum world %u n %zu grid %u: %zu elements differ (a left fold differs at %zu)\n", world, n,
                grid, diffs, fold_diffs);
    if (diffs) ++failures;
}

// Tensors of several sizes (one over a 64 Ki chunk), gradients of `kind` t % 3 (0 f32, 1 bf16,
// 2 f16), every other tensor added to its sum, the rest written.
static void grad_accumulate_case(unsigned grid, std::mt19937 &rng) {
    const std::vector<size_t> sizes = {1, 1000, 70000, 3, 131077};
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<std::vector<float>> sums(sizes.size()), g32(sizes.size());
    std::vector<std::vector<uint16_t>> g16(sizes.size());
    std::vector<std::vector<float>> want(sizes.size());
    for (size_t t = 0; t < sizes.size(); ++t) {
        const int kind = int(t % 3);
        const bool add = t % 2 == 0;
        for (size_t i = 0; i < sizes[t]; ++i) {
            const float s = nd(rng), g = nd(rng) * 1e-3f;
            float widened = g;
            if (kind == 1) {
                const uint16_t b = __float2bfloat16(g).bits;
                g16[t].push_back(b);
                widened = widen_bf16(b);
            } else if (kind == 2) {
                const _Float16 h = _Float16(g);
                uint16_t b;
                std::memcpy(&b, &h, 2);
                g16[t].push_back(b);
                widened = float(h);
            } else {
                g32[t].push_back(g);
            }
            sums[t].push_back(s);
            want[t].push_back(add ? s + widened : widened);
        }
    }
    std::vector<uint64_t> table;
    for (auto &c : chunks_of(sizes, 1 << 16)) {
        const uint64_t kind = c.tensor % 3, add = c.tensor % 2 == 0;
        const uint64_t src = kind == 0 ? addr(g32[c.tensor].data() + c.start) : addr(g16[c.tensor].data() + c.start);
        table.insert(table.end(), {src, addr(sums[c.tensor].data() + c.start), c.len | (kind << 32) | (add << 40)});
    }
    const uint32_t n = uint32_t(table.size() / 3);
    emu::launch(grid, 256, [&] { grad_accumulate_f32(table.data(), n); });
    size_t diffs = 0;
    for (size_t t = 0; t < sizes.size(); ++t)
        diffs += std::memcmp(sums[t].data(), want[t].data(), 4 * sizes[t]) != 0;
    std::printf("grad_accumulate: %zu tensors, %u chunks, grid %u: %zu tensors differ\n", sizes.size(), n, grid,
                diffs);
    if (diffs) ++failures;
}

int main() {
    std::mt19937 rng(std::random_device{}());
    adamw_case(false, 5, 0, false, rng);
    adamw_case(true, 64, 1, false, rng);
    adamw_case(false, 7, 2, false, rng);
    adamw_case(true, 3, 1, true, rng);
    adamw_case(false, 64, 0, true, rng);
    sum_squares_case(2, rng);
    sum_squares_case(16, rng);
    grad_accumulate_case(2, rng);
    grad_accumulate_case(16, rng);
    for (uint32_t world = 1; world <= 19; ++world) tree_sum_case(world, 301 + world, world % 3 + 1, rng);
    if (failures) {
        std::fprintf(stderr, "%d case(s) failed\n", failures);
        return 1;
    }
    std::printf("all cases equal the reference\n");
    return 0;
}
