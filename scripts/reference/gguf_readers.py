"""Logits of a GGUF file as other programs read it, for tests/gguf.rs (the checks that
need this venv; they are skipped without it).

    python scripts/reference/gguf_readers.py MODEL.gguf IDS OUT.safetensors [--lora ADAPTER.gguf]

IDS is a comma-separated list of token ids (one sequence). Writes to OUT.safetensors:

- `llama_cpp` F32 [T, V]: llama.cpp (llama-cpp-python) evaluating the ids with
  `logits_all=True`, with the LoRA adapter applied (scale 1) when given;
- `transformers` F32 [T, V]: transformers' AutoModelForCausalLM loaded with
  `gguf_file=` (it dequantizes with the `gguf` package); left out with --lora;
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("ids")
    ap.add_argument("out")
    ap.add_argument("--lora")
    args = ap.parse_args()
    ids = [int(i) for i in args.ids.split(",")]
    out = {}

    import gguf
    reader = gguf.GGUFReader(args.model)
    out["gguf_tensors"] = np.array([len(reader.tensors)], dtype=np.int32)
    arch = reader.fields["general.architecture"].contents()
    n_ctx = int(reader.fields[f"{arch}.context_length"].contents())

    from llama_cpp import Llama
    # An f32 KV cache (llama.cpp's default is f16, which rounds k and v).
    kwargs = dict(model_path=args.model, logits_all=True, n_ctx=n_ctx, n_batch=len(ids),
                  verbose=False, seed=0, type_k=0, type_v=0)
    if args.lora:
        kwargs["lora_path"] = args.lora
    llm = Llama(**kwargs)
    llm.eval(ids)
    out["llama_cpp"] = np.array(llm.scores[: len(ids)], dtype=np.float32)

    if not args.lora:
        from transformers import AutoModelForCausalLM
        folder, name = os.path.split(os.path.abspath(args.model))
        extra = {"n_positions": n_ctx} if arch == "gpt2" else {}
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     **extra).eval()
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
