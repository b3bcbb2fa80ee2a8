"""nanoGPT's CPU quick start in PyTorch on the same prepared data, for a side-by-side
check of `nanogpt train` (loss and time per iteration).

Same settings as configs/train_shakespeare_char.toml and nanoGPT's train.py loop
(eval at every 250 iterations on 20 random batches, AdamW with decay on matrices,
warm-up + cosine schedule, clipping at 1.0). `--gelu none` is nanoGPT's exact GELU,
`--gelu tanh` is GPT-2's (what nanogpt uses). At the end the model is also scored on
every whole 64-token window of val.bin, like `nanogpt eval`.

    nanogpt prepare shakespeare --tokenizer char --out data/shakespeare_char
    .venv/bin/python scripts/compare/torch_quickstart.py --data data/shakespeare_char --gelu none
"""

import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from torch_gpt2 import Gpt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/shakespeare_char")
    ap.add_argument("--gelu", default="none", choices=["none", "tanh"])
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-iters", type=int, default=2000)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    train = np.memmap(f"{a.data}/train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(f"{a.data}/val.bin", dtype=np.uint16, mode="r")
    B, T, V = 12, 64, 65
    lr0, min_lr, warmup, decay_iters = 1e-3, 1e-4, 100, a.max_iters

    def batch(data):
        ix = torch.randint(len(data) - T, (B,))
        x = torch.stack([torch.from_numpy(data[i : i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    model = Gpt(V, T, 4, 4, 128, bias=False, gelu=a.gelu)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr0,
        betas=(0.9, 0.99),
    )

    def lr_at(it):
        if it < warmup:
            return lr0 * (it + 1) / (warmup + 1)
        if it > decay_iters:
            return min_lr
        ratio = (it - warmup) / (decay_iters - warmup)
        return min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr0 - min_lr)

    @torch.no_grad()
    def estimate():
        model.eval()
        out = [torch.stack([model(*batch(d)) for _ in range(20)]).mean().item() for d in (train, val)]
        model.train()
        return out

    times = []
    for it in range(a.max_iters + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        if it % 250 == 0:
            tr, va = estimate()
            print(f"step {it}: train loss {tr:.4f}, val loss {va:.4f}", flush=True)
        start = time.perf_counter()
        x, y = batch(train)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - start) * 1e3)
    print(f"median ms/iter (iters >= 10): {statistics.median(times[10:]):.1f}")
    with torch.no_grad():
        model.eval()
        n = (len(val) - 1) // T
        tokens = torch.from_numpy(val[: n * T + 1].astype(np.int64))
        total = 0.0
        for s in range(0, n, 64):
            k = min(64, n - s)
            x = tokens[s * T : (s + k) * T].view(k, T)
            y = tokens[s * T + 1 : (s + k) * T + 1].view(k, T)
            total += model(x, y).item() * k
        print(f"full val.bin windows: loss {total / n:.4f}")


if __name__ == "__main__":
    main()
