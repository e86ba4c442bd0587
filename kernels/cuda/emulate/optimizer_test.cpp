// ../src/adamw.cu and ../src/sum_squares.cu run on the host (cuda_runtime_emu.h): the
// multi-tensor AdamW against a per-element loop with the CPU kernel's operations (the same bits),
// with and without clipping, with fewer blocks than chunks; the multi-tensor Σ g² against a
// long-double sum. Exits non-zero on the first mismatch.
#include "../src/adamw.cu"
#undef THREADS
#include "../src/sum_squares.cu"

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

static uint64_t addr(const float *p) { return uint64_t(reinterpret_cast<uintptr_t>(p)); }

static void adamw_case(bool clip, unsigned grid, std::mt19937 &rng) {
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
    auto wp = p, wm = m, wv = v;  // the reference's copies
    const float lr = 3e-4f, b1 = 0.9f, b2 = 0.999f, c1 = 1.0f - b1, c2 = 1.0f - b2, eps = 1e-8f;
    const float ibc1 = float(1.0 / (1.0 - 0.9 * 0.9 * 0.9)), ibc2 = float(1.0 / (1.0 - 0.999 * 0.999 * 0.999));
    const float scale = 0.37f;
    auto cs = chunks_of(sizes, 4096);
    std::vector<uint64_t> table;
    for (auto &c : cs) {
        uint32_t dbits;
        std::memcpy(&dbits, &decays[c.tensor], 4);
        table.insert(table.end(), {addr(p[c.tensor].data() + c.start), addr(g[c.tensor].data() + c.start),
                                   addr(m[c.tensor].data() + c.start), addr(v[c.tensor].data() + c.start),
                                   uint64_t(c.len) | (uint64_t(dbits) << 32)});
    }
    emu::launch(grid, 256, [&] {
        adamw_f32(table.data(), uint32_t(cs.size()), lr, b1, c1, b2, c2, ibc1, ibc2, eps, clip, scale);
    });
    size_t diffs = 0;
    for (size_t t = 0; t < sizes.size(); ++t) {
        for (size_t i = 0; i < sizes[t]; ++i) {
            float gi = g[t][i];
            if (clip) gi = gi * scale + 0.0f;
            float mi = b1 * wm[t][i] + c1 * gi;
            float vi = b2 * wv[t][i] + c2 * (gi * gi);
            float want = wp[t][i] * decays[t] - lr * (mi * ibc1) / (std::sqrt(vi * ibc2) + eps);
            diffs += p[t][i] != want || m[t][i] != mi || v[t][i] != vi;
        }
    }
    std::printf("adamw clip %d grid %u (%zu chunks): %zu elements differ\n", clip, grid, cs.size(), diffs);
    if (diffs) ++failures;
}

static void sum_squares_case(unsigned grid, std::mt19937 &rng) {
    std::vector<size_t> sizes = {5, 65536, 200003, 1};
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<std::vector<float>> x(sizes.size());
    for (size_t t = 0; t < sizes.size(); ++t)
        for (size_t i = 0; i < sizes[t]; ++i) x[t].push_back(nd(rng));
    auto cs = chunks_of(sizes, 65536);
    std::vector<uint64_t> table;
    for (auto &c : cs) table.insert(table.end(), {addr(x[c.tensor].data() + c.start), uint64_t(c.len)});
    std::vector<double> out(cs.size(), -1.0);
    emu::launch(grid, 256, [&] { sum_squares_f32(table.data(), uint32_t(cs.size()), out.data()); });
    std::vector<double> got(sizes.size(), 0.0);
    for (size_t i = 0; i < cs.size(); ++i) got[cs[i].tensor] += out[i];
    double worst = 0;
    for (size_t t = 0; t < sizes.size(); ++t) {
        long double want = 0;
        for (float xi : x[t]) want += (long double)xi * xi;
        worst = std::max(worst, double(std::fabs((long double)got[t] - want) / want));
    }
    std::printf("sum_squares grid %u (%zu chunks): worst relative error %.2e\n", grid, cs.size(), worst);
    if (!(worst < 1e-12)) ++failures;
}

int main() {
    std::mt19937 rng(std::random_device{}());
    adamw_case(false, 5, rng);
    adamw_case(true, 64, rng);
    sum_squares_case(2, rng);
    sum_squares_case(16, rng);
    if (failures) {
        std::fprintf(stderr, "%d case(s) failed\n", failures);
        return 1;
    }
    std::printf("all cases equal the reference\n");
    return 0;
}
