"""Issue 32, exact full-vocabulary distillation: the three ways a teacher can send its
distribution, side by side in one run, on real `teacher` processes over loopback HTTP.

    cargo build --release -p xdistill-server -p xdistill-trainer-cli
    cargo build --release -p xdistill-trainer --example full_vocab_cost
    PY=/path/to/venv/bin/python   # torch + transformers + safetensors + tokenizers
    $PY bench/full_vocab.py --bins target/release --tokenizers ../shared/tokenizers \
        --data ../shared/data/gsm8k/train.jsonl --out bench/full_vocab.json

Routes: `/hidden_states` (final-norm hidden states, H values per position in the serving dtype),
`/topk_logits` with k = 64, and full logits (`/topk_logits` with k = the whole vocabulary, the
server started with `--max-k` = vocab). Measures:
1. bytes per position on the wire (real MessagePack bodies; JSON requests, msgpack answers);
2. teacher positions/s per route (distinct GSM8K sequences, `--cache-bytes 0`, warm-up first,
   median of repeats, sizes of batch × sequence length), for a tiny and a mid teacher;
3. the student's extra work on the hidden route (teacher head + log-softmax, and the whole exact
   forward-KL loss forward + backward) per position: `trainer/examples/full_vocab_cost.rs`
   (candle) and the same computation in PyTorch, in the same run, one process per shape (peak
   RSS);
4. the top-64 + tail-bucket KL against the exact forward KL on one batch (a slightly trained
   teacher served over HTTP, its full distribution from the full-logits route, checked against
   `/hidden_states` + `/v1/head`; a student trained less from another seed, in PyTorch): per
   position values, relative gap and the cosine between the two gradients w.r.t. the student
   logits;
5. the 74x arithmetic (bytes of full logits over hidden states) for a 2k-hidden model and a
   Qwen3-8B-shaped one.
Prints markdown tables and writes everything as JSON. QUICK=1 in the environment: fewer repeats;
`--parts cost --cost-hidden 2048`: only part 3, at other hidden sizes. Figures: bench/README.md.
"""
import argparse, http.client, json, os, shutil, statistics, struct, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servers import free_port, healthy, start_teacher, wait  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = os.environ.get("QUICK") == "1"
K = 64


# ---------------------------------------------------------------------------------------------
# MessagePack (decode only; the venv has no msgpack): maps, arrays, str, bin, ints, floats.
def unpack(buf):
    mv = memoryview(buf)

    def read(i):
        b = mv[i]
        if b <= 0x7F:
            return b, i + 1
        if 0x80 <= b <= 0x8F:
            return rmap(i + 1, b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return rarr(i + 1, b & 0x0F)
        if 0xA0 <= b <= 0xBF:
            n = b & 0x1F
            return bytes(mv[i + 1:i + 1 + n]).decode(), i + 1 + n
        if b >= 0xE0:
            return b - 0x100, i + 1
        if b == 0xC0:
            return None, i + 1
        if b in (0xC2, 0xC3):
            return b == 0xC3, i + 1
        if b in (0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB):
            w = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}[b]
            n = int.from_bytes(mv[i + 1:i + 1 + w], "big")
            s = i + 1 + w
            v = mv[s:s + n]
            return (v if b <= 0xC6 else bytes(v).decode()), s + n
        if b == 0xCA:
            return struct.unpack(">f", mv[i + 1:i + 5])[0], i + 5
        if b == 0xCB:
            return struct.unpack(">d", mv[i + 1:i + 9])[0], i + 9
        if 0xCC <= b <= 0xCF:
            w = 1 << (b - 0xCC)
            return int.from_bytes(mv[i + 1:i + 1 + w], "big"), i + 1 + w
        if 0xD0 <= b <= 0xD3:
            w = 1 << (b - 0xD0)
            return int.from_bytes(mv[i + 1:i + 1 + w], "big", signed=True), i + 1 + w
        if b in (0xDC, 0xDD, 0xDE, 0xDF):
            w = 2 if b in (0xDC, 0xDE) else 4
            n = int.from_bytes(mv[i + 1:i + 1 + w], "big")
            return (rarr if b <= 0xDD else rmap)(i + 1 + w, n)
        raise ValueError(f"msgpack type 0x{b:02x} not handled")

    def rarr(i, n):
        out = []
        for _ in range(n):
            v, i = read(i)
            out.append(v)
        return out, i

    def rmap(i, n):
        out = {}
        for _ in range(n):
            k, i = read(i)
            v, i = read(i)
            out[k] = v
        return out, i

    v, end = read(0)
    assert end == len(mv), "trailing bytes"
    return v


# ---------------------------------------------------------------------------------------------
# HTTP
class Client:
    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)

    def request(self, method, path, body=None):
        """(status, body bytes, seconds): the time of the whole round trip, body received."""
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"content-type": "application/json", "accept": "application/msgpack"}
        t0 = time.perf_counter()
        self.conn.request(method, path, body=data, headers=hdrs)
        r = self.conn.getresponse()
        out = r.read()
        dt = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: {r.status} {out[:300]!r}")
        return out, dt


def route_body(route, seqs, vocab):
    if route == "hidden":
        return "/hidden_states", {"sequences": seqs}
    k = K if route == "top64" else vocab
    return "/topk_logits", {"sequences": seqs, "k": k, "values": "logprobs"}


# ---------------------------------------------------------------------------------------------
# Data: GSM8K text tokenized with the real Qwen3 tokenizer, cut into distinct sequences.
class Stream:
    def __init__(self, tok_path, data_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
        ids = []
        for line in open(data_path):
            if line.strip():
                v = json.loads(line)
                ids += tok.encode(v["question"] + "\n" + v["answer"] + "\n\n").ids
            if len(ids) > 400_000:
                break
        self.ids, self.pos = ids, 0

    def take(self, batch, length):
        """`batch` sequences of `length` ids never handed out before."""
        out = []
        for _ in range(batch):
            if self.pos + length > len(self.ids):
                self.pos = 0
            out.append(self.ids[self.pos:self.pos + length])
            self.pos += length
        return out


# ---------------------------------------------------------------------------------------------
# Models
def init_model(bins, tok, out, hidden, layers, heads, kv, inter, seed):
    subprocess.run([f"{bins}/trainer", "init-model", "--arch", "qwen3", "--tokenizer", tok,
                    "--hidden-size", str(hidden), "--layers", str(layers), "--heads", str(heads),
                    "--kv-heads", str(kv), "--intermediate-size", str(inter), "--tie-embeddings",
                    "--pad-vocab-to", "128", "--seed", str(seed), "--out", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train_lm(model_dir, out_dir, stream, steps, batch, length, lr):
    """A few steps of next-token cross-entropy on GSM8K (PyTorch), saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        x = torch.tensor(stream.take(batch, length))
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    m.save_pretrained(out_dir, safe_serialization=True)
    # The init-model config (transformers 5 writes `rope_parameters` where the server reads
    # `rope_theta`); the weights' names are the same.
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(model_dir, f)):
            shutil.copy(os.path.join(model_dir, f), out_dir)
    return losses


# ---------------------------------------------------------------------------------------------
# 1 + 2: bytes and positions/s per route
def bench_routes(bins, model, name, stream, sizes, repeats, full_cap, extra=()):
    port = free_port()
    proc = start_teacher(bins, model, port, "--cache-bytes", "0",
                         "--max-k", "1000000", "--max-answer-bytes", str(8 << 30),
                         "--max-body-bytes", str(256 << 20), *extra)
    try:
        wait(lambda: healthy(f"http://127.0.0.1:{port}"), 300)
        c = Client(port)
        info = json.loads(c.request("GET", "/v1/info")[0])
        fv = info["full_vocab"]
        vocab, hid = fv["vocab_size"], fv["hidden_size"]
        head, head_s = c.request("GET", "/v1/head")
        rows_out = []
        # Warm-up: every route once, at the largest size it will see.
        for route in ("hidden", "top64", "full"):
            b, s = sizes[-1] if route != "full" else sizes[0]
            path, body = route_body(route, stream.take(b, s), vocab)
            c.request("POST", path, body)
        for b, s in sizes:
            pos = b * (s - 1)
            for route in ("hidden", "top64", "full"):
                if route == "full" and pos > full_cap:
                    continue
                times, nbytes = [], []
                for _ in range(repeats):
                    path, body = route_body(route, stream.take(b, s), vocab)
                    out, dt = c.request("POST", path, body)
                    times.append(dt)
                    nbytes.append(len(out))
                    del out
                t = statistics.median(times)
                rows_out.append({"model": name, "route": route, "batch": b, "seq_len": s,
                                 "positions": pos, "bytes_per_position": statistics.median(nbytes) / pos,
                                 "seconds_median": t, "seconds": times,
                                 "positions_per_s": pos / t})
        return {"info_full_vocab": fv, "dtype": info.get("dtype"), "head_bytes": len(head),
                "head_get_seconds": head_s, "rows": rows_out}
    finally:
        proc.terminate()
        proc.wait()


def wire_bytes_bf16(bins, model, stream):
    """Bytes per position of /hidden_states from a teacher serving in bf16 (the GPU dtype)."""
    port = free_port()
    proc = start_teacher(bins, model, port, "--cache-bytes", "0", "--dtype", "bf16")
    try:
        wait(lambda: healthy(f"http://127.0.0.1:{port}"), 300)
        c = Client(port)
        seqs = stream.take(4, 64)
        out, _ = c.request("POST", "/hidden_states", {"sequences": seqs})
        r = unpack(out)
        return {"dtype": r["dtype"], "hidden_size": r["hidden_size"],
                "bytes_per_position": len(out) / (4 * 63)}
    finally:
        proc.terminate()
        proc.wait()


# ---------------------------------------------------------------------------------------------
# 3: the student's extra compute, candle vs PyTorch
def rss_now():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak():
    """Resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def torch_cost(hidden, vocab, rows, positions, chunk, repeats, device="cpu", dtype="f32"):
    """The same measurement as trainer/examples/full_vocab_cost.rs, in PyTorch: the head and the
    hidden states in `dtype`, the student logits in f32; on "cuda" the device is synchronised
    around each timing and the peak is the allocator's (max_memory_allocated), not the RSS."""
    import torch
    torch.manual_seed(0)
    cuda = device == "cuda"
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def mem():
        if cuda:
            return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        return rss_now()

    def reset():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak()

    rss0, _ = mem()
    w = (torch.randn(rows, hidden, device=device) * (2.0 / hidden ** 0.5)).to(dt)
    h = torch.randn(positions, hidden, device=device).to(dt)
    rss_in, _ = mem()
    reset()  # making the inputs had its own transient peak
    wv = w[:vocab]

    def timed(f):
        f()
        out = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            out.append(time.perf_counter() - t0)
        return out

    def head():
        with torch.no_grad():
            for r0 in range(0, positions, chunk):
                torch.log_softmax((h[r0:r0 + chunk] @ wv.T).float(), dim=-1)

    ht = timed(head)
    _, peak_head = mem()
    reset()
    s = (torch.randn(positions, vocab, device=device) * 2.0).requires_grad_(True)

    def loss():
        total = 0.0
        for r0 in range(0, positions, chunk):
            with torch.no_grad():
                lpt = torch.log_softmax((h[r0:r0 + chunk] @ wv.T).float(), dim=-1)
            lps = torch.log_softmax(s[r0:r0 + chunk], dim=-1)
            total = total + (lpt.exp() * (lpt - lps)).sum()
        (total / positions).backward()
        s.grad = None

    lt = timed(loss)
    _, peak_loss = mem()
    ms = lambda t: statistics.median(t) * 1e3 / positions
    gflop = 2.0 * hidden * vocab / 1e9
    return {"impl": "pytorch", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": device, "dtype": dtype,
            "hidden": hidden, "vocab": vocab, "rows": rows, "positions": positions,
            "chunk": chunk, "repeats": repeats, "head_logsoftmax_ms_per_pos": ms(ht),
            "head_logsoftmax_ms_samples": [t * 1e3 for t in ht], "head_gflop_per_pos": gflop,
            "head_gflops": gflop / (ms(ht) / 1e3), "loss_fwd_bwd_ms_per_pos": ms(lt),
            "rss_base_mb": rss0 / 1e6, "inputs_mb": (rss_in - rss0) / 1e6,
            "peak_head_over_inputs_mb": (peak_head - rss_in) / 1e6,
            "peak_loss_over_inputs_mb": (peak_loss - rss_in) / 1e6,
            "peak_rss_mb": max(peak_head, peak_loss) / 1e6}


def bench_cost(bins, shapes, positions, chunk, repeats, device="cpu", dtypes=("f32",)):
    ex = os.path.join(bins, "examples", "full_vocab_cost")
    out = []
    for hid, vocab, rows in shapes:
        for dtype in dtypes:
            args = ["--hidden", str(hid), "--vocab", str(vocab), "--rows", str(rows), "--positions",
                    str(positions), "--chunk", str(chunk), "--repeats", str(repeats),
                    "--device", device, "--dtype", dtype]
            for cmd in ([ex, *args], [sys.executable, os.path.abspath(__file__), "--torch-cost", *args]):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
                out.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(json.dumps({k: out[-1][k] for k in ("impl", "device", "dtype", "hidden",
                      "head_logsoftmax_ms_per_pos", "loss_fwd_bwd_ms_per_pos")}), flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# 4: top-64 + tail bucket against the exact forward KL
def kl_gap(bins, teacher_dir, student_dir, stream, batch, length):
    import torch
    from safetensors.torch import load as st_load
    from transformers import AutoModelForCausalLM
    port = free_port()
    proc = start_teacher(bins, teacher_dir, port, "--cache-bytes", "0", "--max-k", "1000000",
                         "--max-answer-bytes", str(8 << 30))
    try:
        wait(lambda: healthy(f"http://127.0.0.1:{port}"), 300)
        c = Client(port)
        fv = json.loads(c.request("GET", "/v1/info")[0])["full_vocab"]
        vocab = fv["vocab_size"]
        seqs = stream.take(batch, length)
        full = unpack(c.request("POST", "/topk_logits",
                                {"sequences": seqs, "k": vocab, "values": "logprobs"})[0])
        hid = unpack(c.request("POST", "/hidden_states", {"sequences": seqs})[0])
        head = st_load(bytes(c.request("GET", "/v1/head")[0]))
    finally:
        proc.terminate()
        proc.wait()
    # The teacher's full log-probs in id order, [N, V], from the full-logits route.
    lpt = []
    for r in full["results"]:
        n, k = r["shape"]
        ids = torch.frombuffer(bytearray(r["topk_ids"]), dtype=torch.int32).view(n, k).long()
        val = torch.frombuffer(bytearray(r["topk_values"]), dtype=torch.float32).view(n, k)
        lpt.append(torch.empty(n, k).scatter_(1, ids, val))
    lpt = torch.cat(lpt)
    # The same from /hidden_states + /v1/head (what the student side computes).
    assert hid["dtype"] == "f32"
    w = head["weight"].float()[:vocab]
    hs = torch.cat([torch.frombuffer(bytearray(r["hidden"]), dtype=torch.float32).view(*r["shape"])
                    for r in hid["results"]])
    lpt_h = torch.log_softmax(hs @ w.T, dim=-1)
    route_diff = (lpt_h - lpt).abs().max().item()
    # The student's logits at the same positions (rows 0..S-2 of each sequence).
    st = AutoModelForCausalLM.from_pretrained(student_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        zs = st(input_ids=torch.tensor(seqs)).logits[:, :-1, :vocab].reshape(-1, vocab)
    out = {"positions": int(zs.shape[0]), "batch": batch, "seq_len": length,
           "route_max_abs_diff_logprob": route_diff, "by_temperature": []}
    # τ = 1 is the pair as it is; smaller τ (both sides' logits divided by τ) sharpens the
    # teacher, i.e. shows the gap at a smaller tail mass (a trained teacher's regime).
    for tau in (1.0, 0.5, 0.25):
        out["by_temperature"].append(gap_at(torch.log_softmax(lpt / tau, dim=-1), zs / tau, tau))
    return out


def gap_at(lpt, zs, tau):
    import torch
    exact, approx, cos, ttail, stail = [], [], [], [], []
    g_exact_all, g_approx_all = [], []
    for r0 in range(0, zs.shape[0], 128):
        z = zs[r0:r0 + 128].clone().requires_grad_(True)
        t = lpt[r0:r0 + 128]
        lps = torch.log_softmax(z, dim=-1)
        d_exact = (t.exp() * (t - lps)).sum(-1)
        (ge,) = torch.autograd.grad(d_exact.sum(), z)
        lk, ik = t.topk(K, dim=-1)
        lsk = torch.log_softmax(z, dim=-1).gather(1, ik)
        mt = lk.exp().sum(-1)
        ms = lsk.exp().sum(-1)
        tail_t = torch.log1p(-mt.clamp(max=1 - 1e-7))
        tail_s = torch.log1p(-ms.clamp(max=1 - 1e-7))
        d_topk = (lk.exp() * (lk - lsk)).sum(-1) + tail_t.exp() * (tail_t - tail_s)
        (ga,) = torch.autograd.grad(d_topk.sum(), z)
        exact.append(d_exact.detach())
        approx.append(d_topk.detach())
        cos.append(torch.nn.functional.cosine_similarity(ge.double(), ga.double(), dim=-1))
        ttail.append(1 - mt.detach())
        stail.append(1 - ms.detach())
        g_exact_all.append(ge)
        g_approx_all.append(ga)
    exact, approx, cos = torch.cat(exact), torch.cat(approx), torch.cat(cos)
    ge, ga = torch.cat(g_exact_all).flatten(), torch.cat(g_approx_all).flatten()
    gap = exact - approx
    ent = -(lpt.exp() * lpt).sum(-1)
    return {"temperature": tau, "teacher_entropy_mean": ent.mean().item(),
            "exact_kl_mean": exact.mean().item(), "exact_kl_max": exact.max().item(),
            "topk_kl_mean": approx.mean().item(), "topk_kl_max": approx.max().item(),
            "gap_mean": gap.mean().item(), "gap_max": gap.max().item(),
            "gap_min": gap.min().item(),
            "rel_gap_of_means": (gap.mean() / exact.mean()).item(),
            "rel_gap_per_position_mean": (gap / exact).mean().item(),
            "rel_gap_per_position_max": (gap / exact).max().item(),
            "teacher_tail_mass_mean": torch.cat(ttail).mean().item(),
            "student_mass_outside_teacher_topk_mean": torch.cat(stail).mean().item(),
            "grad_cosine_per_position_mean": cos.mean().item(),
            "grad_cosine_per_position_median": cos.median().item(),
            "grad_cosine_per_position_min": cos.min().item(),
            "grad_cosine_batch": torch.nn.functional.cosine_similarity(ge.double(), ga.double(),
                                                                  dim=0).item(),
            "grad_norm_ratio_topk_over_exact": (ga.double().norm() / ge.double().norm()).item()}


# ---------------------------------------------------------------------------------------------
# 5: the 74x arithmetic
def arithmetic():
    out = []
    for name, h, rows in (("2k-hidden, 152k vocabulary", 2048, 151936),
                          ("Qwen3-8B (hidden 4096, 151,936 head rows)", 4096, 151936)):
        hid = 2 * h
        for ldt, lb in (("bf16", 2), ("f32", 4)):
            out.append({"model": name, "hidden": h, "rows": rows, "hidden_bf16_bytes": hid,
                        "logits_dtype": ldt, "logits_bytes": lb * rows,
                        "ratio": lb * rows / hid, "top64_bytes": 8 * K})
    return out


def machine():
    cpu = ""
    flags = ""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and not cpu:
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = line
    gpu = None
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True)
        gpu = r.stdout.strip() or None
    return {"cpu": cpu, "cores": os.cpu_count(), "avx2": " avx2" in flags, "gpu": gpu,
            "avx512f": " avx512f" in flags, "loadavg": open("/proc/loadavg").read().split()[:3]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bins", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--tokenizers", default=os.path.join(os.path.dirname(ROOT), "shared", "tokenizers"))
    ap.add_argument("--data", default=os.path.join(os.path.dirname(ROOT), "shared", "data", "gsm8k",
                                                   "train.jsonl"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "full_vocab.json"))
    ap.add_argument("--mid-hidden", type=int, default=1024)
    ap.add_argument("--cost-hidden", default="256,1024")
    ap.add_argument("--parts", default="kl,routes,cost", help="which measurements (for debugging)")
    ap.add_argument("--torch-cost", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--positions", type=int)
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the teachers serve on the GPU in bf16 (random weights, no KL-gap "
                         "part), larger batches; the student-side cost on the GPU in f32 and bf16")
    ap.add_argument("--dtype", default="f32", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_cost:
        print(json.dumps(torch_cost(a.hidden, a.vocab, a.rows, a.positions, a.chunk, a.repeats,
                                    a.device, a.dtype)))
        return
    if a.device == "cuda":
        return main_cuda(a)
    parts = set(a.parts.split(","))
    report = {"machine_start": machine(), "quick": QUICK, "parts": sorted(parts)}
    tok = os.path.join(a.tokenizers, "qwen3", "tokenizer.json")
    stream = Stream(tok, a.data)
    reps = 2 if QUICK else 3
    with tempfile.TemporaryDirectory() as tmp:
        if parts & {"kl", "routes"}:
            served(report, parts, a, tok, stream, reps, lambda n: os.path.join(tmp, n))
    shapes = [(int(h), 151669, 151680) for h in a.cost_hidden.split(",")]
    if "cost" in parts:
        report["cost"] = bench_cost(a.bins, shapes, 64, 64, reps)
    report["arithmetic"] = arithmetic()
    report["machine_end"] = machine()
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print_tables(report)


def main_cuda(a):
    """The GPU run (`--device cuda`): routes 1-2 from teachers serving in bf16 on the GPU, at
    larger batches, and part 3 on the GPU in f32 (the trainer's head dtype) and bf16."""
    report = {"machine_start": machine(), "device": "cuda", "quick": QUICK}
    tok = os.path.join(a.tokenizers, "qwen3", "tokenizer.json")
    stream = Stream(tok, a.data)
    reps = 2 if QUICK else 3
    gpu = ("--device", "cuda", "--dtype", "bf16", "--max-batch-tokens", "8192",
           "--max-queue-tokens", str(1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        report["routes"] = []
        for h in (1024, 2048):
            d = os.path.join(tmp, f"h{h}")
            init_model(a.bins, tok, d, h, 4, h // 128, max(2, h // 256), 3 * h, seed=3)
            r = bench_routes(a.bins, d, f"H={h} (4 layers)", stream,
                             [(1, 512), (4, 512), (8, 1024)], reps, full_cap=512, extra=gpu)
            report["routes"].append(r)
            print(json.dumps(r["rows"][-3:]), flush=True)
    shapes = [(h, 151669, 151680) for h in (1024, 4096)]
    report["cost"] = bench_cost(a.bins, shapes, 2048, 512, reps, "cuda", ("f32", "bf16"))
    report["arithmetic"] = arithmetic()
    report["machine_end"] = machine()
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print_tables(report)


def served(report, parts, a, tok, stream, reps, p):
    """Parts 4 (KL gap), 1 and 2 (routes): models made, trained a little and served."""
    init_model(a.bins, tok, p("t0"), 256, 4, 4, 2, 512, seed=1)
    init_model(a.bins, tok, p("s0"), 256, 2, 4, 2, 512, seed=2)
    mh = a.mid_hidden
    init_model(a.bins, tok, p("mid"), mh, 4, max(4, mh // 128), max(2, mh // 256), 2 * mh, seed=3)
    t0 = time.time()
    tl = train_lm(p("t0"), p("teacher"), stream, 3 if QUICK else 6, 2, 128, 5e-3)
    sl = train_lm(p("s0"), p("student"), stream, 2, 2, 128, 5e-3)
    report["training"] = {"teacher_ce": [tl[0], tl[-1]], "teacher_steps": len(tl),
                          "student_ce": [sl[0], sl[-1]], "student_steps": len(sl),
                          "seconds": time.time() - t0}
    print(f"trained teacher CE {tl[0]:.2f} -> {tl[-1]:.2f} ({len(tl)} steps), student "
          f"{sl[0]:.2f} -> {sl[-1]:.2f} ({len(sl)} steps)", flush=True)
    if "kl" in parts:
        report["kl_gap"] = kl_gap(a.bins, p("teacher"), p("student"), stream, 4, 128)
        print(json.dumps(report["kl_gap"], indent=1), flush=True)
    if "routes" in parts:
        report["hidden_bf16"] = wire_bytes_bf16(a.bins, p("teacher"), stream)
        sizes = [(1, 32), (2, 64), (4, 128)] if not QUICK else [(1, 32), (2, 64)]
        report["routes"] = []
        for name, d in (("tiny H=256", p("teacher")), (f"mid H={mh}", p("mid"))):
            r = bench_routes(a.bins, d, name, stream, sizes, reps, full_cap=128)
            report["routes"].append(r)
            print(f"{name}: {len(r['rows'])} measurements", flush=True)


def print_tables(rep):
    m = rep["machine_start"]
    print(f"\n{m['cpu']}, {m['cores']} cores, avx2={m['avx2']} avx512f={m['avx512f']}, load "
          f"{' '.join(m['loadavg'])} -> {' '.join(rep['machine_end']['loadavg'])}"
          + (f"; GPU {m['gpu']}" if m.get("gpu") else ""))
    print("\n| teacher | route | batch × len | positions | bytes/position | positions/s |")
    print("|---|---|---|---|---|---|")
    for r in rep.get("routes", []):
        for x in r["rows"]:
            print(f"| {x['model']} ({r['dtype']}) | {x['route']} | {x['batch']} × {x['seq_len']} | "
                  f"{x['positions']} | {x['bytes_per_position']:,.0f} | {x['positions_per_s']:,.0f} |")
    hb = rep.get("hidden_bf16", {"hidden_size": "-", "bytes_per_position": float("nan")})
    print(f"\n/hidden_states served in bf16 (H = {hb['hidden_size']}): "
          f"{hb['bytes_per_position']:,.1f} bytes/position")
    print("\n| impl | H | vocab | head + log-softmax ms/pos | GFLOP/s | loss fwd+bwd ms/pos | "
          "inputs MB | peak over inputs: head / loss MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rep.get("cost", []):
        print(f"| {x['impl']} ({x.get('device', 'cpu')} {x.get('dtype', 'f32')}) | {x['hidden']} | {x['vocab']} | {x['head_logsoftmax_ms_per_pos']:.2f} | "
              f"{x['head_gflops']:.1f} | {x['loss_fwd_bwd_ms_per_pos']:.2f} | {x['inputs_mb']:.0f} | "
              f"{x['peak_head_over_inputs_mb']:.0f} / {x['peak_loss_over_inputs_mb']:.0f} | "
              f"{x['peak_rss_mb']:.0f} |")
    g = rep.get("kl_gap", {})
    print(f"\nKL gap, top-64 + tail vs exact forward KL ({g.get('positions')} positions; "
          f"/hidden_states + /v1/head vs full logits: max |Δ log p| = "
          f"{g.get('route_max_abs_diff_logprob', float('nan')):.2g})")
    print("\n| τ | teacher entropy | teacher tail mass | student mass outside | exact KL mean / max "
          "| top-k KL mean / max | gap mean / max | relative gap (of means; per position max) "
          "| grad cosine per position mean / min | batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for x in g.get("by_temperature", []):
        print(f"| {x['temperature']} | {x['teacher_entropy_mean']:.2f} | "
              f"{x['teacher_tail_mass_mean']:.3f} | {x['student_mass_outside_teacher_topk_mean']:.3f} | "
              f"{x['exact_kl_mean']:.4f} / {x['exact_kl_max']:.4f} | {x['topk_kl_mean']:.4f} / "
              f"{x['topk_kl_max']:.4f} | {x['gap_mean']:.4f} / {x['gap_max']:.4f} | "
              f"{x['rel_gap_of_means']:.1%}; {x['rel_gap_per_position_max']:.1%} | "
              f"{x['grad_cosine_per_position_mean']:.4f} / {x['grad_cosine_per_position_min']:.4f} | "
              f"{x['grad_cosine_batch']:.4f} |")
    print("\n| model | logits dtype | hidden bf16 B | logits B | ratio |")
    print("|---|---|---|---|---|")
    for x in rep["arithmetic"]:
        print(f"| {x['model']} | {x['logits_dtype']} | {x['hidden_bf16_bytes']:,} | "
              f"{x['logits_bytes']:,} | {x['ratio']:.1f}× |")


if __name__ == "__main__":
    main()
