"""Hugging Face transformers `generate` (greedy, KV cache), timed like `nanogpt bench --sample`.

A GPT-2 model (GPT2LMHeadModel, random weights from a fixed seed: no download) gets a
prompt of --prompt tokens and generates --new tokens greedily with
torch.inference_mode and use_cache=True, with end-of-text disabled so every run
generates exactly --new tokens. A streamer timestamps every token as `generate`
emits it, so the time splits like nanogpt's:

    prefill = start .. first new token   (the prompt's forward and the first pick)
    decode  = first new token .. last    (--new - 1 one-token steps)

--bf16 loads the model as transformers users run it in bf16: torch_dtype=bfloat16
(weights and activations bf16; no autocast).

    /work/venv/bin/python scripts/compare/torch_generate.py --prompt 256 --new 256 --threads 2 --json
"""

import argparse
import json
import resource
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


class Clock:
    """A `generate` streamer that only records when each put() arrives."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def one_run(model, prompt, new):
    clock = Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=0, do_sample=False,
                             use_cache=True, streamer=clock)
    end = time.perf_counter()
    assert out.shape[1] == prompt.shape[1] + new, out.shape
    # The first put() is the prompt itself; then one per new token.
    stamps = clock.times[1:]
    assert len(stamps) == new, (len(stamps), new)
    prefill = stamps[0] - start
    decode = stamps[-1] - stamps[0]
    return prefill, decode, end - start, out[0, prompt.shape[1]:].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "gpt2-medium"])
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new", type=int, default=256, help="new tokens")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (after one untimed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="torch_dtype=bfloat16")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    torch.manual_seed(1337)
    torch.set_num_threads(a.threads)
    shape = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024)}[a.model]
    cfg = GPT2Config(n_layer=shape[0], n_head=shape[1], n_embd=shape[2], n_positions=1024,
                     vocab_size=50257, eos_token_id=None, bos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    if a.bf16:
        model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompt = (torch.arange(a.prompt) * 7919 % cfg.vocab_size).unsqueeze(0)
    one_run(model, prompt, min(a.new, 8))
    runs = [one_run(model, prompt, a.new) for _ in range(a.runs)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    report = {
        "prompt_tokens": a.prompt,
        "new_tokens": a.new,
        "prefill_ms": prefill * 1e3,
        "prefill_tokens_per_sec": a.prompt / prefill,
        "decode_ms_per_token": decode * 1e3 / (a.new - 1),
        "decode_tokens_per_sec": (a.new - 1) / decode,
        "total_ms": statistics.median(r[2] for r in runs) * 1e3,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
        "tokens": runs[-1][3][:8],
    }
    if a.json:
        print(json.dumps(report))
    else:
        print(f"transformers generate, {a.model}, {'bf16' if a.bf16 else 'f32'}, {a.threads} "
              f"threads, prompt {a.prompt}, {a.new} new: prefill {report['prefill_ms']:.0f} ms "
              f"({report['prefill_tokens_per_sec']:.0f} tokens/s), decode "
              f"{report['decode_tokens_per_sec']:.1f} tokens/s "
              f"({report['decode_ms_per_token']:.1f} ms/token)")


if __name__ == "__main__":
    main()
