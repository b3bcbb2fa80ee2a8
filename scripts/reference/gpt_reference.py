#!/usr/bin/env python3
"""PyTorch reference for the Rust GPT-2 engine: writes the golden fixtures.

A small GPT-2 (nanoGPT semantics: pre-LN blocks, causal self-attention, GELU-tanh
MLP, classifier tied to the token embedding) is built with fixed random weights, run
forward and backward on one random batch, then trained for 10 AdamW iterations with
nanoGPT's learning-rate schedule and gradient clipping. Everything needed to check
the Rust implementation goes into one safetensors file per variant:

    tests/fixtures/gpt_small_bias.safetensors     (bias=True)
    tests/fixtures/gpt_small_nobias.safetensors   (bias=False)

Setup and run (from the repository root):

    python3 -m venv .venv && .venv/bin/pip install torch numpy safetensors
    .venv/bin/python scripts/reference/gpt_reference.py

The Rust test (tests/golden.rs) only reads the fixtures; it needs no Python.
See scripts/reference/README.md for the file contents.
"""

import argparse
import json
import math
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

# ----------------------------------------------------------------------------
# Configuration

CONFIG = dict(
    vocab_size=101,  # deliberately not a multiple of 64: the Rust arena pads to 128
    block_size=32,  # position table longer than T
    n_layer=2,
    n_head=4,
    n_embd=64,
)
B, T = 4, 16

TRAIN = dict(
    learning_rate=1e-3,
    min_lr=1e-4,
    warmup_iters=3,
    lr_decay_iters=8,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    grad_clip=2.0,  # between the norms seen: some steps are clipped, some are not
)
TRAIN_ITERS = 10
SEED = 1337


# ----------------------------------------------------------------------------
# Model


class LayerNorm(nn.Module):
    """LayerNorm (eps 1e-5) whose bias can be switched off."""

    def __init__(self, n, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x):
        b, t, c = x.shape
        hs = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (b, t, c) -> (b, nh, t, hs)
        q, k, v = (z.view(b, t, self.n_head, hs).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = SelfAttention(n_embd, n_head, bias)
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = Mlp(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer)),
                ln_f=LayerNorm(n_embd, bias),
            )
        )

    def forward(self, idx, targets):
        t = idx.shape[1]
        pos = torch.arange(t, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = x @ self.transformer.wte.weight.t()  # tied classifier
        loss = F.cross_entropy(
            logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1
        )
        return logits, loss


def init_weights(model, gen):
    """Random values everywhere (no zeros, no ones) so every gradient path is exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                # layer-norm gain ~ 1 + 0.1·N(0,1), shift ~ 0.1·N(0,1)
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                # matmul weights, embeddings and linear biases
                p.copy_(0.02 * noise)


# ----------------------------------------------------------------------------
# Training helpers (nanoGPT semantics)


def get_lr(it, h):
    if it < h["warmup_iters"]:
        return h["learning_rate"] * (it + 1) / (h["warmup_iters"] + 1)
    if it > h["lr_decay_iters"]:
        return h["min_lr"]
    ratio = (it - h["warmup_iters"]) / (h["lr_decay_iters"] - h["warmup_iters"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return h["min_lr"] + coeff * (h["learning_rate"] - h["min_lr"])


def make_optimizer(model, h):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        dict(params=decay, weight_decay=h["weight_decay"]),
        dict(params=no_decay, weight_decay=0.0),
    ]
    return torch.optim.AdamW(
        groups,
        lr=h["learning_rate"],
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        foreach=False,
        fused=False,
    )


# ----------------------------------------------------------------------------
# Fixture generation


def save_stable(tensors, path, metadata):
    """Writes a safetensors file whose bytes depend only on the contents.

    safetensors' own writer emits `__metadata__` in hash-map order, so regenerating
    would change the file even when no number changed. This writes the same format
    (u64 LE header length, JSON header padded with spaces to 8 bytes, raw
    little-endian data) with keys in sorted order.
    """
    dtypes = {torch.float32: "F32", torch.int32: "I32"}
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        data = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
        header[name] = dict(
            dtype=dtypes[t.dtype], shape=list(t.shape), data_offsets=[offset, offset + len(data)]
        )
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)
    # Read it back with the reference reader.
    back = load_file(path)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def generate(bias, out_path, grad_clip):
    h = dict(TRAIN, grad_clip=grad_clip)
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED + (1 if bias else 2))

    model = Gpt(bias=bias, **CONFIG)
    init_weights(model, gen)
    model.train()  # no dropout anywhere, so train/eval are the same

    v = CONFIG["vocab_size"]
    inputs = torch.randint(0, v, (B, T), generator=gen)
    targets = torch.randint(0, v, (B, T), generator=gen)
    ignored = torch.rand((B, T), generator=gen) < 0.1
    ignored[0, 0] = True  # at least one ignored target, whatever the seed
    targets[ignored] = -1

    tensors = {}
    for name, p in model.named_parameters():
        tensors[name] = p.detach().clone()

    # One forward/backward at the initial weights.
    model.zero_grad(set_to_none=True)
    logits, loss = model(inputs, targets)
    loss.backward()
    tensors["inputs"] = inputs.to(torch.int32)
    tensors["targets"] = targets.to(torch.int32)
    tensors["logits"] = logits.detach().clone()
    tensors["loss"] = loss.detach().reshape(1).clone()
    for name, p in model.named_parameters():
        tensors[f"grad.{name}"] = p.grad.detach().clone()

    # 10 AdamW iterations on the same batch.
    params = list(model.parameters())
    opt = make_optimizer(model, h)
    losses, norms, clipped_norms, lrs = [], [], [], []
    for it in range(TRAIN_ITERS):
        lr = get_lr(it, h)
        lrs.append(lr)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, h["grad_clip"])
        clipped = torch.stack([p.grad.norm() for p in params]).norm()
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
        clipped_norms.append(clipped.item())
    tensors["adamw_losses"] = torch.tensor(losses, dtype=torch.float32)
    tensors["adamw_grad_norms"] = torch.tensor(norms, dtype=torch.float32)
    tensors["adamw_clipped_norms"] = torch.tensor(clipped_norms, dtype=torch.float32)
    tensors["adamw_lrs"] = torch.tensor(lrs, dtype=torch.float32)
    for name, p in model.named_parameters():
        tensors[f"adamw_final.{name}"] = p.detach().clone()


    metadata = {k: str(val) for k, val in CONFIG.items()}
    metadata.update({k: repr(float(val)) if isinstance(val, float) else str(val)
                     for k, val in h.items()})
    metadata.update(bias="true" if bias else "false", B=str(B), T=str(T),
                    train_iters=str(TRAIN_ITERS), seed=str(SEED))
    save_stable(tensors, out_path, metadata)

    n_params = sum(p.numel() for p in params)
    clipped = sum(n > h["grad_clip"] for n in norms)
    print(f"{out_path}: bias={bias} params={n_params} "
          f"ignored targets={int(ignored.sum())}/{B * T} "
          f"size={os.path.getsize(out_path) / 1024:.0f} KiB")
    print(f"  initial loss {tensors['loss'].item():.6f}")
    print("  lr        " + " ".join(f"{get_lr(i, h):.2e}" for i in range(TRAIN_ITERS)))
    print("  losses    " + " ".join(f"{x:.4f}" for x in losses))
    print("  grad norm " + " ".join(f"{x:.4f}" for x in norms))
    print(f"  clipping triggered in {clipped}/{TRAIN_ITERS} steps (grad_clip={h['grad_clip']})")
    return norms


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.normpath(os.path.join(here, "..", "..", "tests", "fixtures"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=default_out)
    ap.add_argument("--grad-clip", type=float, default=TRAIN["grad_clip"])
    args = ap.parse_args()

    torch.set_num_threads(1)  # reproducible reductions
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out_dir, exist_ok=True)
    for bias, stem in ((True, "gpt_small_bias"), (False, "gpt_small_nobias")):
        generate(bias, os.path.join(args.out_dir, f"{stem}.safetensors"), args.grad_clip)


if __name__ == "__main__":
    main()
