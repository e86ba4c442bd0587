"""Two `teacher` builds side by side on one model: alternating rounds, each build a fresh process
with the same flags and thread count, timed by the same client (standard library only).

    python bench/teacher_ab.py --model MODEL_DIR --bin OLD/teacher --bin NEW/teacher \\
        [--batch 8] [--tokens 128] [--requests 5] [--rounds 3] [--threads 2] [--k 64]

Every request scores `--batch` sequences of `--tokens` fresh random ids (the cache is off, so it
never hits) on `/topk_logits` with MessagePack answers, one request at a time after a warm-up.
Prints per round and build the positions/s and the share of the worker's time outside the
forward (the scoring pass, from `/metrics`), then the medians as a Markdown table.
"""
import argparse, json, os, random, statistics, sys, time, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servers import free_port, healthy, start_teacher, wait


def run_once(binary, args):
    """(positions/s, scoring share) of one fresh `binary` process (a build's `teacher`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_teacher(os.path.dirname(binary), args.model, port, "--cache-bytes", "0",
                         "--max-queue-tokens", "65536", "--max-batch-tokens", "16384")
    try:
        wait(lambda: healthy(url) or proc.poll() is not None, limit=300)
        if proc.poll() is not None:
            raise SystemExit(f"{binary} exited with {proc.returncode}")
        vocab = json.loads(urllib.request.urlopen(url + "/v1/info").read())["vocab_size"]

        def request():
            ids = [[random.randrange(vocab) for _ in range(args.tokens)]
                   for _ in range(args.batch)]
            body = json.dumps({"sequences": ids, "k": args.k}).encode()
            r = urllib.request.Request(url + "/topk_logits", body, {
                "content-type": "application/json", "accept": "application/msgpack"})
            urllib.request.urlopen(r, timeout=1200).read()

        def seconds():
            val = {}
            for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
                name, _, v = line.partition(" ")
                val[name] = v
            # (model, scoring): the forward and the LM head's matmul, then top-k and the
            # cast/copy of the logits.
            phase = lambda p: float(val.get(f"xdistill_batch_{p}_duration_seconds_sum", 0))
            return (phase("forward") + phase("head"), phase("topk") + phase("copy"))

        request()
        (f0, k0), t0 = seconds(), time.perf_counter()
        for _ in range(args.requests):
            request()
        wall = time.perf_counter() - t0
        f1, k1 = seconds()
        positions = args.requests * args.batch * (args.tokens - 1)
        return positions / wall, (k1 - k0) / ((f1 - f0) + (k1 - k0))
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", action="append", required=True,
                    help="a build's `teacher` binary; once per build, in the order to alternate")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=64)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # the teachers inherit it
    results = [[] for _ in args.bin]
    for r in range(args.rounds):
        for b, rs in zip(args.bin, results):
            pos, share = run_once(b, args)
            rs.append((pos, share))
            print(f"round {r + 1}: {b}: {pos:.0f} positions/s, scoring share {share:.1%}",
                  flush=True)
    print(f"\n{args.batch} × {args.tokens} tokens, {args.requests} requests a round, "
          f"k = {args.k}, {args.threads} threads, medians of {args.rounds} rounds\n")
    print("| build | positions/s | scoring share |\n|---|---|---|")
    for b, rs in zip(args.bin, results):
        print(f"| {b} | {statistics.median(p for p, _ in rs):.0f} "
              f"| {statistics.median(s for _, s in rs):.1%} |")


if __name__ == "__main__":
    main()
