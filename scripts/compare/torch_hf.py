"""A transformers training step on a model built from a config.json, timed like
`nanogpt bench --model CONFIG` for side-by-side ratios.

The model is `AutoModelForCausalLM.from_config` (random weights, PyTorch's SDPA
attention, the family's own modelling code: Llama, Qwen2, Qwen3, ...), the step is
forward + backward + clip_grad_norm_(1.0) + AdamW on synthetic tokens. With
--lora-rank, PEFT adds LoRA adapters to every linear layer of the blocks and only they
train; with --bf16 the step runs under torch.autocast('cpu', bfloat16), and with
--bf16-base a LoRA run also loads the frozen base in bfloat16 (what PEFT users on a
memory budget do; the adapters stay float32, PEFT's default).

    .venv/bin/python scripts/compare/torch_hf.py --config scripts/compare/models/smollm2-135m.json \
        --batch-size 4 --block-size 512 --threads 2 --json

scripts/compare/compare.py runs this and nanogpt alternately and prints the ratios.
"""

import argparse
import json
import resource
import statistics
import time

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(a):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(a.config)
    dtype = torch.bfloat16 if a.bf16_base else torch.float32
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                             dtype=dtype)
    model.train()
    if a.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0,
                          target_modules=LORA_TARGETS)
        model = get_peft_model(model, lora)
    return model, config.vocab_size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="a Hugging Face config.json")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--fused", action="store_true", help="fused AdamW")
    ap.add_argument("--bf16", action="store_true", help="torch.autocast('cpu', bfloat16)")
    ap.add_argument("--lora-rank", type=int, default=0, help="PEFT LoRA on every linear")
    ap.add_argument("--bf16-base", action="store_true",
                    help="with --lora-rank: the frozen base in bfloat16")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    torch.manual_seed(1337)
    torch.set_num_threads(a.threads)
    model, vocab = build(a)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    other = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
        fused=a.fused or None,
    )
    step_model = torch.compile(model) if a.compile else model
    b, t = a.batch_size, a.block_size
    x = torch.randint(vocab, (b, t))
    times = []
    for i in range(a.warmup + a.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = step_model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    report = {
        "ms_per_step": ms,
        "ms_per_step_min": min(times),
        "tokens_per_sec": b * t / (ms / 1e3),
        "params": sum(p.numel() for p in model.parameters()),
        "trained_params": sum(p.numel() for p in trained),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
    }
    if a.json:
        print(json.dumps(report))
    else:
        print(
            f"torch {torch.__version__}, B={b} T={t}, {a.threads} threads: {ms:.1f} ms/step "
            f"(median of {a.steps}, min {min(times):.1f}), {report['tokens_per_sec']:.0f} "
            f"tokens/s, peak RSS {report['peak_rss_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
