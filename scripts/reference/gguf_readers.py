"""Logits of a GGUF file as other programs read it, for tests/gguf.rs (the checks that
need this venv; they are skipped without it).

    python scripts/reference/gguf_readers.py MODEL.gguf IDS OUT.safetensors [--lora ADAPTER.gguf]

IDS is a comma-separated list of token ids (one sequence). Writes to OUT.safetensors:

- `llama_cpp` F32 [T, V]: llama.cpp (llama-cpp-python) evaluating the ids with
  `logits_all=True`, with the LoRA adapter applied (scale 1) when given; it runs in a
  child process, and where llama.cpp crashes, `llama_cpp_signal` I32 [1] holds the
  signal instead (seen: SIGSEGV on Q8_0 files on a Xeon with AMX, llama.cpp's own
  `llama_model_quantize` output included);
- `transformers` F32 [T, V]: transformers' AutoModelForCausalLM loaded with
  `gguf_file=` (it dequantizes with the `gguf` package); left out with --lora. For
  `llama`, `qwen2` and `qwen3` files, what transformers 5.3 does not read from a GGUF
  is given to it from the file: the head size (`{arch}.attention.key_length`, which
  it maps for llama only) and the RoPE scaling, as llama.cpp applies it: every
  frequency divided by `{arch}.rope.scaling.factor` (linear) or by the matching
  entry of `rope_freqs.weight` (Llama 3's);
- `transformers_gelu_f16` F32 [T, V] (gpt2 only): the same with llama.cpp's CPU GELU,
  which rounds its input to f16 and looks the result up in an f16 table
  (`GGML_GELU_FP16` in ggml-cpu/vec.h): what llama.cpp computes, up to summation order;
- `gguf_tensors` I32 [1]: how many tensors `gguf.GGUFReader` lists (it parses every
  header field on the way).
"""

import argparse
import os

import numpy as np
import torch


class GeluF16Table(torch.nn.Module):
    """ggml's CPU GELU: 0 below -10, x above 10, else tanh-GELU of x rounded to f16,
    rounded to f16."""

    def forward(self, x):
        h = x.half().float()
        y = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * h * (1.0 + 0.044715 * h * h)))
        return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y.half().float()))


def llama_cpp_logits(model, ids, n_ctx, lora):
    """llama.cpp's logits for `ids`, evaluated in a child process: (logits, None), or
    (None, the signal that ended it)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, "logits.npy")
        cmd = [sys.executable, __file__, "--llama-cpp-child", model, ",".join(map(str, ids)),
               dest, "--n-ctx", str(n_ctx)] + (["--lora", lora] if lora else [])
        run = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if run.returncode < 0:
            return None, -run.returncode
        if run.returncode != 0:
            sys.exit(f"llama.cpp failed: {run.stderr}")
        return np.load(dest), None


def llama_cpp_child(args, ids):
    from llama_cpp import Llama
    # An f32 KV cache (llama.cpp's default is f16, which rounds k and v).
    kwargs = dict(model_path=args.model, logits_all=True, n_ctx=args.n_ctx, n_batch=len(ids),
                  verbose=False, seed=0, type_k=0, type_v=0)
    if args.lora:
        kwargs["lora_path"] = args.lora
    llm = Llama(**kwargs)
    llm.eval(ids)
    np.save(args.out, np.array(llm.scores[: len(ids)], dtype=np.float32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("ids")
    ap.add_argument("out")
    ap.add_argument("--lora")
    ap.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ids = [int(i) for i in args.ids.split(",")]
    if args.llama_cpp_child:
        return llama_cpp_child(args, ids)
    out = {}

    import gguf
    reader = gguf.GGUFReader(args.model)
    out["gguf_tensors"] = np.array([len(reader.tensors)], dtype=np.int32)
    arch = reader.fields["general.architecture"].contents()
    n_ctx = int(reader.fields[f"{arch}.context_length"].contents())
    if arch != "gpt2":
        n_ctx = min(n_ctx, 512)

    logits, signal = llama_cpp_logits(args.model, ids, n_ctx, args.lora)
    if signal:
        out["llama_cpp_signal"] = np.array([signal], dtype=np.int32)
    else:
        out["llama_cpp"] = logits

    if not args.lora:
        from transformers import AutoModelForCausalLM
        folder, name = os.path.split(os.path.abspath(args.model))
        extra = {"n_positions": n_ctx} if arch == "gpt2" else {}
        field = lambda key: reader.fields[key].contents() if key in reader.fields else None
        if field(f"{arch}.attention.key_length") is not None:
            extra["head_dim"] = int(field(f"{arch}.attention.key_length"))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     attn_implementation="eager", **extra).eval()
        if arch != "gpt2":
            rotary = model.model.rotary_emb
            divisors = torch.ones_like(rotary.inv_freq)
            if field(f"{arch}.rope.scaling.type") == "linear":
                divisors *= float(field(f"{arch}.rope.scaling.factor"))
            freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
            if freqs:
                divisors *= torch.tensor(np.array(freqs[0].data, dtype=np.float32))
            rotary.inv_freq = rotary.inv_freq / divisors
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        out["transformers"] = logits.float().numpy()
        if arch == "gpt2":
            for block in model.transformer.h:
                block.mlp.act = GeluF16Table()
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            out["transformers_gelu_f16"] = logits.float().numpy()

    from safetensors.numpy import save_file
    save_file(out, args.out)


if __name__ == "__main__":
    main()
