#!/usr/bin/env python3
"""LoRA fixtures for nanogpt's adapters (tests/lora.rs), computed with PEFT.

Builds a small random `transformers.GPT2LMHeadModel` (shapes no other fixture uses:
V=101, n_positions=16, C=48, NH=4, L=2), wraps it with a PEFT `LoraConfig` on all
four kinds of GPT-2 linear layer (`c_attn`, `attn.c_proj`, `c_fc`, `mlp.c_proj`;
GPT-2's Conv1D means `fan_in_fan_out=True`), sets every `lora_A` and `lora_B` to
random values (PEFT's `B = 0` would hide the adapters from the test), and writes:

    tests/fixtures/lora/base/            the base model, save_pretrained
    tests/fixtures/lora/adapter/         PEFT's save_pretrained of the adapters:
                                         adapter_config.json, adapter_model.safetensors
    tests/fixtures/lora/expected.safetensors
        ids [B, T] (I32), targets [B, T] (I32, -1 = ignored), logits [B, T, V],
        loss (mean cross-entropy over the kept targets, F32) and, for every adapter
        tensor, its gradient of that loss under PEFT's key + ".grad"; eval_loss (F64):
        `nanogpt eval`'s number (windows of T) over tokens.bin with the adapters
    tests/fixtures/lora/tokens.bin        400 uint16 tokens below V (nanoGPT's format)

Set up and run (from the repository root):

    python3 -m venv .venv && .venv/bin/pip install torch transformers peft safetensors
    .venv/bin/python scripts/reference/lora_fixtures.py          # rewrites tests/fixtures/lora/
    cargo test --release --test lora golden

Checking nanogpt's adapter export in PEFT (the other direction), after a LoRA run
on the Hugging Face base BASE_DIR and `nanogpt export --from OUT --to ADAPTER_DIR
--adapter-only` and `nanogpt export --from OUT --to MERGED_DIR`:

    .venv/bin/python scripts/reference/lora_fixtures.py --check-export BASE_DIR ADAPTER_DIR MERGED_DIR

loads `PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(BASE_DIR), ADAPTER_DIR)`
and `GPT2LMHeadModel.from_pretrained(MERGED_DIR)` and compares their logits on random
tokens (the merged export is itself checked against transformers by tests/hf.rs).
"""

import argparse
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

B, T = 2, 16
SEED = 4242
SPEC = dict(vocab_size=101, n_positions=16, n_embd=48, n_layer=2, n_head=4)
TARGETS = ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]
RANK, ALPHA = 4, 12


def build_base():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    cfg = GPT2Config(
        **SPEC,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=SPEC["vocab_size"] - 1,
        eos_token_id=SPEC["vocab_size"] - 1,
    )
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("wte.weight") or name.endswith("wpe.weight"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def write_fixtures(root):
    from peft import LoraConfig, get_peft_model

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    base = build_base()
    base.save_pretrained(os.path.join(root, "base"))
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=TARGETS,
        fan_in_fan_out=True,
        bias="none",
    )
    model = get_peft_model(base, config)
    torch.manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(os.path.join(root, "adapter"))
    os.remove(os.path.join(root, "adapter", "README.md"))  # a generated model card

    g = torch.Generator().manual_seed(SEED + 2)
    ids = torch.randint(0, SPEC["vocab_size"], (B, T), generator=g)
    targets = torch.randint(0, SPEC["vocab_size"], (B, T), generator=g)
    targets[torch.rand(B, T, generator=g) < 0.15] = -1
    model.train()  # dropouts are 0: train mode only enables autograd bookkeeping
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
    loss.backward()
    out = {
        "ids": ids.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(1),
    }
    for name, p in model.named_parameters():
        if p.requires_grad:
            # PEFT's in-memory names carry the adapter name; the saved keys do not.
            key = name.replace(".default", "")
            out[key + ".grad"] = p.grad.detach().contiguous()
    tokens = torch.randint(0, SPEC["vocab_size"], (400,), generator=g)
    tokens.numpy().astype("<u2").tofile(os.path.join(root, "tokens.bin"))
    out["eval_loss"] = torch.tensor([eval_loss(model, tokens.tolist(), T)], dtype=torch.float64)
    save_file(out, os.path.join(root, "expected.safetensors"))
    print(f"wrote {root}: loss {loss.item():.6f}, {sum('.grad' in k for k in out)} adapter gradients")


def eval_loss(model, tokens, block):
    """nanogpt eval: window k predicts tokens[kT+1 .. kT+T+1] from tokens[kT .. kT+T]."""
    windows = (len(tokens) - 1) // block
    total = 0.0
    with torch.no_grad():
        for k in range(windows):
            x = torch.tensor(tokens[k * block : k * block + block], dtype=torch.long)[None]
            y = torch.tensor(tokens[k * block + 1 : k * block + block + 1], dtype=torch.long)
            logits = model(input_ids=x).logits[0].double()
            total += F.cross_entropy(logits, y, reduction="sum").item()
    return total / (windows * block)


def check_export(base_dir, adapter_dir, merged_dir):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    base = GPT2LMHeadModel.from_pretrained(base_dir).eval()
    merged = GPT2LMHeadModel.from_pretrained(merged_dir).eval()
    n_pos = min(merged.config.n_positions, 32)
    ids = torch.randint(0, merged.config.vocab_size, (2, n_pos), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = base(input_ids=ids).logits  # before PEFT wraps (and changes) `base`
        peft = PeftModel.from_pretrained(base, adapter_dir).eval()
        got = peft(input_ids=ids).logits
        want = merged(input_ids=ids).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    moved = ((plain - want).abs().max() / want.abs().max()).item()
    print(f"PEFT(base, {adapter_dir}) vs {merged_dir}: max |Δ logits| / max |logits| = {err:.3e} "
          f"(the adapters move the base's logits by {moved:.3e})")
    return err < 1e-5 and moved > 1e-4


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="tests/fixtures/lora")
    p.add_argument("--check-export", nargs=3, metavar=("BASE", "ADAPTER", "EXPECTED"))
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.check_export:
        sys.exit(0 if check_export(*args.check_export) else 1)
    write_fixtures(args.out_dir)


if __name__ == "__main__":
    main()
