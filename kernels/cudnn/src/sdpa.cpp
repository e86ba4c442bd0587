// cuDNN's fused scaled-dot-product attention (SDPA) behind a small C interface for Rust.
//
// cuDNN is loaded at run time (the frontend's dynamic loading, dlopen of libcudnn.so.9): nothing
// links against it, so a binary starts where cuDNN is absent and the caller falls back to its
// own attention. Built graphs are cached by their description (shapes, strides, dtype, mask),
// as llm.c's cudnn_att.cpp and PyTorch's MHA.cpp do: building one takes milliseconds to seconds
// (at most MAX_GRAPHS of them, the least recently used dropped first).
//
// Tensors are described as cuDNN wants them, logical [B, H, S, D] with any strides, so the
// caller passes its projections' [B, S, H, D] layout without transposing.
//
// Two graphs per description: the forward (o, and for training the softmax statistics) and the
// backward (dq, dk, dv from q, k, v, o, do and the statistics; deterministic, grouped-query
// heads' dk and dv reduced by cuDNN).
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}
namespace fe = cudnn_frontend;

extern "C" {
// Mirrors `SdpaDesc` in lib.rs (repr(C)); every field is part of the graph cache's key.
struct XdSdpaDesc {
    uint64_t context;  // the CUDA context (CUcontext): one cuDNN handle each
    int32_t dtype;     // 0: bf16, 1: f16
    int32_t b, hq, hkv, sq, skv, d;
    int32_t backward;  // 0: the forward graph; 1: the backward graph (o_stride is also do's)
    int64_t q_stride[4], k_stride[4], v_stride[4], o_stride[4];  // elements, [B, H, S, D] order
    float scale;
    int32_t causal;  // 0: none, 1: top-left (sq == skv), 2: bottom-right (queries are the last sq)
    int32_t window;  // > 0: a key j is seen by query i only when i - j < window
    int32_t stats;   // 1: also write the softmax statistics (log-sum-exp), f32 [B, H, Sq, 1]
};
static_assert(sizeof(XdSdpaDesc) == 184, "XdSdpaDesc has implicit padding");
}

namespace {
constexpr int64_t Q_UID = 1, K_UID = 2, V_UID = 3, O_UID = 4, STATS_UID = 5;
constexpr int64_t DO_UID = 6, DQ_UID = 7, DK_UID = 8, DV_UID = 9;

struct Entry {
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
};

std::mutex mu;  // one cuDNN handle per context is not safe to share across threads at once
// Never destroyed (allocated once, never freed, as PyTorch does with its cuDNN objects): at
// exit, static destructors would run after libcudnn (dlopened later) has torn itself down.
std::map<uint64_t, cudnnHandle_t> &handles = *new std::map<uint64_t, cudnnHandle_t>;
// The built graphs by description, each with the tick of its last use: at most MAX_GRAPHS
// (a server that sees many shapes would otherwise grow without bound); past it the least
// recently used is dropped.
constexpr size_t MAX_GRAPHS = 1024;
struct Cached {
    Entry entry;
    uint64_t used = 0;
};
std::map<std::string, Cached> &graphs = *new std::map<std::string, Cached>;
uint64_t tick = 0;
uint64_t built = 0;  // graphs built, for tests and logs (xd_sdpa_graphs_built)
void set_err(char *err, size_t n, const std::string &msg) {
    if (err && n) {
        std::snprintf(err, n, "%s", msg.c_str());
    }
}

std::string key_of(const XdSdpaDesc &d) {
    return std::string(reinterpret_cast<const char *>(&d), sizeof d);
}

// The handle of `d.context` (made current by the caller), created on first use.
cudnnHandle_t handle_for(const XdSdpaDesc &d) {
    auto it = handles.find(d.context);
    if (it != handles.end()) {
        return it->second;
    }
    cudnnHandle_t h = nullptr;
    auto st = fe::detail::create_handle(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
        throw std::runtime_error(std::string("cudnnCreate failed: ") + fe::detail::get_error_string(st));
    }
    handles.emplace(d.context, h);
    return h;
}

#define XD_CHECK(expr)                                                              \
    do {                                                                            \
        auto e_ = (expr);                                                           \
        if (e_.is_bad()) {                                                          \
            throw std::runtime_error(std::string(#expr) + ": " + e_.get_message()); \
        }                                                                           \
    } while (0)

std::vector<int64_t> vec4(const int64_t s[4]) { return {s[0], s[1], s[2], s[3]}; }

// Contiguous strides of logical [b, h, s, d].
std::vector<int64_t> packed(int64_t b, int64_t h, int64_t s, int64_t d) {
    (void)b;
    return {h * s * d, s * d, d, 1};
}

// The mask options both graphs share.
template <typename Attrs>
void set_mask(Attrs &opts, const XdSdpaDesc &d) {
    if (d.causal == 1) {
        opts.set_causal_mask(true);
    } else if (d.causal == 2) {
        opts.set_causal_mask_bottom_right(true);
    }
    if (d.window > 0) {
        opts.set_diagonal_band_left_bound(d.window);
    }
}

// One graph per description, built for its exact shapes. Graphs built with dynamic shapes and a
// kernel cache shared by their family gave garbage on an H200 with cuDNN 9.27 (2026-11-29:
// non-finite outputs, a second run differing from the first, a KV cache's chunk at relative
// error 1.0); built static, every cuDNN test of shared/tests/cudnn_attention.rs that compares
// with f64 passed, each new shape costing 44-58 ms once (bench/gpu/ logs of that day).
Entry build(const XdSdpaDesc &d, cudnnHandle_t h) {
    auto io = d.dtype == 0 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = g->tensor(fe::graph::Tensor_attributes().set_name("Q").set_uid(Q_UID).set_dim({d.b, d.hq, d.sq, d.d}).set_stride(vec4(d.q_stride)));
    auto k = g->tensor(fe::graph::Tensor_attributes().set_name("K").set_uid(K_UID).set_dim({d.b, d.hkv, d.skv, d.d}).set_stride(vec4(d.k_stride)));
    auto v = g->tensor(fe::graph::Tensor_attributes().set_name("V").set_uid(V_UID).set_dim({d.b, d.hkv, d.skv, d.d}).set_stride(vec4(d.v_stride)));
    if (d.backward) {
        // dq, dk, dv contiguous in [B, H, S, D]; the statistics f32 [B, Hq, Sq, 1].
        auto o = g->tensor(fe::graph::Tensor_attributes().set_name("O").set_uid(O_UID).set_dim({d.b, d.hq, d.sq, d.d}).set_stride(vec4(d.o_stride)));
        auto dO = g->tensor(fe::graph::Tensor_attributes().set_name("dO").set_uid(DO_UID).set_dim({d.b, d.hq, d.sq, d.d}).set_stride(vec4(d.o_stride)));
        auto stats = g->tensor(fe::graph::Tensor_attributes()
                                   .set_name("Stats")
                                   .set_uid(STATS_UID)
                                   .set_dim({d.b, d.hq, d.sq, 1})
                                   .set_stride(packed(d.b, d.hq, d.sq, 1))
                                   .set_data_type(fe::DataType_t::FLOAT));
        auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(d.scale).set_deterministic_algorithm(true);
        set_mask(opts, d);
        auto [dQ, dK, dV] = g->sdpa_backward(q, k, v, o, dO, stats, opts);
        dQ->set_output(true).set_uid(DQ_UID).set_dim({d.b, d.hq, d.sq, d.d}).set_stride(packed(d.b, d.hq, d.sq, d.d));
        dK->set_output(true).set_uid(DK_UID).set_dim({d.b, d.hkv, d.skv, d.d}).set_stride(packed(d.b, d.hkv, d.skv, d.d));
        dV->set_output(true).set_uid(DV_UID).set_dim({d.b, d.hkv, d.skv, d.d}).set_stride(packed(d.b, d.hkv, d.skv, d.d));
    } else {
        auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(d.stats != 0).set_attn_scale(d.scale);
        set_mask(opts, d);
        auto [o, stats] = g->sdpa(q, k, v, opts);
        o->set_output(true).set_uid(O_UID).set_dim({d.b, d.hq, d.sq, d.d}).set_stride(vec4(d.o_stride));
        if (d.stats) {
            stats->set_output(true).set_uid(STATS_UID).set_data_type(fe::DataType_t::FLOAT).set_dim({d.b, d.hq, d.sq, 1}).set_stride(packed(d.b, d.hq, d.sq, 1));
        }
    }
    XD_CHECK(g->validate());
    XD_CHECK(g->build_operation_graph(h));
    XD_CHECK(g->create_execution_plans({fe::HeurMode_t::A}));
    XD_CHECK(g->check_support(h));
    XD_CHECK(g->build_plans(h));
    Entry e;
    e.graph = g;
    XD_CHECK(g->get_workspace_size(e.workspace));
    return e;
}

Entry &entry_for(const XdSdpaDesc &d) {
    if (!fe::cudnn_dlhandle) {
        // The frontend resolves each cuDNN symbol once and keeps what it found: a call before
        // the library is loaded would leave every later one without it.
        throw std::runtime_error("cuDNN is not loaded (xd_cudnn_load first)");
    }
    auto key = key_of(d);
    auto it = graphs.find(key);
    if (it != graphs.end()) {
        it->second.used = ++tick;
        return it->second.entry;
    }
    auto h = handle_for(d);
    Entry e = build(d, h);
    ++built;
    if (graphs.size() >= MAX_GRAPHS) {
        auto oldest = graphs.begin();
        for (auto i = graphs.begin(); i != graphs.end(); ++i) {
            if (i->second.used < oldest->second.used) {
                oldest = i;
            }
        }
        graphs.erase(oldest);  // kernels it launched are queued already and do not need it
    }
    Cached c;
    c.entry = std::move(e);
    c.used = ++tick;
    return graphs.emplace(key, std::move(c)).first->second.entry;
}

// Runs `desc`'s graph on `stream` with the device pointers `pack` (by uid). The caller holds `mu`.
void execute(const XdSdpaDesc &desc, void *stream, std::unordered_map<int64_t, void *> &pack, void *workspace) {
    auto &e = entry_for(desc);
    auto h = handle_for(desc);
    auto st = fe::detail::set_stream(h, static_cast<cudaStream_t>(stream));
    if (st != CUDNN_STATUS_SUCCESS) {
        throw std::runtime_error(std::string("cudnnSetStream: ") + fe::detail::get_error_string(st));
    }
    XD_CHECK(e.graph->execute(h, pack, workspace));
}
}  // namespace

extern "C" {
// Loads cuDNN; returns its version (e.g. 91300), or -1 with the reason in `err`.
int64_t xd_cudnn_load(char *err, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    if (!fe::cudnn_dlhandle) {
        fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
        if (!fe::cudnn_dlhandle) {
            const char *why = dlerror();
            set_err(err, n, std::string("dlopen libcudnn.so.9: ") + (why ? why : "unknown error"));
            return -1;
        }
    }
    try {
        return static_cast<int64_t>(fe::detail::get_backend_version());
    } catch (const std::exception &e) {
        set_err(err, n, e.what());
        return -1;
    }
}

// Graphs built so far in this process (each description once; evicted ones count too).
uint64_t xd_sdpa_graphs_built(void) {
    std::lock_guard<std::mutex> lock(mu);
    return built;
}

// Builds (or finds) the graph of `desc`; `*workspace` gets the bytes its run needs.
int32_t xd_sdpa_prepare(const XdSdpaDesc *desc, int64_t *workspace, char *err, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    try {
        *workspace = entry_for(*desc).workspace;
        return 0;
    } catch (const std::exception &e) {
        set_err(err, n, e.what());
        return 1;
    }
}

// Runs `desc`'s forward graph on `stream`: o = softmax(scale · q kᵀ + mask) v (and the statistics).
int32_t xd_sdpa_run(const XdSdpaDesc *desc, void *stream, const void *q, const void *k, const void *v, void *o,
                    void *stats, void *workspace, char *err, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    try {
        if (desc->backward) {
            throw std::runtime_error("xd_sdpa_run takes a forward description");
        }
        std::unordered_map<int64_t, void *> pack = {{Q_UID, const_cast<void *>(q)},
                                                    {K_UID, const_cast<void *>(k)},
                                                    {V_UID, const_cast<void *>(v)},
                                                    {O_UID, o}};
        if (desc->stats) {
            pack.emplace(STATS_UID, stats);
        }
        execute(*desc, stream, pack, workspace);
        return 0;
    } catch (const std::exception &ex) {
        set_err(err, n, ex.what());
        return 1;
    }
}

// Runs `desc`'s backward graph on `stream`: dq, dk, dv (contiguous [B, H, S, D]) from q, k, v,
// the forward's o and statistics, and do (in o's layout).
int32_t xd_sdpa_backward_run(const XdSdpaDesc *desc, void *stream, const void *q, const void *k, const void *v,
                             const void *o, const void *d_o, const void *stats, void *dq, void *dk, void *dv,
                             void *workspace, char *err, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    try {
        if (!desc->backward) {
            throw std::runtime_error("xd_sdpa_backward_run takes a backward description");
        }
        std::unordered_map<int64_t, void *> pack = {
            {Q_UID, const_cast<void *>(q)},       {K_UID, const_cast<void *>(k)},
            {V_UID, const_cast<void *>(v)},       {O_UID, const_cast<void *>(o)},
            {DO_UID, const_cast<void *>(d_o)},    {STATS_UID, const_cast<void *>(stats)},
            {DQ_UID, dq},                         {DK_UID, dk},
            {DV_UID, dv}};
        execute(*desc, stream, pack, workspace);
        return 0;
    } catch (const std::exception &ex) {
        set_err(err, n, ex.what());
        return 1;
    }
}
}
