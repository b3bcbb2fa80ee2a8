"""Reference numbers for `nanogpt eval --data FILE.jsonl` (instruction examples).

Builds a tiny random GPT-2 with `transformers` (fixed seed, GPT-2's vocabulary, float16
on disk so the fixture stays small), writes a few Alpaca and chat examples, and
computes with `GPT2LMHeadModel` what nanogpt's eval must report: each example on its
own, prompt and response tokenized separately, `<|endoftext|>` after each response,
the loss averaged over the response tokens (end-of-text included) of the whole file.
Examples longer than the window are cut into consecutive windows of `block` targets,
each without the context of the one before (docs/finetune.md).

The GPT-2 tokenizer comes from the files `nanogpt export` writes (vocab.json,
merges.txt), so no download is needed:

    cargo build --release
    /work/venv/bin/python scripts/reference/instruct_eval.py   # writes tests/fixtures/instruct/
    cargo test --release --test instruct eval_matches_transformers
"""

import argparse
import json
import os
import subprocess
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

# Stanford Alpaca's prompts (tatsu-lab/stanford_alpaca, train.py, PROMPT_DICT): data.
PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:"
)
EOT = 50256

ALPACA = [
    {"instruction": "Reverse the word.", "input": "stressed", "output": "desserts"},
    {"instruction": "Name three primary colours.", "output": "Red, yellow and blue."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {
        "instruction": "Write a haiku about CPUs.",
        "input": "",
        "output": "Silicon hums low\nmatrices fold into cache\nthe loss slowly falls",
    },
    {"instruction": "What is 12 × 7?", "output": "84 — twelve sevens."},
]

CHAT = [
    {"messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain?"},
        {"role": "assistant", "content": "Madrid."},
    ]},
    {"messages": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi! How can I help?"},
    ]},
]


def alpaca_parts(ex):
    inp = ex.get("input") or ""
    prompt = (PROMPT_INPUT if inp else PROMPT_NO_INPUT).format(instruction=ex["instruction"], input=inp)
    return [(prompt, False), (ex["output"], True)]


def chat_parts(ex):
    parts, prompt = [], ""
    for m in ex["messages"]:
        if m["role"] == "assistant":
            parts.append((prompt + "<|assistant|>\n", False))
            parts.append((m["content"], True))
            prompt = ""
        else:
            prompt += f"<|{m['role']}|>\n{m['content']}\n"
    return parts


def encode(tok, parts):
    ids, mask = [], []
    for text, trained in parts:
        part = tok.encode(text, add_special_tokens=False)
        ids += part
        mask += [int(trained)] * len(part)
        if trained:
            ids.append(EOT)
            mask.append(1)
    return ids, mask


@torch.no_grad()
def masked_loss(model, examples, block):
    total, count = 0.0, 0
    for ids, mask in examples:
        for start in range(0, len(ids) - 1, block):
            t = min(block, len(ids) - 1 - start)
            x = torch.tensor([ids[start:start + t]])
            y = torch.tensor(ids[start + 1:start + 1 + t])
            m = torch.tensor(mask[start + 1:start + 1 + t], dtype=torch.bool)
            if not m.any():
                continue
            logits = model(x).logits[0]
            losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
            total += losses[m].double().sum().item()
            count += int(m.sum())
    return total / count, count


def build_model(out):
    torch.manual_seed(1234)
    cfg = GPT2Config(vocab_size=50257, n_positions=64, n_embd=4, n_layer=1, n_head=1,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    # Larger weights than GPT-2's init, so that the per-token losses differ widely and
    # a wrong mask or count moves the mean.
    for name, p in model.named_parameters():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
            p.data = 1.0 + 0.2 * torch.randn_like(p)
        else:
            p.data = 0.5 * torch.randn_like(p)
    model.half().save_pretrained(out)
    return model.float()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join("tests", "fixtures", "instruct"))
    ap.add_argument("--nanogpt", default=os.path.join("target", "release", "nanogpt"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    model_dir = os.path.join(args.out_dir, "model")
    model = build_model(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        exported = os.path.join(tmp, "tok")
        subprocess.run([args.nanogpt, "export", "--from", model_dir, "--to", exported], check=True,
                       stdout=subprocess.DEVNULL)
        tok = GPT2TokenizerFast.from_pretrained(exported)
    files = {"alpaca.jsonl": (ALPACA, alpaca_parts), "chat.jsonl": (CHAT, chat_parts)}
    expected = {}
    for name, (rows, parts) in files.items():
        with open(os.path.join(args.out_dir, name), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        examples = [encode(tok, parts(r)) for r in rows]
        for block in (64, 16):
            loss, count = masked_loss(model, examples, block)
            expected[f"{name} block {block}"] = {"loss": loss, "tokens": count}
            print(f"{name} block {block}: loss {loss:.6f} over {count} response tokens")
    with open(os.path.join(args.out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
