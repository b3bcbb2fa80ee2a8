"""llama.cpp's greedy generation from a GGUF file, timed like `nanogpt bench --sample`.

Through llama-cpp-python (`pip install llama-cpp-python`, which builds llama.cpp for
this CPU). The prompt is --prompt fixed token ids; generation is greedy and does not
stop at end-of-text, so every run makes exactly --new tokens. Each token's arrival is
timestamped, so the time splits like nanogpt's:

    prefill = start .. first new token   (the prompt's evaluation and the first pick)
    decode  = first new token .. last    (--new - 1 one-token steps)

    /work/venv/bin/python scripts/compare/llama_cpp_generate.py MODEL.gguf --prompt 8 --new 200 --threads 2
"""

import argparse
import json
import os
import resource
import statistics
import time


def one_run(llm, prompt, new):
    llm.reset()
    start = time.perf_counter()
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == new:
            break
    prefill = times[0] - start
    decode = (times[-1] - times[0]) / (new - 1)
    return prefill, decode


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.new < 2:
        ap.error("--new must be at least 2")
    from llama_cpp import Llama

    llm = Llama(a.gguf, n_threads=a.threads, n_threads_batch=a.threads,
                n_ctx=a.prompt + a.new + 8, n_batch=max(a.prompt, 8), verbose=False)
    prompt = [1000 + i for i in range(a.prompt)]
    one_run(llm, prompt, 4)  # warm-up
    runs = [one_run(llm, prompt, a.new) for _ in range(a.runs)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    row = {
        "gguf": os.path.basename(a.gguf),
        "threads": a.threads,
        "prompt": a.prompt,
        "new": a.new,
        "prefill_ms": prefill * 1e3,
        "decode_ms_per_token": decode * 1e3,
        "decode_tokens_per_sec": 1 / decode,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if a.json:
        print(json.dumps(row))
    else:
        print(f"{row['gguf']}: prefill {row['prefill_ms']:.1f} ms, decoding "
              f"{row['decode_ms_per_token']:.2f} ms/token ({row['decode_tokens_per_sec']:.1f} "
              f"tokens/s), peak RSS {row['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
