#!/usr/bin/env python3
"""Hugging Face GPT-2 fixtures for nanogpt's import/export (tests/hf.rs).

Builds small randomly initialised `transformers.GPT2LMHeadModel`s, saves them the
way people hold GPT-2 (a model directory: config.json + safetensors weights), and
records what `transformers` computes on fixed tokens, so that the Rust tests can
check that nanogpt loads them exactly.

    tests/fixtures/hf/tiny_a/          save_pretrained: one model.safetensors,
                                       vocab 259, n_positions 64 (tests use a block of 16/32)
    tests/fixtures/hf/tiny_b_legacy/   the layout of the original `gpt2` upload: keys
                                       without `transformer.`, the attention-mask buffers
                                       `h.N.attn.bias` / `h.N.attn.masked_bias`, an
                                       explicit `lm_head.weight`, float16 weights
    tests/fixtures/hf/tiny_c_sharded/  save_pretrained with a small max_shard_size:
                                       model-0000N-of-0000M.safetensors + index
    tests/fixtures/hf/NAME.expected.safetensors
                                       ids [B, T] (I32), logits [B, T, V], loss (HF's
                                       shifted-label loss), eval_loss: nanogpt eval's
                                       number over tokens.bin (windows of eval_block_size)
    tests/fixtures/hf/tokens.bin       uint16 tokens (nanoGPT's .bin format)

Set up and run (from the repository root):

    python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors numpy
    .venv/bin/python scripts/reference/hf_fixtures.py          # rewrites tests/fixtures/hf/
    cargo test --release --test hf

Checking nanogpt's export in transformers (the other direction):

    NANOGPT_EXPORT_CHECK_DIR=/tmp/hf-check cargo test --release --test hf export_for_python_check
    .venv/bin/python scripts/reference/hf_fixtures.py --check-export /tmp/hf-check

The Rust test trains a fixture model for a few AdamW steps, saves a nanogpt
checkpoint, runs `nanogpt export` into /tmp/hf-check/hf and writes the logits and
loss nanogpt computes (/tmp/hf-check/expected.safetensors); the same for a random
model with GPT-2's vocabulary (/tmp/hf-check/hf_gpt2, exported with the tokenizer
files; expected_gpt2.safetensors also holds nanogpt's token ids for a text).
`--check-export` opens each export with `GPT2LMHeadModel.from_pretrained` (no missing
or unexpected weights allowed), compares logits and loss with nanogpt's, and checks
that transformers' tokenizer from the exported files gives nanogpt's token ids.
"""

import argparse
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

B, T = 2, 16
EVAL_TOKENS = 1200
SEED = 1234

FIXTURES = {
    "tiny_a": dict(vocab_size=259, n_positions=64, n_embd=32, n_layer=2, n_head=4),
    "tiny_b_legacy": dict(vocab_size=131, n_positions=40, n_embd=32, n_layer=3, n_head=2),
    "tiny_c_sharded": dict(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=4),
}
EVAL_BLOCK = {"tiny_a": 24, "tiny_b_legacy": 40, "tiny_c_sharded": 32}
# The token file must be valid for every fixture's vocabulary.
TOKEN_VOCAB = min(f["vocab_size"] for f in FIXTURES.values())


def build(name, spec):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED + sum(map(ord, name)))
    cfg = GPT2Config(
        **spec,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=spec["vocab_size"] - 1,
        eos_token_id=spec["vocab_size"] - 1,
    )
    model = GPT2LMHeadModel(cfg).eval()
    # HF's init leaves biases at 0 and layer-norm gains at 1: randomise them so that a
    # loader which drops or swaps one is caught.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif ".ln_" in pname and pname.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("wte.weight") or pname.endswith("wpe.weight"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def nanogpt_eval_loss(model, tokens, block):
    """nanogpt eval: window k predicts tokens[kT+1 .. kT+T+1] from tokens[kT .. kT+T]."""
    windows = (len(tokens) - 1) // block
    total = 0.0
    with torch.no_grad():
        for k in range(windows):
            x = torch.tensor(tokens[k * block : k * block + block], dtype=torch.long)[None]
            y = torch.tensor(tokens[k * block + 1 : k * block + block + 1], dtype=torch.long)
            logits = model(x).logits[0].double()
            total += F.cross_entropy(logits, y, reduction="sum").item()
    return total / (windows * block)


def save_legacy(model, out):
    """The original `gpt2` upload's layout: no `transformer.` prefix, mask buffers,
    an explicit lm_head, float16."""
    os.makedirs(out, exist_ok=True)
    model.config.save_pretrained(out)
    n_pos = model.config.n_positions
    tensors = {}
    for k, v in model.state_dict().items():
        key = k[len("transformer.") :] if k.startswith("transformer.") else k
        tensors[key] = v.detach().to(torch.float16).contiguous()
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    mask = torch.tril(torch.ones(n_pos, n_pos, dtype=torch.float16)).view(1, 1, n_pos, n_pos)
    for i in range(model.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = mask.clone()
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4, dtype=torch.float16)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    # What transformers computes is what the float16 weights mean in float32.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))


def write_fixtures(root):
    import transformers

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, TOKEN_VOCAB, size=EVAL_TOKENS, dtype=np.uint16)
    tokens.astype("<u2").tofile(os.path.join(root, "tokens.bin"))
    for name, spec in FIXTURES.items():
        model = build(name, spec)
        out = os.path.join(root, name)
        shutil.rmtree(out, ignore_errors=True)
        if name == "tiny_b_legacy":
            save_legacy(model, out)
        elif name == "tiny_c_sharded":
            model.save_pretrained(out, max_shard_size="40KB")
        else:
            model.save_pretrained(out)
        # The generation config is not needed by the loader; keep the fixtures minimal.
        gen = os.path.join(out, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)

        # Reload from disk: the numbers must be those of the saved files.
        from transformers import GPT2LMHeadModel

        reloaded = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, spec["vocab_size"], (B, T), generator=g)
        with torch.no_grad():
            res = reloaded(ids, labels=ids)
        eval_block = EVAL_BLOCK[name]
        eval_loss = nanogpt_eval_loss(reloaded, tokens.tolist(), eval_block)
        save_file(
            {
                "ids": ids.to(torch.int32),
                "logits": res.logits.float().contiguous(),
                "loss": res.loss.float().reshape(()),
                "eval_loss": torch.tensor(eval_loss, dtype=torch.float64),
            },
            os.path.join(root, f"{name}.expected.safetensors"),
            metadata={
                "eval_block_size": str(eval_block),
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            },
        )
        print(f"{name}: loss {res.loss.item():.6f}, eval loss {eval_loss:.6f} (T={eval_block})")


def check_export(base):
    """Opens nanogpt's exports with transformers and compares logits with nanogpt's:
    DIR/hf against DIR/expected.safetensors, and DIR/hf_gpt2 (a GPT-2-vocabulary
    model, exported with the tokenizer files) against DIR/expected_gpt2.safetensors."""
    ok = True
    for tag in ["", "_gpt2"]:
        hf_dir = os.path.join(base, "hf" + tag)
        if os.path.isdir(hf_dir):
            ok &= check_one(hf_dir, os.path.join(base, f"expected{tag}.safetensors"))
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


def check_one(hf_dir, expected_path):
    from transformers import GenerationConfig, GPT2LMHeadModel

    expected = load_file(expected_path)
    model, info = GPT2LMHeadModel.from_pretrained(
        hf_dir, dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"FAIL: transformers reported loading problems: {problems}")
        return False
    gen = GenerationConfig.from_pretrained(hf_dir)
    ids = expected["ids"].long()
    with torch.no_grad():
        logits = model(ids).logits
    want = expected["logits"]
    if logits.shape != want.shape:
        print(f"FAIL: logits shape {tuple(logits.shape)} != nanogpt's {tuple(want.shape)}")
        return False
    err = (logits - want).abs().max().item()
    scale = want.abs().max().item()
    print(f"export at {hf_dir}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"config {model.config.n_layer}L/{model.config.n_head}H/{model.config.n_embd}C, "
          f"vocab {model.config.vocab_size}, n_positions {model.config.n_positions}")
    print(f"  generation_config: bos {gen.bos_token_id}, eos {gen.eos_token_id}")
    print(f"  logits: max |transformers - nanogpt| = {err:.3e} (largest logit {scale:.3f})")
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    print(f"  loss: transformers {loss:.6f}, nanogpt {expected['loss'].item():.6f}")
    ok = err <= 1e-4 * max(1.0, scale) and abs(loss - expected["loss"].item()) <= 1e-5 * abs(loss)
    if os.path.exists(os.path.join(hf_dir, "vocab.json")):
        ok &= check_tokenizer(hf_dir, expected_path)
    return ok


def check_tokenizer(hf_dir, expected_path):
    """The exported GPT-2 tokenizer files: transformers' tokenizer must give the ids
    nanogpt's (tiktoken's) BPE gives, agree fast with slow, round-trip text, and
    give GPT-2's published ids."""
    from safetensors import safe_open
    from transformers import AutoTokenizer, GPT2Tokenizer

    with safe_open(expected_path, "pt") as f:
        text = f.metadata()["text"]
        want = f.get_tensor("text_ids").tolist()
    fast = AutoTokenizer.from_pretrained(hf_dir)
    slow = GPT2Tokenizer.from_pretrained(hf_dir)
    got = fast.encode(text)
    other = "Before we proceed any further, hear me speak.<|endoftext|> ünïcödé 12345  \n\n"
    a, b = fast.encode(other), slow.encode(other)
    # Published GPT-2 ids: "Hello world" is [15496, 995], "<|endoftext|>" 50256.
    known = fast.encode("Hello world") == [15496, 995] and fast.eos_token_id == 50256
    ok = got == want and a == b and fast.decode(a) == other and len(fast) == 50257 and known
    print(f"  tokenizer: {type(fast).__name__}, {len(fast)} tokens; {len(got)} ids for 2000 characters "
          f"of Shakespeare, same as nanogpt's: {got == want}; fast == slow: {a == b}; "
          f"round trip: {fast.decode(a) == other}; published ids: {known}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join("tests", "fixtures", "hf"))
    ap.add_argument("--check-export", metavar="DIR",
                    help="check nanogpt's export in DIR/hf against DIR/expected.safetensors")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if args.check_export:
        check_export(args.check_export)
    else:
        write_fixtures(args.out_dir)


if __name__ == "__main__":
    main()
