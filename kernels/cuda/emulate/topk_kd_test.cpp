// ../src/topk_kd.cu run on the host (cuda_runtime_emu.h): the fused top-k distillation loss of
// each row against a double-precision reference written from the definitions (the whole row's
// softmax, the k-way or (k+1)-way distributions, each divergence), and its backward against
// central differences of that reference, for every divergence and tail, two temperatures, f32
// and bf16 logits; the cross-entropy as its k = 1 case; and the divergence with the
// cross-entropy beside it (its target in K and outside), the gradient written over the logits.
// Exits non-zero on the first mismatch.
#include "../src/topk_kd.cu"

#include "harness.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

static int failures = 0;
static std::mt19937 rng(12345);

// The reference divergence of one row (double), from the logits z (as doubles).
static double reference(const std::vector<double> &z, const std::vector<uint32_t> &ids, const std::vector<float> &lt,
                        int div, int tail, double beta, double tau, double floor, double *tmass, double *smass) {
    const size_t v = z.size(), k = ids.size();
    double m = -INFINITY;
    for (double x : z) m = std::max(m, x / tau);
    double s = 0;
    for (double x : z) s += std::exp(x / tau - m);
    const double lse = m + std::log(s);
    std::vector<double> t(k), u(k);
    for (size_t j = 0; j < k; ++j) {
        t[j] = lt[j];
        u[j] = z[ids[j]] / tau - lse;
    }
    auto logsumexp = [](const std::vector<double> &x) {
        double m = -INFINITY, s = 0;
        for (double v : x) m = std::max(m, v);
        for (double v : x) s += std::exp(v - m);
        return m + std::log(s);
    };
    const double lse_t = logsumexp(t), lse_s = logsumexp(u);
    *tmass = std::exp(lse_t);
    *smass = std::exp(lse_s);
    std::vector<double> tt = t, ss = u;
    auto tail_of = [&](double x) { return std::log(std::max(1.0 - std::exp(x), floor)); };
    if (tail == RENORMALIZE) {
        for (size_t j = 0; j < k; ++j) {
            tt[j] -= lse_t;
            ss[j] -= lse_s;
        }
    } else if (tail == BUCKET) {
        tt.push_back(tail_of(lse_t));
        ss.push_back(tail_of(lse_s));
    }
    double d = 0;
    for (size_t j = 0; j < tt.size(); ++j) {
        const double pt = std::exp(tt[j]), ps = std::exp(ss[j]);
        switch (div) {
            case FORWARD: d += pt * (tt[j] - ss[j]); break;
            case REVERSE: d += ps * (ss[j] - tt[j]); break;
            case JSD: {
                const double mm = std::log(beta * pt + (1 - beta) * ps);
                d += beta * pt * (tt[j] - mm) + (1 - beta) * ps * (ss[j] - mm);
                break;
            }
            default: d += 0.5 * std::fabs(pt - ps);
        }
    }
    return d;
}

// Random logits [rows, v] (normal, σ 2) and per row k distinct teacher ids (the first k of a
// shuffled vocabulary, kept in `perms`) with log-probs summing to `teacher_mass` over K (the
// single 0 of the cross-entropy where k = 1 and the mass is 1).
template <typename T>
struct Inputs {
    std::vector<T> z;
    std::vector<uint32_t> ids;
    std::vector<float> lt;
    std::vector<std::vector<uint32_t>> perms;

    Inputs(uint32_t rows, uint32_t v, uint32_t k, float teacher_mass) : z(size_t(rows) * v), ids(size_t(rows) * k) {
        std::normal_distribution<float> nd(0.0f, 2.0f);
        for (auto &x : z) x = from_f32<T>(nd(rng));
        lt.resize(ids.size());
        for (uint32_t r = 0; r < rows; ++r) {
            std::vector<uint32_t> perm(v);
            std::iota(perm.begin(), perm.end(), 0u);
            std::shuffle(perm.begin(), perm.end(), rng);
            std::vector<double> w(k);
            double sw = 0;
            for (auto &x : w) sw += (x = std::exp(nd(rng)));
            for (uint32_t j = 0; j < k; ++j) {
                ids[r * k + j] = perm[j];
                lt[r * k + j] = k == 1 && teacher_mass == 1.0f ? 0.0f : float(std::log(w[j] / sw * teacher_mass));
            }
            perms.push_back(std::move(perm));
        }
    }
};

template <typename T>
static void kd_case(const char *name, uint32_t rows, uint32_t v, uint32_t k, int div, int tail, float beta, float tau,
                    float teacher_mass) {
    const float floor = 1e-6f;
    std::normal_distribution<float> nd(0.0f, 2.0f);
    Inputs<T> in(rows, v, k, teacher_mass);
    std::vector<T> &z = in.z;
    const std::vector<uint32_t> &ids = in.ids;
    const std::vector<float> &lt = in.lt;
    std::vector<float> out(size_t(rows) * 4), g(rows);
    for (auto &x : g) x = nd(rng);
    std::vector<T> dz(z.size());
    const Loss L{div, tail, beta, 1.0f / tau, floor};
    emu::launch(rows, THREADS,
                [&] { topk_kd_fwd<T>(z.data(), ids.data(), lt.data(), nullptr, out.data(), rows, v, k, L); });
    emu::launch(rows, THREADS, [&] {
        topk_kd_bwd<T>(z.data(), ids.data(), lt.data(), nullptr, out.data(), g.data(), 1, 0, dz.data(), rows, v, k, L);
    });
    double worst_d = 0, worst_m = 0, worst_g = 0;
    for (uint32_t r = 0; r < rows; ++r) {
        std::vector<double> zr(v);
        for (uint32_t i = 0; i < v; ++i) zr[i] = to_f32(z[size_t(r) * v + i]);
        std::vector<uint32_t> idr(ids.begin() + r * k, ids.begin() + (r + 1) * k);
        std::vector<float> ltr(lt.begin() + r * k, lt.begin() + (r + 1) * k);
        double tm, sm;
        const double d = reference(zr, idr, ltr, div, tail, beta, tau, floor, &tm, &sm);
        worst_d = worse(worst_d, std::fabs(out[r * 4] - d) / (std::fabs(d) + 1e-3));
        worst_m = std::max({worst_m, std::fabs(out[r * 4 + 1] - tm), std::fabs(out[r * 4 + 2] - sm)});
        // Central differences at every column of K and every fifth other one.
        std::vector<double> want(v), got(v);
        double scale = 1e-30;
        for (uint32_t i = 0; i < v; ++i) {
            const bool in_k = std::find(idr.begin(), idr.end(), i) != idr.end();
            got[i] = to_f32(dz[size_t(r) * v + i]);
            if (!in_k && i % 5) continue;
            const double h = 1e-4;
            double a, b, x0 = zr[i];
            zr[i] = x0 + h;
            a = reference(zr, idr, ltr, div, tail, beta, tau, floor, &tm, &sm);
            zr[i] = x0 - h;
            b = reference(zr, idr, ltr, div, tail, beta, tau, floor, &tm, &sm);
            zr[i] = x0;
            want[i] = g[r] * (a - b) / (2 * h);
            scale = std::max(scale, std::fabs(want[i]));
        }
        for (uint32_t i = 0; i < v; ++i) {
            const bool in_k = std::find(idr.begin(), idr.end(), i) != idr.end();
            if (!in_k && i % 5) continue;
            worst_g = worse(worst_g, std::fabs(got[i] - want[i]) / scale);
        }
    }
    // f32 sums over V, and bf16's rounding of each gradient (2^-9 relative, at most 2^-8).
    const double gl = sizeof(T) == 2 ? 8e-3 : 2e-4;
    const std::string tag = std::string(name) + " div " + std::to_string(div) + " tail " + std::to_string(tail) +
                            " tau " + std::to_string(tau).substr(0, 3) + " k " + std::to_string(k) + " v " +
                            std::to_string(v);
    std::printf("%-44s divergence %.1e  masses %.1e  gradient %.1e\n", tag.c_str(), worst_d, worst_m, worst_g);
    if (!(worst_d < 2e-4 && worst_m < 1e-5 && worst_g < gl)) {
        std::printf("  ^ failed\n");
        ++failures;
    }
}

// The divergence and the cross-entropy of one row (double): g_kd·D + g_ce·CE, CE = lse(z) − z_y.
static double combined(const std::vector<double> &z, const std::vector<uint32_t> &ids, const std::vector<float> &lt,
                       uint32_t y, int div, int tail, double beta, double tau, double floor, double g_kd,
                       double g_ce, double *ce) {
    double tm, sm;
    const double d = reference(z, ids, lt, div, tail, beta, tau, floor, &tm, &sm);
    double m = -INFINITY, s = 0;
    for (double x : z) m = std::max(m, x);
    for (double x : z) s += std::exp(x - m);
    *ce = m + std::log(s) - z[y];
    return g_kd * d + g_ce * *ce;
}

// The divergence with the cross-entropy beside it (`ce` targets: even rows' in K, odd rows'
// outside), forward columns 4 and 5 and the gradient of g_kd·D + g_ce·CE against central
// differences, written over the logits (`in_place`) or into a buffer of its own.
template <typename T>
static void kd_ce_case(const char *name, uint32_t rows, uint32_t v, uint32_t k, int div, int tail, float tau,
                       bool in_place) {
    const float floor = 1e-6f, beta = 0.4f, teacher_mass = 0.9f;
    std::normal_distribution<float> nd(0.0f, 2.0f);
    Inputs<T> in(rows, v, k, teacher_mass);
    std::vector<T> &z = in.z;
    const std::vector<uint32_t> &ids = in.ids;
    const std::vector<float> &lt = in.lt;
    std::vector<uint32_t> y(rows);
    for (uint32_t r = 0; r < rows; ++r) {
        const std::vector<uint32_t> &perm = in.perms[r];
        y[r] = r % 2 == 0 ? perm[k / 2] : perm[k + r % (v - k)];
    }
    std::vector<float> out(size_t(rows) * COLS_CE), g(size_t(rows) * 2);
    for (auto &x : g) x = nd(rng);
    const std::vector<T> z0 = z;
    std::vector<T> own(z.size());
    T *dz = in_place ? z.data() : own.data();
    const Loss L{div, tail, beta, 1.0f / tau, floor};
    emu::launch(rows, THREADS,
                [&] { topk_kd_fwd<T>(z.data(), ids.data(), lt.data(), y.data(), out.data(), rows, v, k, L); });
    emu::launch(rows, THREADS, [&] {
        topk_kd_bwd<T>(z.data(), ids.data(), lt.data(), y.data(), out.data(), g.data(), 2, 1, dz, rows, v, k, L);
    });
    double worst_ce = 0, worst_g = 0;
    for (uint32_t r = 0; r < rows; ++r) {
        std::vector<double> zr(v);
        for (uint32_t i = 0; i < v; ++i) zr[i] = to_f32(z0[size_t(r) * v + i]);
        std::vector<uint32_t> idr(ids.begin() + r * k, ids.begin() + (r + 1) * k);
        std::vector<float> ltr(lt.begin() + r * k, lt.begin() + (r + 1) * k);
        double ce, ce2;
        const double gk = g[2 * r], gc = g[2 * r + 1];
        combined(zr, idr, ltr, y[r], div, tail, beta, tau, floor, gk, gc, &ce);
        double m = -INFINITY, s = 0;
        for (double x : zr) m = std::max(m, x);
        for (double x : zr) s += std::exp(x - m);
        worst_ce = std::max({worst_ce, std::fabs(out[r * COLS_CE + 4] - ce) / (std::fabs(ce) + 1e-3),
                             std::fabs(out[r * COLS_CE + 5] - (m + std::log(s)))});
        std::vector<double> want(v), got(v);
        double scale = 1e-30;
        auto checked = [&](uint32_t i) {
            return i == y[r] || std::find(idr.begin(), idr.end(), i) != idr.end() || i % 5 == 0;
        };
        for (uint32_t i = 0; i < v; ++i) {
            got[i] = to_f32(dz[size_t(r) * v + i]);
            if (!checked(i)) continue;
            const double h = 1e-4, x0 = zr[i];
            zr[i] = x0 + h;
            const double a = combined(zr, idr, ltr, y[r], div, tail, beta, tau, floor, gk, gc, &ce2);
            zr[i] = x0 - h;
            const double b = combined(zr, idr, ltr, y[r], div, tail, beta, tau, floor, gk, gc, &ce2);
            zr[i] = x0;
            want[i] = (a - b) / (2 * h);
            scale = std::max(scale, std::fabs(want[i]));
        }
        for (uint32_t i = 0; i < v; ++i) {
            if (checked(i)) worst_g = worse(worst_g, std::fabs(got[i] - want[i]) / scale);
        }
    }
    const double gl = sizeof(T) == 2 ? 8e-3 : 2e-4;
    const std::string tag = std::string(name) + (in_place ? " in place" : "") + " div " + std::to_string(div) +
                            " tail " + std::to_string(tail) + " tau " + std::to_string(tau).substr(0, 3);
    std::printf("%-44s cross-entropy %.1e  gradient %.1e\n", tag.c_str(), worst_ce, worst_g);
    if (!(worst_ce < 2e-5 && worst_g < gl)) {
        std::printf("  ^ failed\n");
        ++failures;
    }
}

int main() {
    for (int div = 0; div < 4; ++div)
        for (int tail = 0; tail < 3; ++tail)
            for (float tau : {1.0f, 0.7f}) {
                kd_case<float>("f32", 3, 301, 7, div, tail, 0.3f, tau, 0.9f);
            }
    kd_case<__nv_bfloat16>("bf16", 3, 500, 9, JSD, BUCKET, 0.5f, 1.0f, 0.8f);
    kd_case<__nv_bfloat16>("bf16", 3, 500, 9, REVERSE, RENORMALIZE, 0.5f, 2.0f, 0.95f);
    kd_case<float>("f32 k 40", 2, 5000, 40, FORWARD, BUCKET, 0.5f, 1.0f, 0.999f);
    // Cross-entropy: k = 1, teacher log-prob 0, forward KL, no tail.
    kd_case<float>("cross-entropy f32", 4, 1000, 1, FORWARD, IGNORE, 0.5f, 1.0f, 1.0f);
    kd_case<__nv_bfloat16>("cross-entropy bf16", 4, 1000, 1, FORWARD, IGNORE, 0.5f, 1.0f, 1.0f);
    // The divergence and the cross-entropy together, in place and not.
    for (int tail = 0; tail < 3; ++tail)
        for (float tau : {1.0f, 0.7f}) {
            kd_ce_case<float>("kd+ce f32", 4, 401, 9, tail == 1 ? JSD : FORWARD, tail, tau, true);
        }
    kd_ce_case<float>("kd+ce f32", 4, 401, 9, REVERSE, BUCKET, 1.0f, false);
    kd_ce_case<__nv_bfloat16>("kd+ce bf16", 4, 700, 12, FORWARD, BUCKET, 1.0f, true);
    kd_ce_case<__nv_bfloat16>("kd+ce bf16", 2, 700, 12, TV, IGNORE, 2.0f, true);
    if (failures) {
        std::fprintf(stderr, "%d case(s) failed\n", failures);
        return 1;
    }
    std::printf("all cases equal the reference\n");
    return 0;
}
