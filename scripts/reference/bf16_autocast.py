"""PyTorch bf16 autocast reference for `dtype = "bfloat16"`: writes
tests/fixtures/bf16_autocast.json.

For each golden fixture (gpt_small_bias, gpt_small_nobias), loads its parameters
and batch, and records the loss of the same model in float32 and under
`torch.autocast("cpu", dtype=torch.bfloat16)`, plus the gradient of every
parameter under autocast, summarised as its L2 norm.

PyTorch places the roundings differently from nanogpt, so the Rust test
(tests/golden.rs) only compares with a loose tolerance. Under CPU autocast:
- every nn.Linear and `@` runs in bf16 and returns bf16, so the branch outputs
  added to the residual stream, q/k/v, the attention scores and the logits are
  bf16 (nanogpt keeps matmul outputs in f32 and rounds only what feeds another
  matmul);
- the softmax probabilities go back to bf16 before `@ v` (nanogpt's attention
  keeps them f32);
- GELU runs on the bf16 tensor and returns bf16 (nanogpt computes it in f32 and
  rounds the result);
- layer norm, softmax and cross-entropy run in f32 in both.

Usage (repository root): python scripts/reference/bf16_autocast.py
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_reference import CONFIG, Gpt  # noqa: E402


def losses(stem, fixtures):
    tensors = load_file(os.path.join(fixtures, f"{stem}.safetensors"))
    bias = "transformer.h.0.attn.c_attn.bias" in tensors
    model = Gpt(bias=bias, **CONFIG)
    model.load_state_dict({n: tensors[n] for n, _ in model.named_parameters()})
    inputs = tensors["inputs"].long()
    targets = tensors["targets"].long()
    with torch.no_grad():
        _, loss_f32 = model(inputs, targets)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss_bf16 = model(inputs, targets)
    loss_bf16.backward()
    grad_norms = {n: p.grad.float().norm().item() for n, p in model.named_parameters()}
    return {
        "loss_float32": loss_f32.item(),
        "loss_autocast_bf16": loss_bf16.float().item(),
        "grad_norms_autocast_bf16": grad_norms,
    }


def main():
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.normpath(os.path.join(here, "..", "..", "tests", "fixtures"))
    out = {stem: losses(stem, fixtures) for stem in ("gpt_small_bias", "gpt_small_nobias")}
    out["torch_version"] = torch.__version__
    path = os.path.join(fixtures, "bf16_autocast.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    for stem in ("gpt_small_bias", "gpt_small_nobias"):
        r = out[stem]
        print(f"{stem}: float32 {r['loss_float32']:.6f}, autocast bf16 {r['loss_autocast_bf16']:.6f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
