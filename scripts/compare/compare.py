"""nanogpt vs PyTorch eager, side by side on this machine: prints the ratios.

For each configuration, runs `nanogpt bench --json` and
scripts/compare/torch_gpt2.py --json alternately (nanogpt, torch, nanogpt, torch, ...)
for --rounds rounds, with the same shapes, the same thread count and the same
optimizer (AdamW, clipping at 1.0), then reports each side's median over the rounds
of its per-run median ms/step, the tokens/s ratio, MFU (nanogpt's FLOP count and
measured GEMM peak) and peak RSS.
Alternating means a noisy neighbour slows both sides alike; the spread between
rounds is printed so you can judge the noise.

    python3 scripts/compare/compare.py       # makes scripts/compare/.venv with torch first
    python3 scripts/compare/compare.py --python /path/to/venv/bin/python --rounds 5 \
        --configs quickstart,gpt2-256 --json-out /tmp/compare.json

Configurations (2 threads unless --threads):
    quickstart     nanoGPT's CPU quick start shape: 4 layers, 4 heads, 128 wide,
                   vocab 65, batch 12, block 64
    gpt2-256       GPT-2 124M, B=4, T=256, fp32, PyTorch's default AdamW (as nanoGPT)
    gpt2-256-fused the same, PyTorch with fused AdamW
    gpt2-256-compile the same, PyTorch with torch.compile and fused AdamW
    gpt2-1024      GPT-2 124M, B=4, T=1024 (peak RSS is the figure of interest)
    gpt2-256-bf16  GPT-2 124M, B=4, T=256, nanogpt --dtype bfloat16 vs torch autocast
    gpt2-256-bf16-compile  the same, torch autocast + torch.compile + fused AdamW
                   (PyTorch's best CPU configuration)
    gpt2-1024-bf16 GPT-2 124M, B=4, T=1024, bf16 vs torch autocast
    medium-1024-bf16  gpt2-medium (24 layers, 16 heads, 1024 wide), B=1, T=1024, bf16
                   vs torch autocast
    smollm2-512    SmolLM2-135M's architecture (scripts/compare/models), B=4, T=512,
                   fp32, vs transformers' LlamaForCausalLM (scripts/compare/torch_hf.py)
    smollm2-512-compile  the same, torch.compile + fused AdamW
    smollm2-512-bf16     the same in bf16 vs torch autocast
    smollm2-512-bf16-compile  bf16 vs autocast + torch.compile + fused AdamW
    qwen05-lora-bf16  Qwen2.5-0.5B's architecture, B=4, T=512, LoRA rank 16 (alpha 32)
                   on every linear of the blocks, bf16, vs PEFT with the base in bf16
                   under autocast

Sampling configurations (`nanogpt bench --sample` vs scripts/compare/torch_generate.py,
transformers' GPT2LMHeadModel.generate; both greedy with a KV cache, random GPT-2 124M
weights, one sample, a 256-token prompt, --new-tokens new tokens; reported: prefill
and decoding tokens/s and their ratios; --steps is the runs per side per round):
    sample-256     f32 weights on both sides
    sample-256-bf16  nanogpt --dtype bfloat16 (bf16 weights) vs transformers with
                   torch_dtype=bfloat16

The nanogpt binary must be built (`cargo build --release`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

GPT2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50304}
MEDIUM = {"n_layer": 24, "n_head": 16, "n_embd": 1024, "vocab_size": 50304}
QUICK = {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 65}
# Hugging Face configs (the published architectures, random weights on both sides):
# nanogpt bench --model CONFIG vs scripts/compare/torch_hf.py --config CONFIG.
SMOLLM2 = str(HERE / "models" / "smollm2-135m.json")
QWEN05 = str(HERE / "models" / "qwen2.5-0.5b.json")
COMPILED = ["--compile", "--fused", "--warmup", "3"]
LORA16 = ["lora_rank=16", "lora_alpha=32",
          "lora_targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
BF16 = ["--dtype", "bfloat16"]

# name -> (architecture, B, T, extra nanogpt args, extra torch args)
CONFIGS = {
    "quickstart": (QUICK, 12, 64, [], []),
    "gpt2-256": (GPT2, 4, 256, [], []),
    "gpt2-256-fused": (GPT2, 4, 256, [], ["--fused"]),
    "gpt2-256-compile": (GPT2, 4, 256, [], ["--compile", "--fused", "--warmup", "3"]),
    "gpt2-1024": (GPT2, 4, 1024, [], []),
    "gpt2-256-bf16": (GPT2, 4, 256, ["--dtype", "bfloat16"], ["--bf16"]),
    "gpt2-256-bf16-compile": (GPT2, 4, 256, ["--dtype", "bfloat16"],
                              ["--bf16", "--compile", "--fused", "--warmup", "3"]),
    "gpt2-1024-bf16": (GPT2, 4, 1024, ["--dtype", "bfloat16"], ["--bf16"]),
    "medium-1024-bf16": (MEDIUM, 1, 1024, ["--dtype", "bfloat16"], ["--bf16"]),
    "smollm2-512": (SMOLLM2, 4, 512, [], []),
    "smollm2-512-compile": (SMOLLM2, 4, 512, [], COMPILED),
    "smollm2-512-bf16": (SMOLLM2, 4, 512, BF16, ["--bf16"]),
    "smollm2-512-bf16-compile": (SMOLLM2, 4, 512, BF16, ["--bf16", *COMPILED]),
    "qwen05-lora-bf16": (QWEN05, 4, 512, [*BF16, *LORA16],
                         ["--bf16", "--lora-rank", "16", "--bf16-base"]),
}

# name -> (prompt tokens, extra nanogpt args, extra torch_generate.py args)
SAMPLE_CONFIGS = {
    "sample-256": (256, [], []),
    "sample-256-bf16": (256, ["--dtype", "bfloat16"], ["--bf16"]),
}


def torch_python(explicit):
    """A Python with torch: --python, or scripts/compare/.venv (created on first use)."""
    if explicit:
        return explicit
    env_dir = HERE / ".venv"
    py = env_dir / "bin" / "python"
    if not py.exists():
        print(f"setting up {env_dir} with torch (large download, once)", file=sys.stderr)
        venv.create(env_dir, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch", "numpy"], check=True)
    return str(py)


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def nanogpt_cmd(a, arch, b, t, extra):
    if isinstance(arch, str):
        overrides = ["--model", arch]
    else:
        overrides = [f"{k}={v}" for k, v in arch.items()]
    return [a.nanogpt, "bench", *overrides, "--batch-size", str(b), "--block-size", str(t),
            "--steps", str(a.steps), "--threads", str(a.threads), "--json",
            *(["--peak-gflops", str(a.peak_gflops)] if a.peak_gflops else []), *extra]


def torch_cmd(a, py, arch, b, t, extra):
    if isinstance(arch, str):
        return [py, str(HERE / "torch_hf.py"), "--config", arch, "--batch-size", str(b),
                "--block-size", str(t), "--steps", str(a.steps), "--threads", str(a.threads),
                "--json", *extra]
    return [py, str(HERE / "torch_gpt2.py"), "--n-layer", str(arch["n_layer"]),
            "--n-head", str(arch["n_head"]), "--n-embd", str(arch["n_embd"]),
            "--vocab-size", str(arch["vocab_size"]), "--batch-size", str(b),
            "--block-size", str(t), "--steps", str(a.steps), "--threads", str(a.threads),
            "--json", *extra]


def torch_env(a):
    """PyTorch's environment: OMP_WAIT_POLICY=PASSIVE with --omp-passive."""
    if not a.omp_passive:
        return None
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def spread(xs):
    return f"{min(xs):.0f}..{max(xs):.0f}"


def compare(a, py, name):
    arch, b, t, ours_extra, torch_extra = CONFIGS[name]
    ours, theirs = [], []
    for r in range(a.rounds):
        ours.append(run_json(nanogpt_cmd(a, arch, b, t, ours_extra)))
        theirs.append(run_json(torch_cmd(a, py, arch, b, t, torch_extra), torch_env(a)))
        print(f"  {name} round {r + 1}: nanogpt {ours[-1]['ms_per_step']:.1f} ms, "
              f"torch {theirs[-1]['ms_per_step']:.1f} ms", file=sys.stderr, flush=True)
    o_ms = statistics.median(x["ms_per_step"] for x in ours)
    t_ms = statistics.median(x["ms_per_step"] for x in theirs)
    row = {
        "config": name,
        "batch_size": b,
        "block_size": t,
        "threads": a.threads,
        "rounds": a.rounds,
        "nanogpt_ms_per_step": o_ms,
        "torch_ms_per_step": t_ms,
        "nanogpt_ms_range": spread([x["ms_per_step"] for x in ours]),
        "torch_ms_range": spread([x["ms_per_step"] for x in theirs]),
        "nanogpt_tokens_per_sec": b * t / (o_ms / 1e3),
        "torch_tokens_per_sec": b * t / (t_ms / 1e3),
        "speedup": t_ms / o_ms,
        "nanogpt_mfu": statistics.median(x["mfu"] for x in ours),
        "nanogpt_peak_rss_mb": max(x["peak_rss_mb"] for x in ours),
        "torch_peak_rss_mb": max(x["peak_rss_mb"] for x in theirs),
    }
    row["rss_ratio"] = row["nanogpt_peak_rss_mb"] / row["torch_peak_rss_mb"]
    return row


def sample_cmds(a, py, name):
    prompt, ours_extra, torch_extra = SAMPLE_CONFIGS[name]
    ours = [a.nanogpt, "bench", "--sample", str(a.new_tokens), "--batch-size", "1",
            "--block-size", str(prompt), "--steps", str(a.steps), "--threads", str(a.threads),
            "--json", *ours_extra]
    theirs = [py, str(HERE / "torch_generate.py"), "--prompt", str(prompt), "--new",
              str(a.new_tokens), "--runs", str(a.steps), "--threads", str(a.threads), "--json",
              *torch_extra]
    return prompt, ours, theirs


def compare_sample(a, py, name):
    prompt, ours_cmd, torch_cmd_ = sample_cmds(a, py, name)
    ours, theirs = [], []
    for r in range(a.rounds):
        ours.append(run_json(ours_cmd))
        theirs.append(run_json(torch_cmd_, torch_env(a)))
        print(f"  {name} round {r + 1}: decode nanogpt {ours[-1]['decode_tokens_per_sec']:.1f}, "
              f"transformers {theirs[-1]['decode_tokens_per_sec']:.1f} tokens/s; prefill "
              f"{ours[-1]['prefill_ms']:.0f} vs {theirs[-1]['prefill_ms']:.0f} ms",
              file=sys.stderr, flush=True)
    med = lambda xs, k: statistics.median(x[k] for x in xs)
    rng = lambda xs, k: f"{min(x[k] for x in xs):.1f}..{max(x[k] for x in xs):.1f}"
    row = {
        "config": name,
        "prompt_tokens": prompt,
        "new_tokens": a.new_tokens,
        "threads": a.threads,
        "rounds": a.rounds,
        "nanogpt_prefill_tokens_per_sec": med(ours, "prefill_tokens_per_sec"),
        "torch_prefill_tokens_per_sec": med(theirs, "prefill_tokens_per_sec"),
        "nanogpt_decode_tokens_per_sec": med(ours, "decode_tokens_per_sec"),
        "torch_decode_tokens_per_sec": med(theirs, "decode_tokens_per_sec"),
        "nanogpt_decode_range": rng(ours, "decode_tokens_per_sec"),
        "torch_decode_range": rng(theirs, "decode_tokens_per_sec"),
        "nanogpt_total_ms": med(ours, "total_ms"),
        "torch_total_ms": med(theirs, "total_ms"),
        "nanogpt_peak_rss_mb": max(x["peak_rss_mb"] for x in ours),
        "torch_peak_rss_mb": max(x["peak_rss_mb"] for x in theirs),
    }
    # Per round, so a noisy round shows as a spread rather than hiding in a median.
    row["decode_speedups"] = [o["decode_tokens_per_sec"] / t["decode_tokens_per_sec"]
                              for o, t in zip(ours, theirs)]
    row["prefill_speedup"] = (row["nanogpt_prefill_tokens_per_sec"]
                              / row["torch_prefill_tokens_per_sec"])
    row["decode_speedup"] = statistics.median(row["decode_speedups"])
    row["total_speedup"] = row["torch_total_ms"] / row["nanogpt_total_ms"]
    return row


def print_sample_rows(rows):
    print(f"{'config':<18} {'prefill tok/s ours':>18} {'torch':>7} {'ratio':>6} "
          f"{'decode tok/s ours':>17} {'torch':>7} {'ratio':>6} {'whole ratio':>11}")
    for r in rows:
        print(f"{r['config']:<18} {r['nanogpt_prefill_tokens_per_sec']:>18.0f} "
              f"{r['torch_prefill_tokens_per_sec']:>7.0f} {r['prefill_speedup']:>5.2f}x "
              f"{r['nanogpt_decode_tokens_per_sec']:>17.1f} {r['torch_decode_tokens_per_sec']:>7.1f} "
              f"{r['decode_speedup']:>5.2f}x {r['total_speedup']:>10.2f}x")
        spread = ", ".join(f"{x:.2f}" for x in r["decode_speedups"])
        print(f"{'':<18} rounds {r['rounds']}, prompt {r['prompt_tokens']} + {r['new_tokens']} "
              f"new; decode tok/s nanogpt {r['nanogpt_decode_range']}, transformers "
              f"{r['torch_decode_range']}; per-round decode ratios {spread}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", default=str(ROOT / "target" / "release" / "nanogpt"))
    ap.add_argument("--python", help="a Python with torch (default: scripts/compare/.venv, created)")
    ap.add_argument("--configs", default="quickstart,gpt2-256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--omp-passive", action="store_true",
                    help="run PyTorch with OMP_WAIT_POLICY=PASSIVE: on a machine with more "
                         "runnable threads than cores its spinning OpenMP threads otherwise "
                         "lose most of their time slices (decoding 1 vs 7 tokens/s measured)")
    ap.add_argument("--new-tokens", type=int, default=256, help="sampling: new tokens")
    ap.add_argument("--peak-gflops", type=float,
                    help="GEMM peak for MFU (default: nanogpt measures it each run)")
    ap.add_argument("--json-out", help="also write the rows here")
    a = ap.parse_args()
    names = a.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS and n not in SAMPLE_CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration(s) {unknown}; choose from "
                 f"{', '.join([*CONFIGS, *SAMPLE_CONFIGS])}")
    if not Path(a.nanogpt).exists():
        sys.exit(f"no nanogpt binary at {a.nanogpt}: run `cargo build --release` first")
    py = torch_python(a.python)
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    rows = [compare(a, py, n) for n in names if n in CONFIGS]
    sample_rows = [compare_sample(a, py, n) for n in names if n in SAMPLE_CONFIGS]
    print(f"load average at end: {os.getloadavg()}", file=sys.stderr)
    if sample_rows:
        print_sample_rows(sample_rows)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows + sample_rows, indent=1) + "\n")
    if not rows:
        return
    print(f"{'config':<18} {'nanogpt ms':>11} {'torch ms':>10} {'speedup':>8} "
          f"{'tok/s ours':>10} {'tok/s torch':>11} {'MFU':>5} {'RSS ours':>9} {'RSS torch':>9} "
          f"{'RSS ratio':>9}")
    for r in rows:
        print(f"{r['config']:<18} {r['nanogpt_ms_per_step']:>11.1f} {r['torch_ms_per_step']:>10.1f} "
              f"{r['speedup']:>7.2f}x {r['nanogpt_tokens_per_sec']:>10.0f} "
              f"{r['torch_tokens_per_sec']:>11.0f} {r['nanogpt_mfu'] * 100:>4.0f}% "
              f"{r['nanogpt_peak_rss_mb']:>7.0f}MB {r['torch_peak_rss_mb']:>7.0f}MB "
              f"{r['rss_ratio']:>9.2f}")
        print(f"{'':<18} rounds {r['rounds']}, per-run medians: nanogpt "
              f"{r['nanogpt_ms_range']} ms, torch {r['torch_ms_range']} ms")


if __name__ == "__main__":
    main()
