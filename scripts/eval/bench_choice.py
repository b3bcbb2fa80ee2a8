"""Multiple-choice scoring speed: `nanogpt eval --task choice` against `transformers`
scoring each choice on its own (what lm-evaluation-harness's `hf` model does at batch
size 1), on the same questions and weights.

The questions: a context of ~100 GPT-2 tokens (bundled Shakespeare) and 4 choices of
~20 tokens each, deterministic. Both sides run f32 on the same number of threads;
rounds alternate, and the median of each side is reported (questions per second):

    cargo build --release
    /work/venv/bin/python scripts/eval/bench_choice.py --model /tmp/m124_hf --threads 2
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def questions(n, tokenizer):
    text = open(os.path.join(ROOT, "data", "shakespeare", "input.txt"), encoding="utf-8").read()
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(0)
    out = []
    for _ in range(n):
        at = rng.randrange(len(ids) - 200)
        context = tokenizer.decode(ids[at:at + 100])
        choices = []
        for _ in range(4):
            c = rng.randrange(len(ids) - 30)
            choices.append(tokenizer.decode(ids[c:c + 20]).strip())
        out.append({"context": context, "choices": choices, "label": 0})
    return out


def torch_rate(model, tokenizer, qs):
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        for q in qs:
            ctx = tokenizer(q["context"])["input_ids"]
            for c in q["choices"]:
                whole = tokenizer(q["context"] + " " + c)["input_ids"]
                cont = whole[len(ctx):]
                logits = model(torch.tensor([whole[:-1]])).logits[0, -len(cont):]
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None]).sum()
                float(lp)
    return len(qs) / (time.perf_counter() - start)


def nanogpt_rate(nanogpt, model, path, threads, n):
    start = time.perf_counter()
    subprocess.run([nanogpt, "eval", "--init-from", model, "--task", "choice", "--data", path,
                    "--threads", str(threads), "--json"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return n / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face GPT-2 folder (nanogpt export)")
    ap.add_argument("--nanogpt", default=os.path.join(ROOT, "target", "release", "nanogpt"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("-n", type=int, default=20, help="questions per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    torch.set_num_threads(args.threads)
    tokenizer = GPT2TokenizerFast.from_pretrained(args.model)
    model = GPT2LMHeadModel.from_pretrained(args.model, dtype=torch.float32).eval()
    qs = questions(args.n, tokenizer)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "q.jsonl")
        with open(path, "w") as f:
            for q in qs:
                f.write(json.dumps(q) + "\n")
        torch_rate(model, tokenizer, qs[:2])  # warm-up
        for r in range(args.rounds):
            ours.append(nanogpt_rate(args.nanogpt, args.model, path, args.threads, len(qs)))
            theirs.append(torch_rate(model, tokenizer, qs))
            print(f"round {r}: nanogpt {ours[-1]:.2f} q/s (with start-up), transformers {theirs[-1]:.2f} q/s",
                  file=sys.stderr)
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{args.n} questions (context ~100 tokens, 4 choices of ~20), {args.threads} threads, "
          f"median of {args.rounds}: nanogpt {a:.2f} questions/s, transformers {b:.2f} questions/s, {a / b:.2f}x")


if __name__ == "__main__":
    main()
