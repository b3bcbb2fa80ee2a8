"""GGUF fixtures for tests/gguf.rs, written by the `gguf` Python package (llama.cpp's
gguf-py), so that nanogpt's reader, dequantization and quantization are checked against
an implementation that is not ours.

    python scripts/reference/gguf_fixtures.py [--out-dir tests/fixtures/gguf]

Writes (each a few tens of KB):

- quants.gguf: for each type T of F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K,
  `T.raw` (random blocks stored as T: random quant bits, random finite scales of
  both signs, some subnormal) and `T.expected` (F32: `gguf.quants.dequantize` of
  them); for each type Q of F16 BF16 Q8_0, `Q.input` (F32: random rows plus edge
  cases: an all-zero block, one non-zero value, a negative maximum, values beyond
  f16's range for F16, subnormals) and `Q.quantized` (stored as Q: `gguf.quants.quantize`
  of the input).
- tiny_gpt2.gguf: a random 2-layer GPT-2 (vocabulary 96, context 32, C 64) in llama.cpp's
  names and layouts (`blk.N.attn_qkv.weight` ..., Conv1D weights transposed), its
  2-D weights stored as Q8_0, Q4_0, F16, BF16, Q5_1, Q4_1, Q4_K, Q5_K, with a small byte-level BPE
  tokenizer (`tokenizer.ggml.*`) and a chat template.
- tiny_gpt2.expected.safetensors: `inputs` (I32 [2, 16]) and `logits` (F32 [2, 16, 96])
  from transformers' GPT2LMHeadModel loaded from tiny_gpt2.gguf (`gguf_file=`), which
  dequantizes with the `gguf` package.

Needs numpy, gguf, torch, transformers (e.g. /work/venv/bin/python). Seeded: the same
package versions give the same bytes.
"""

import argparse
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

RNG = np.random.default_rng(20261205)

DEQUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
QUANT_TYPES = [Q.F16, Q.BF16, Q.Q8_0]

# Byte offsets of the f16 scales inside each block type.
SCALE_OFFSETS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def finite_f16(n):
    """Random finite f16 values of both signs over many magnitudes, some subnormal."""
    mag = 2.0 ** RNG.uniform(-26, 4, n)
    sign = RNG.choice([-1.0, 1.0], n)
    return (sign * mag).astype(np.float16)


def raw_blocks(qtype, n_blocks):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == Q.F32:
        return (RNG.standard_normal(n_blocks) * 10.0 ** RNG.uniform(-40, 30, n_blocks)).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return finite_f16(n_blocks).view(np.uint8)
    if qtype == Q.BF16:
        f = (RNG.standard_normal(n_blocks) * 10.0 ** RNG.uniform(-40, 30, n_blocks)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = RNG.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        raw[:, off:off + 2] = finite_f16(n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def quant_input(qtype):
    rows = [RNG.standard_normal(256).astype(np.float32) * 0.05]
    edge = np.zeros(32 * 5, dtype=np.float32)
    edge[32 + 5] = 0.75                      # one non-zero value
    edge[64:96] = RNG.uniform(-1, 0.5, 32)
    edge[64 + 3] = -1.0                      # the largest magnitude is negative
    edge[96:128] = np.arange(32) - 15.5      # exact halves
    edge[128:160] = RNG.standard_normal(32) * 1e-6
    rows.append(edge)
    if qtype != Q.Q8_0:
        # Subnormal f32 (for Q8_0 the inverse scale would overflow: undefined in C).
        rows.append(RNG.standard_normal(32).astype(np.float32) * np.float32(3e-41))
    if qtype == Q.F16:
        rows.append(np.array([65504, 65519, 65520, -70000, 6e-8, 2.9e-8, 3e-8, 1e-9] * 4, dtype=np.float32))
    return np.concatenate(rows)


def write_quants(path):
    w = gguf.GGUFWriter(path, "quants")
    for qtype in DEQUANT_TYPES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 4 if block == 256 else (8 if block == 32 else 256)
        raw = raw_blocks(qtype, n_blocks)
        # Two rows, to check that row boundaries do not matter.
        raw2d = raw.reshape(2, -1)
        expected = dequantize(raw2d, qtype)
        name = qtype.name.lower()
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(f"{name}.raw", raw2d.view(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(f"{name}.raw", raw2d, raw_dtype=qtype)
        w.add_tensor(f"{name}.expected", expected.astype(np.float32))
    for qtype in QUANT_TYPES:
        x = quant_input(qtype).reshape(1, -1)
        q = quantize(x, qtype)
        name = qtype.name.lower()
        w.add_tensor(f"{name}.input", x)
        if qtype == Q.F16:
            w.add_tensor(f"{name}.quantized", q)
        else:
            w.add_tensor(f"{name}.quantized", q.view(np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_kquant(qtype, shape):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block
    raw = RNG.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scales = RNG.uniform(5e-5, 2e-4, n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(shape[0], -1)


def bytes_to_unicode():
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiny_vocab(v):
    """A byte-level BPE of v tokens: printable ASCII bytes, a few merges, an end token."""
    show = bytes_to_unicode()
    singles = [show[b] for b in range(32, 127)]            # 95 tokens incl. 'Ġ'
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    tokens = singles[: v - len(merges) - 1] + ["".join(m) for m in merges] + ["<|endoftext|>"]
    assert len(tokens) == v
    return tokens, [f"{a} {b}" for a, b in merges]


def write_tiny_gpt2(out_dir):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from safetensors.numpy import save_file

    torch.manual_seed(1234)
    v, t, c, l, nh = 96, 32, 64, 2, 4
    cfg = GPT2Config(vocab_size=v, n_positions=t, n_ctx=t, n_embd=c, n_layer=l, n_head=nh,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        for i in range(l):
            for ln in (model.transformer.h[i].ln_1, model.transformer.h[i].ln_2):
                ln.weight.add_(1.0)
        model.transformer.ln_f.weight.add_(1.0)
    sd = {k: p.detach().numpy() for k, p in model.state_dict().items()}

    path = os.path.join(out_dir, "tiny_gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_type("model")
    w.add_name("tiny gpt2")
    w.add_block_count(l)
    w.add_context_length(t)
    w.add_embedding_length(c)
    w.add_feed_forward_length(4 * c)
    w.add_head_count(nh)
    w.add_layer_norm_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens, merges = tiny_vocab(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (v - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(merges)
    w.add_bos_token_id(v - 1)
    w.add_eos_token_id(v - 1)
    w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}")

    # 2-D weights in many types (k-quants need rows of 256: ffn_down's); 1-D tensors
    # and the position table stay F32, as llama.cpp's converter keeps them.
    kinds = {
        "token_embd.weight": Q.Q8_0,
        "blk.0.attn_qkv.weight": Q.Q8_0, "blk.1.attn_qkv.weight": Q.Q4_0,
        "blk.0.attn_output.weight": Q.F16, "blk.1.attn_output.weight": Q.BF16,
        "blk.0.ffn_up.weight": Q.Q5_1, "blk.1.ffn_up.weight": Q.Q4_1,
        "blk.0.ffn_down.weight": Q.Q4_K, "blk.1.ffn_down.weight": Q.Q5_K,
    }
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    names = {
        "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
    }
    for key, x in sd.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue
        if key.endswith(conv1d):
            x = x.T
        x = np.ascontiguousarray(x, dtype=np.float32)
        if key == "transformer.wte.weight":
            name = "token_embd.weight"
        elif key == "transformer.wpe.weight":
            name = "position_embd.weight"
        elif key.startswith("transformer.ln_f."):
            name = "output_norm." + key.split(".")[-1]
        else:
            _, _, i, rest = key.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{names[module]}.{kind}"
        qtype = kinds.get(name, Q.F32)
        if qtype in (Q.Q4_K, Q.Q5_K):
            # The package cannot quantize to k-quants: these weights are random blocks
            # (small scales), whatever they decode to is the model.
            q = random_kquant(qtype, x.shape)
        else:
            q = quantize(x, qtype)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, q)
        else:
            w.add_tensor(name, q.view(np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    from transformers import AutoModelForCausalLM
    # transformers maps gpt2.context_length to `n_ctx` but sizes the position table by
    # `n_positions` (default 1024): it must be given.
    hf = AutoModelForCausalLM.from_pretrained(out_dir, gguf_file="tiny_gpt2.gguf", dtype=torch.float32,
                                              n_positions=t).eval()
    inputs = torch.from_numpy(RNG.integers(0, v, (2, 16)).astype(np.int64))
    with torch.no_grad():
        logits = hf(inputs).logits.float().numpy()
    save_file({"inputs": inputs.numpy().astype(np.int32), "logits": logits},
              os.path.join(out_dir, "tiny_gpt2.expected.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="tests/fixtures/gguf")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    write_quants(os.path.join(args.out_dir, "quants.gguf"))
    write_tiny_gpt2(args.out_dir)
    for f in sorted(os.listdir(args.out_dir)):
        print(f, os.path.getsize(os.path.join(args.out_dir, f)), "bytes")


if __name__ == "__main__":
    main()
