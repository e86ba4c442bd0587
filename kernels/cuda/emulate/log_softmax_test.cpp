// ../src/log_softmax.cu run on the host (cuda_runtime_emu.h) against double-precision
// references: the forward x − logsumexp(x) and the backward g − exp(y)·Σg, rows of odd lengths
// from 1 to Qwen3's 151,936 columns. Exits non-zero on the first mismatch.
#include "../src/log_softmax.cu"

#include "harness.h"

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

int main() {
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> nd(0.0f, 4.0f);
    int failures = 0;
    const std::pair<uint32_t, uint32_t> shapes[] = {{3, 1}, {2, 1000}, {4, 4099}, {1, 151936}};
    for (auto [rows, dim] : shapes) {
        std::vector<float> x(size_t(rows) * dim), g(x.size()), y(x.size(), NAN), gx(x.size(), NAN);
        for (auto &v : x) v = nd(rng);
        for (auto &v : g) v = nd(rng) * 0.1f;
        emu::launch(rows, THREADS, [&] { log_softmax_f32(x.data(), y.data(), rows, dim); });
        emu::launch(rows, THREADS, [&] { log_softmax_bwd_f32(g.data(), y.data(), gx.data(), rows, dim); });
        // Backward errors relative to the largest |gradient| of the row (exp(y)·Σg reaches tens
        // at 152k columns; f32 holds it to about 1e-7 of that, 6e-7 seen).
        double worst_y = 0, worst_g = 0;
        for (uint32_t r = 0; r < rows; ++r) {
            const float *xr = &x[size_t(r) * dim];
            double m = *std::max_element(xr, xr + dim), s = 0, sg = 0;
            for (uint32_t i = 0; i < dim; ++i) s += std::exp(double(xr[i]) - m);
            double lse = m + std::log(s);
            for (uint32_t i = 0; i < dim; ++i) sg += g[size_t(r) * dim + i];
            double scale = 1.0;
            for (uint32_t i = 0; i < dim; ++i)
                scale = std::max(scale, std::fabs(g[size_t(r) * dim + i] - std::exp(double(xr[i]) - lse) * sg));
            for (uint32_t i = 0; i < dim; ++i) {
                size_t j = size_t(r) * dim + i;
                double want_y = double(xr[i]) - lse;
                worst_y = worse(worst_y, std::fabs(y[j] - want_y));
                double want_g = double(g[j]) - std::exp(want_y) * sg;
                worst_g = worse(worst_g, std::fabs(gx[j] - want_g) / scale);
            }
        }
        std::printf("log_softmax %u x %6u: worst abs error forward %.2e, backward (relative) %.2e\n", rows, dim, worst_y,
                    worst_g);
        if (!(worst_y < 1e-5 && worst_g < 3e-6)) ++failures;
    }
    if (failures) {
        std::fprintf(stderr, "%d case(s) failed\n", failures);
        return 1;
    }
    std::printf("all cases equal the reference\n");
    return 0;
}
