#!/usr/bin/env python3
"""Small random Llama-family models from transformers, and what transformers computes on them.

For nanogpt's Llama / Qwen2 / Qwen3 / Mistral support (tests/llama.rs). Each model is
a randomly initialised `AutoModelForCausalLM` of a few thousand parameters, saved the
way people hold these models (a model directory: config.json + safetensors), with

    tests/fixtures/llama/NAME/                 the model directory
    tests/fixtures/llama/NAME.expected.safetensors
        ids       I32 [B, T]      input tokens
        targets   I32 [B, T]      next tokens, -1 where ignored (the last position,
                                  and one more per row)
        logits    F32 [B, T, V]   eager attention, float32
        loss      F32 [1]         mean cross-entropy over the targets
        grad.KEY  F32             d loss / d parameter, for every stored KEY (with a
                                  tied head, the embedding's includes the head's share)
        prompt    I32 [P]         a prompt, and ...
        greedy    I32 [P + N]     ... model.generate(greedy, N new tokens, no EOS stop)

The fixtures cover every family and both spellings of RoPE in config.json:

    llama_gqa       llama, 6 query heads over 2 key/value heads (3:1), tied head,
                    rope_parameters (transformers 5 spelling), float32
    llama3_mqa      llama, one key/value head, untied lm_head, rope_type llama3 in the
                    transformers 4 spelling (rope_theta + rope_scaling), bfloat16
                    weights in two shards (model.safetensors.index.json)
    qwen2_bias      qwen2: q/k/v biases, 2:1 groups, tied head, 4.x spelling
                    (rope_theta, rope_scaling null), float16 weights
    qwen3_qknorm    qwen3: q/k RMSNorm, head_dim 12 with hidden 24 over 4 heads
                    (head_dim != hidden / heads), 2:1 groups, untied, linear RoPE
                    scaling, rope_parameters
    mistral_plain   mistral with sliding_window 4096 (longer than any block here:
                    plain Llama), 2:1 groups, untied

and one PEFT LoRA adapter on a Llama base, for the adapters in and out:

    tests/fixtures/llama/lora_gqa/base/        a llama model directory (hidden 36,
                                               6 query heads over 2 key/value heads,
                                               head_dim 6, untied, vocabulary 89)
    tests/fixtures/llama/lora_gqa/adapter/     PEFT's save_pretrained of a LoRA
                                               adapter (r 4, alpha 12) on all seven
                                               projections (q_proj ... down_proj), every
                                               A and B random (PEFT's B = 0 would hide it)
    tests/fixtures/llama/lora_gqa.expected.safetensors
        ids, targets, logits, loss as above, with the adapter; KEY.grad for every
        adapter tensor KEY of adapter_model.safetensors; computed in float64 from
        the saved float32 weights and adapter (stored as float32), so that the
        test measures nanogpt's own error, not the difference between two float32
        summation orders

Weights are transformers' initialisation with a larger `initializer_range` (0.1) and
every norm weight and bias drawn around its default (1 or 0), so that each path of
the gradient carries signal.

Run from the repository root (torch, transformers, safetensors):

    /work/venv/bin/python scripts/reference/llama_fixtures.py
    cargo test --release --test llama

Checking nanogpt's export in transformers (the other direction):

    NANOGPT_LLAMA_EXPORT_DIR=/tmp/llama-export cargo test --test llama export
    /work/venv/bin/python scripts/reference/llama_fixtures.py --check-export /tmp/llama-export

`--check-export` opens each exported directory with `AutoModelForCausalLM` (no
missing or unexpected weights allowed) and checks that it computes the fixture's
logits. It also opens the adapter the same test run trained on lora_gqa/base and
exported (`lora_gqa_trained/adapter`, `nanogpt export --adapter-only`) with
`PeftModel.from_pretrained`, every adapter tensor loaded, and checks that PEFT
computes the logits nanogpt computed with it (`lora_gqa_trained/nanogpt.safetensors`).
"""

import argparse
import copy
import json
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

B, T = 2, 12
PROMPT, NEW = 5, 10
SEED = 3535

COMMON = dict(vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=None, hidden_act="silu")

FIXTURES = {
    "llama_gqa": dict(
        model_type="llama", num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        spelling=5, dtype=torch.float32),
    "llama3_mqa": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=1, hidden_size=32,
        tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
        spelling=4, dtype=torch.bfloat16, shards=True),
    "qwen2_bias": dict(
        model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        use_sliding_window=False, spelling=4, dtype=torch.float16),
    "qwen3_qknorm": dict(
        model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, hidden_size=24,
        head_dim=12, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        spelling=5, dtype=torch.float32),
    "mistral_plain": dict(
        model_type="mistral", num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, sliding_window=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        spelling=5, dtype=torch.float32),
}


# The PEFT adapter's base: shapes no other fixture has.
LORA_NAME = "lora_gqa"
LORA_BASE = dict(
    model_type="llama", vocab_size=89, hidden_size=36, intermediate_size=44,
    num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    spelling=5, dtype=torch.float32)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK, LORA_ALPHA = 4, 12


def build(name, spec):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    spelling, dtype, shards = spec.pop("spelling"), spec.pop("dtype"), spec.pop("shards", False)
    model_type = spec.pop("model_type")
    kwargs = {**COMMON, **spec}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED + sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
        # Round the weights to the stored dtype, so transformers computes (in f32) on
        # exactly the values nanogpt reads.
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    model.eval()
    return model, spelling, dtype, shards


def save_dir(model, out, spelling, dtype, shards):
    if os.path.exists(out):
        shutil.rmtree(out)
    # A copy: converting the model itself would round its RoPE frequencies (a buffer).
    copy.deepcopy(model).to(dtype).save_pretrained(out, max_shard_size="20KB" if shards else "50GB")
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if spelling == 4:
        # transformers 4.x: rope_theta beside rope_scaling (null without scaling).
        params = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = params.pop("rope_theta")
        params.pop("partial_rotary_factor", None)
        cfg["rope_scaling"] = None if params.get("rope_type") == "default" else params
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def expected(model, out_path):
    v = model.config.vocab_size
    ids, inputs, targets = batch(v)
    model.zero_grad()
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=-1)
    loss.backward()
    tensors = {
        "ids": inputs.to(torch.int32), "targets": targets.to(torch.int32),
        "logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1),
    }
    for pname, p in model.named_parameters():
        tensors[f"grad.{pname}"] = p.grad.detach().contiguous()
    prompt = ids[0, :PROMPT]
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=NEW)
    tensors["prompt"] = prompt.to(torch.int32).contiguous()
    tensors["greedy"] = out[0].to(torch.int32).contiguous()
    save_file(tensors, out_path)


def batch(v):
    """Random ids and their next tokens, -1 where ignored (the last position, and one
    more in the first row)."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, v, (B, T + 1), generator=g)
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    targets[:, -1] = -1
    targets[0, 3] = -1
    return ids, inputs, targets


def write_lora(out_dir):
    """The base, PEFT's adapter on it and what PEFT computes with it."""
    from peft import LoraConfig, get_peft_model

    root = os.path.join(out_dir, LORA_NAME)
    shutil.rmtree(root, ignore_errors=True)
    model, spelling, dtype, shards = build(LORA_NAME, LORA_BASE)
    save_dir(model, os.path.join(root, "base"), spelling, dtype, shards)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                        target_modules=LORA_TARGETS, bias="none")
    peft = get_peft_model(model, config)
    torch.manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    adapter = os.path.join(root, "adapter")
    peft.save_pretrained(adapter)
    os.remove(os.path.join(adapter, "README.md"))  # a generated model card

    # The reference in float64 (the saved f32 weights, exactly): nanogpt's f32 result
    # is then compared with the exact one, not with another f32 summation order.
    peft = peft.double()
    v = model.config.vocab_size
    _, inputs, targets = batch(v)
    logits = peft(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), ignore_index=-1)
    loss.backward()
    tensors = {
        "ids": inputs.to(torch.int32), "targets": targets.to(torch.int32),
        "logits": logits.detach().float().contiguous(),
        "loss": loss.detach().float().reshape(1),
    }
    grads = 0
    for name, p in peft.named_parameters():
        if p.requires_grad:
            # PEFT's in-memory names carry the adapter's name; the saved keys do not.
            grad = p.grad.detach().float().contiguous()
            tensors[name.replace(".default", "") + ".grad"] = grad
            grads += 1
    save_file(tensors, os.path.join(out_dir, f"{LORA_NAME}.expected.safetensors"))
    print(f"{LORA_NAME}: loss {loss.item():.6f}, {grads} adapter gradients")


def check_adapter_export(root, fixtures):
    """PEFT opens the adapter nanogpt trained and exported, and computes its logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, f"{LORA_NAME}_trained")
    adapter = os.path.join(path, "adapter")
    base = AutoModelForCausalLM.from_pretrained(
        os.path.join(fixtures, LORA_NAME, "base"), attn_implementation="eager",
        dtype=torch.float32)
    want = load_file(os.path.join(path, "nanogpt.safetensors"))
    ids = want["ids"].long()
    with torch.no_grad():
        plain = base(input_ids=ids).logits  # before PEFT wraps (and changes) `base`
        model = PeftModel.from_pretrained(base, adapter).eval()
        got = model(input_ids=ids).logits
    # Every tensor of the file is in PEFT's model, and every adapter PEFT made is
    # the file's.
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(saved) == sorted(loaded), f"{adapter}: {sorted(saved)} vs {sorted(loaded)}"
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), f"{adapter}: {key} loaded otherwise"
    scale = want["logits"].abs().max().item()
    err = (got - want["logits"]).abs().max().item() / scale
    moved = (plain - want["logits"]).abs().max().item() / scale
    print(f"{LORA_NAME}_trained: PEFT loads nanogpt's adapter ({len(saved)} tensors); "
          f"logits within {err:.1e} of nanogpt's (the adapter moves them by {moved:.1e})")
    assert err <= 1e-5, f"PEFT computes logits {err:e} away from nanogpt's"
    assert moved > 1e-3, "the adapter hardly changes the base's logits"


def check_loads(out):
    """transformers must open the saved directory and compute the same logits."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                dtype=torch.float32)


def check_export(root, fixtures):
    from transformers import AutoModelForCausalLM

    for name in FIXTURES:
        path = os.path.join(root, name)
        model, info = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v and k != "mismatched_keys"}
        assert not bad and not info.get("mismatched_keys"), f"{name}: {info}"
        want = load_file(os.path.join(fixtures, f"{name}.expected.safetensors"))
        with torch.no_grad():
            got = model(input_ids=want["ids"].long()).logits
        err = (got - want["logits"]).abs().max().item() / want["logits"].abs().max().item()
        assert err <= 1e-6, f"{name}: the export computes logits {err:e} away"
        print(f"{name}: transformers loads the export; logits within {err:.1e}")
    check_adapter_export(root, fixtures)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default="tests/fixtures/llama")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--check-export", metavar="DIR")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.check_export:
        return check_export(args.check_export, args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, spec in FIXTURES.items():
        if args.only and name not in args.only:
            continue
        model, spelling, dtype, shards = build(name, spec)
        out = os.path.join(args.out_dir, name)
        save_dir(model, out, spelling, dtype, shards)
        reloaded = check_loads(out)
        ids = torch.arange(T)[None] % model.config.vocab_size
        with torch.no_grad():
            a, b = model(input_ids=ids).logits, reloaded(input_ids=ids).logits
        assert torch.equal(a, b), f"{name}: the saved directory computes other logits"
        expected(model, os.path.join(args.out_dir, f"{name}.expected.safetensors"))
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, {size} bytes")
    if not args.only or LORA_NAME in args.only:
        write_lora(args.out_dir)


if __name__ == "__main__":
    main()
