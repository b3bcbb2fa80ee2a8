"""Load on `nanogpt serve`: C concurrent clients for S seconds on loopback.

Starts `nanogpt serve --init-from MODEL --queue Q` on a free port; each client sends,
back to back, a mix of requests (completions of 1 to 64 tokens, a fifth streamed, a
fifth with echo + logprobs as lm-evaluation-harness sends them, a fifth chat), and some
clients hang up mid-stream. Reports every status seen (anything but 200 and 503 —
queue full — is a failure), latency percentiles of the answered requests, requests and
tokens per second, and the server's RSS over the run (sampled every 0.5 s from
/proc). Standard library only:

    cargo build --release
    python3 scripts/serve/load.py --model /tmp/m124_hf --clients 16 --seconds 60
"""

import argparse
import collections
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = "the king of denmark speaks to his son about the ghost that walks at night upon the castle wall".split()


def request(rng, block):
    # One token per word: prompt, template and completion stay within the context.
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, min(200, block - 90))))
    kind = rng.choice(["plain", "plain", "stream", "echo", "chat"])
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.8]),
            "seed": rng.randint(0, 1000)}
    path = "/v1/completions"
    if kind == "stream":
        body["stream"] = True
    elif kind == "echo":
        body.update(max_tokens=1, logprobs=1, echo=True, temperature=0)
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt[:300]}], "max_tokens": body["max_tokens"],
                "temperature": body["temperature"]}
    return kind, path, body


def client(port, block, until, seed, stats, lock):
    rng = random.Random(seed)
    while time.time() < until:
        kind, path, body = request(rng, block)
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            status = resp.status
            hang_up = kind == "stream" and status == 200 and rng.random() < 0.3
            data = resp.read(200) if hang_up else resp.read()
            tokens = 0
            if status == 200 and not hang_up and kind != "stream":
                tokens = json.loads(data)["usage"]["completion_tokens"]
        except Exception as e:  # noqa: BLE001 - every failure is counted and shown
            status, hang_up, tokens = f"exception {type(e).__name__}: {e}", False, 0
        finally:
            conn.close()
        elapsed = time.perf_counter() - start
        with lock:
            stats["status"][str(status) + (" (hung up)" if hang_up else "")] += 1
            if status == 200 and not hang_up:
                stats["latency"][kind].append(elapsed)
                stats["tokens"] += tokens
        if status == 503:
            time.sleep(0.2)


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--nanogpt", default=os.path.join(ROOT, "target", "release", "nanogpt"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--queue", type=int, default=8)
    args = ap.parse_args()
    server = subprocess.Popen([args.nanogpt, "serve", "--init-from", args.model, "--port", "0",
                               "--queue", str(args.queue)], stderr=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", server.stderr.readline()).group(1))
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
        idle = rss_mb(server.pid)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/v1/models")
        block = json.loads(conn.getresponse().read())["data"][0]["max_model_len"]
        stats = {"status": collections.Counter(), "latency": collections.defaultdict(list), "tokens": 0}
        lock = threading.Lock()
        until = time.time() + args.seconds
        threads = [threading.Thread(target=client, args=(port, block, until, i, stats, lock)) for i in range(args.clients)]
        start = time.time()
        for t in threads:
            t.start()
        rss = []
        while any(t.is_alive() for t in threads):
            rss.append(rss_mb(server.pid))
            time.sleep(0.5)
        wall = time.time() - start
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        alive = server.poll() is None
    finally:
        server.terminate()
        server.wait()
    all_lat = sorted(x for v in stats["latency"].values() for x in v)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    print(f"{args.clients} clients, {wall:.0f} s, queue {args.queue}, model {args.model}")
    print("statuses:", dict(stats["status"]))
    answered = len(all_lat)
    print(f"answered {answered} ({answered / wall:.2f}/s), {stats['tokens']} completion tokens in the "
          f"non-streamed ones; server counted {health['completion_tokens']} completion tokens, "
          f"{health['rejected_busy']} refused busy")
    print(f"latency (s): p50 {pct(all_lat, 0.5):.2f}, p90 {pct(all_lat, 0.9):.2f}, p99 {pct(all_lat, 0.99):.2f}, "
          f"max {all_lat[-1] if all_lat else float('nan'):.2f}")
    for kind, xs in sorted(stats["latency"].items()):
        xs.sort()
        print(f"  {kind:<6} n={len(xs):<5} p50 {pct(xs, 0.5):.2f} p99 {pct(xs, 0.99):.2f}")
    print(f"server RSS (MB): idle {idle:.0f}, during the run min {min(rss):.0f} median "
          f"{statistics.median(rss):.0f} max {max(rss):.0f}, last {rss[-1]:.0f}; still serving: {alive}")
    bad = [s for s in stats["status"] if not (s.startswith("200") or s.startswith("503"))]
    if bad or not alive:
        print("FAILED:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
