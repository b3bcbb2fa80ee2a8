#!/usr/bin/env python3
"""Reference values for nanogpt's Llama-family kernels, from transformers' own modules.

Writes tests/fixtures/kernels/llama_kernels.safetensors, which the kernel tests
(src/kernels/{rmsnorm,rope,swiglu}.rs, src/kernels/attention/tests.rs) read. Every
value comes from the code transformers runs for these models, in float32, with
gradients from PyTorch autograd of `sum(out * dout)` for a random `dout`:

    rmsnorm.*      LlamaRMSNorm (hidden 40, eps 1e-6); Qwen3's q/k norm
                   (Qwen3RMSNorm over each head's channels of q_proj/k_proj outputs)
    rope.NAME.*    LlamaRotaryEmbedding + apply_rotary_pos_emb for the rope_parameters
                   NAME: default (theta 10000), linear (factor 4) and llama3
                   (theta 500000, factor 32, low 1, high 4, original 8192), with
                   position ids from 0 and from 1000 (a KV cache's continuation);
                   rope.NAME.inv_freq the frequencies transformers computes
    swiglu.*       LlamaMLP's activation, silu(gate) * up
    attn.NAME.*    eager_attention_forward (repeat_kv, causal mask, softmax in f32)
                   for NAME: gqa3 (6 query heads over 2 key/value heads), mqa (one
                   key/value head), qwen3 (head_dim 128 over 2:1 groups)

Layouts are nanogpt's, not PyTorch's: q, k and v of a token are one row of
(NH + 2*KV) * HS channels (query heads, then key heads, then value heads), the
attention output a row of NH * HS; a (B, T, ...) tensor is row-major.

Run (from the repository root; torch, transformers, safetensors):

    /work/venv/bin/python scripts/reference/llama_kernels.py
    cargo test --lib -- kernels::
"""

import argparse
import os

import torch
from safetensors.torch import save_file

SEED = 35


def rand(*shape, scale=1.0):
    return (torch.rand(*shape, dtype=torch.float64) * 2 - 1).float() * scale


def rmsnorm_cases(out):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    n, c, eps = 6, 40, 1e-6
    norm = LlamaRMSNorm(c, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * rand(c))
    x = rand(n, c, scale=2.0).requires_grad_(True)
    dout = rand(n, c)
    y = norm(x)
    (y * dout).sum().backward()
    out.update({
        "rmsnorm.x": x.detach(), "rmsnorm.weight": norm.weight.detach(),
        "rmsnorm.out": y.detach(), "rmsnorm.dout": dout,
        "rmsnorm.dx": x.grad, "rmsnorm.dweight": norm.weight.grad,
    })

    # Qwen3: q_norm / k_norm over head_dim of q_proj(x).view(B, T, NH, HS), likewise k.
    b, t, nh, kv, hs = 2, 3, 4, 2, 16
    q_norm, k_norm = Qwen3RMSNorm(hs, eps=eps), Qwen3RMSNorm(hs, eps=eps)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.5 * rand(hs))
        k_norm.weight.copy_(1 + 0.5 * rand(hs))
    qkv = rand(b, t, (nh + 2 * kv) * hs, scale=2.0).requires_grad_(True)
    q, k, v = qkv.split([nh * hs, kv * hs, kv * hs], dim=-1)
    qn = q_norm(q.reshape(b, t, nh, hs)).reshape(b, t, nh * hs)
    kn = k_norm(k.reshape(b, t, kv, hs)).reshape(b, t, kv * hs)
    y = torch.cat([qn, kn, v], dim=-1)
    dout = rand(*y.shape)
    (y * dout).sum().backward()
    out.update({
        "qknorm.dims": torch.tensor([b, t, nh, kv, hs], dtype=torch.int32),
        "qknorm.qkv": qkv.detach(), "qknorm.q_weight": q_norm.weight.detach(),
        "qknorm.k_weight": k_norm.weight.detach(), "qknorm.out": y.detach(),
        "qknorm.dout": dout, "qknorm.dqkv": qkv.grad,
        "qknorm.dq_weight": q_norm.weight.grad, "qknorm.dk_weight": k_norm.weight.grad,
    })


ROPE = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192),
}


def rope_cases(out):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    b, t, nh, kv, hs = 1, 4, 3, 1, 16
    for name, params in ROPE.items():
        cfg = LlamaConfig(hidden_size=nh * hs, num_attention_heads=nh, num_key_value_heads=kv,
                          head_dim=hs, max_position_embeddings=131072, rope_parameters=dict(params))
        emb = LlamaRotaryEmbedding(cfg)
        out[f"rope.{name}.inv_freq"] = emb.inv_freq.clone()
        for pos0 in (0, 1000):
            key = f"rope.{name}.{pos0}"
            qkv = rand(b, t, (nh + 2 * kv) * hs).requires_grad_(True)
            q, k, v = qkv.split([nh * hs, kv * hs, kv * hs], dim=-1)
            q4 = q.reshape(b, t, nh, hs).transpose(1, 2)
            k4 = k.reshape(b, t, kv, hs).transpose(1, 2)
            pos = torch.arange(pos0, pos0 + t).unsqueeze(0).expand(b, t)
            cos, sin = emb(qkv, pos)
            qe, ke = apply_rotary_pos_emb(q4, k4, cos, sin)
            y = torch.cat([qe.transpose(1, 2).reshape(b, t, -1),
                           ke.transpose(1, 2).reshape(b, t, -1), v], dim=-1)
            dout = rand(*y.shape)
            (y * dout).sum().backward()
            out.update({
                f"{key}.qkv": qkv.detach(), f"{key}.out": y.detach(),
                f"{key}.dout": dout, f"{key}.dqkv": qkv.grad,
            })
    out["rope.dims"] = torch.tensor([b, t, nh, kv, hs], dtype=torch.int32)


def swiglu_cases(out):
    from transformers.activations import ACT2FN

    n, i = 7, 44
    gate_up = rand(n, 2 * i, scale=6.0).requires_grad_(True)
    gate, up = gate_up.split([i, i], dim=-1)
    h = ACT2FN["silu"](gate) * up
    dh = rand(n, i)
    (h * dh).sum().backward()
    out.update({"swiglu.gate_up": gate_up.detach(), "swiglu.h": h.detach(),
                "swiglu.dh": dh, "swiglu.dgate_up": gate_up.grad})


ATTN = {
    # B, T, NH, KV, HS
    "gqa3": (1, 33, 6, 2, 8),
    "mqa": (1, 20, 4, 1, 12),
    "qwen3": (1, 5, 2, 1, 128),
}


def attention_cases(out):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class Module(torch.nn.Module):
        pass

    for name, (b, t, nh, kv, hs) in ATTN.items():
        module = Module()
        module.num_key_value_groups = nh // kv
        module.training = False
        qkv = rand(b, t, (nh + 2 * kv) * hs, scale=2.0).requires_grad_(True)
        q, k, v = qkv.split([nh * hs, kv * hs, kv * hs], dim=-1)
        heads = lambda x, n: x.reshape(b, t, n, hs).transpose(1, 2)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y, _ = eager_attention_forward(module, heads(q, nh), heads(k, kv), heads(v, kv),
                                       mask, scaling=hs ** -0.5)
        y = y.reshape(b, t, nh * hs)
        dout = rand(*y.shape)
        (y * dout).sum().backward()
        out.update({
            f"attn.{name}.dims": torch.tensor([b, t, nh, kv, hs], dtype=torch.int32),
            f"attn.{name}.qkv": qkv.detach(), f"attn.{name}.out": y.detach(),
            f"attn.{name}.dout": dout, f"attn.{name}.dqkv": qkv.grad,
        })


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/kernels/llama_kernels.safetensors")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    out = {}
    rmsnorm_cases(out)
    rope_cases(out)
    swiglu_cases(out)
    attention_cases(out)
    out = {k: v.contiguous() for k, v in sorted(out.items())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    import transformers
    save_file(out, args.out, metadata={"torch": torch.__version__,
                                       "transformers": transformers.__version__})
    print(f"wrote {args.out}: {len(out)} tensors, {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
