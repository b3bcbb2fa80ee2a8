"""PyTorch eager GPT-2 training step, timed like `nanogpt bench` for side-by-side ratios.

The model is nanoGPT-shaped (pre-LN blocks, scaled_dot_product_attention with
is_causal, tanh GELU, classifier tied to wte, vocab padded to 50304 like nanoGPT),
the step is forward + backward + clip_grad_norm_(1.0) + AdamW (PyTorch's default
implementation, as nanoGPT uses on CPU), on synthetic tokens.

    python3 -m venv .venv && .venv/bin/pip install torch
    .venv/bin/python scripts/compare/torch_gpt2.py --batch-size 4 --block-size 256 --threads 2 --json
    .venv/bin/python scripts/compare/torch_gpt2.py --n-layer 4 --n-head 4 --n-embd 128 --vocab-size 65 \
        --batch-size 12 --block-size 64 --steps 50 --threads 2     # the quick-start shape

scripts/compare/compare.py runs this and nanogpt alternately and prints the ratios.
"""

import argparse
import json
import math
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, nh, bias, gelu="tanh"):
        super().__init__()
        self.nh = nh
        self.gelu = gelu
        self.ln_1 = nn.LayerNorm(c, bias=bias)
        self.c_attn = nn.Linear(c, 3 * c, bias=bias)
        self.attn_proj = nn.Linear(c, c, bias=bias)
        self.ln_2 = nn.LayerNorm(c, bias=bias)
        self.c_fc = nn.Linear(c, 4 * c, bias=bias)
        self.mlp_proj = nn.Linear(4 * c, c, bias=bias)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=self.gelu))


class Gpt(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, n_embd, bias, gelu="tanh"):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, bias, gelu) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--bias", action="store_true", default=True)
    ap.add_argument("--no-bias", dest="bias", action="store_false")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--fused", action="store_true", help="fused AdamW")
    ap.add_argument("--bf16", action="store_true", help="torch.autocast('cpu', bfloat16)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    torch.manual_seed(1337)
    torch.set_num_threads(a.threads)
    model = Gpt(a.vocab_size, a.block_size, a.n_layer, a.n_head, a.n_embd, a.bias)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
        fused=a.fused or None,
    )
    step_model = torch.compile(model) if a.compile else model
    b, t = a.batch_size, a.block_size
    x = torch.randint(a.vocab_size, (b, t))
    y = torch.randint(a.vocab_size, (b, t))
    times = []
    for i in range(a.warmup + a.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    n_params = sum(p.numel() for p in model.parameters()) - a.block_size * a.n_embd
    flops_per_token = 6 * n_params + 12 * a.n_layer * a.n_embd * t
    report = {
        "ms_per_step": ms,
        "ms_per_step_min": min(times),
        "tokens_per_sec": b * t / (ms / 1e3),
        "flops_per_token": flops_per_token,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
    }
    if a.json:
        print(json.dumps(report))
    else:
        print(
            f"torch {torch.__version__}, B={b} T={t}, {a.threads} threads: {ms:.1f} ms/step "
            f"(median of {a.steps}, min {min(times):.1f}), {report['tokens_per_sec']:.0f} tokens/s, "
            f"peak RSS {report['peak_rss_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
