#!/usr/bin/env python3
"""Where PEFT applies an adapter whose config selects fewer modules than its file holds
(tests/lora.rs, `peft_applies_an_adapter_where_its_config_says`).

Takes the LoRA fixture of scripts/reference/lora_fixtures.py (tests/fixtures/lora:
`base/`, `adapter/` with adapters on all four linear layers of both blocks, and
`tokens.bin`), and for each variant below rewrites the adapter's config, loads it
with `PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), adapter)` and
computes `nanogpt eval`'s number over tokens.bin (windows of 16). Writes

    tests/fixtures/lora/selection.json   {"variants": [{"name", "config", "eval_loss"}]}

where "config" holds the keys that replace the adapter config's.

    /work/venv/bin/python scripts/reference/peft_selection.py
"""

import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from lora_fixtures import eval_loss  # noqa: E402

VARIANTS = [
    ("second layer only", {"layers_to_transform": [1]}),
    ("first layer, by pattern", {"layers_to_transform": 0, "layers_pattern": "h"}),
    ("two of four targets", {"target_modules": ["c_attn", "mlp.c_proj"]}),
    ("both c_proj by suffix", {"target_modules": ["c_proj"]}),
    ("a regular expression", {"target_modules": r".*\.0\.attn\.c_attn|.*\.1\.mlp\.c_fc"}),
    ("all-linear less the MLP", {"target_modules": "all-linear", "exclude_modules": ["c_fc", "mlp.c_proj"]}),
]


def main():
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    root = "tests/fixtures/lora"
    torch.set_num_threads(1)
    tokens = [int(t) for t in torch.frombuffer(bytearray(open(f"{root}/tokens.bin", "rb").read()), dtype=torch.int16)]
    tokens = [t & 0xFFFF for t in tokens]
    out = []
    for name, overrides in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            adapter = os.path.join(tmp, "adapter")
            shutil.copytree(f"{root}/adapter", adapter)
            path = os.path.join(adapter, "adapter_config.json")
            config = json.load(open(path))
            config.update(overrides)
            json.dump(config, open(path, "w"), indent=2)
            base = GPT2LMHeadModel.from_pretrained(f"{root}/base").eval()
            model = PeftModel.from_pretrained(base, adapter).eval()
            loss = eval_loss(model, tokens, 16)
        print(f"{name}: eval_loss {loss:.6f}")
        out.append({"name": name, "config": overrides, "eval_loss": loss})
    with open(f"{root}/selection.json", "w") as f:
        json.dump({"variants": out}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
