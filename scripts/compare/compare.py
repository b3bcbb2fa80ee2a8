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
QUICK = {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 65}

# name -> (architecture, B, T, extra nanogpt args, extra torch args)
CONFIGS = {
    "quickstart": (QUICK, 12, 64, [], []),
    "gpt2-256": (GPT2, 4, 256, [], []),
    "gpt2-256-fused": (GPT2, 4, 256, [], ["--fused"]),
    "gpt2-256-compile": (GPT2, 4, 256, [], ["--compile", "--fused", "--warmup", "3"]),
    "gpt2-1024": (GPT2, 4, 1024, [], []),
    "gpt2-256-bf16": (GPT2, 4, 256, ["--dtype", "bfloat16"], ["--bf16"]),
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


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def nanogpt_cmd(a, arch, b, t, extra):
    overrides = [f"{k}={v}" for k, v in arch.items()]
    return [a.nanogpt, "bench", *overrides, "--batch-size", str(b), "--block-size", str(t),
            "--steps", str(a.steps), "--threads", str(a.threads), "--json",
            *(["--peak-gflops", str(a.peak_gflops)] if a.peak_gflops else []), *extra]


def torch_cmd(a, py, arch, b, t, extra):
    return [py, str(HERE / "torch_gpt2.py"), "--n-layer", str(arch["n_layer"]),
            "--n-head", str(arch["n_head"]), "--n-embd", str(arch["n_embd"]),
            "--vocab-size", str(arch["vocab_size"]), "--batch-size", str(b),
            "--block-size", str(t), "--steps", str(a.steps), "--threads", str(a.threads),
            "--json", *extra]


def spread(xs):
    return f"{min(xs):.0f}..{max(xs):.0f}"


def compare(a, py, name):
    arch, b, t, ours_extra, torch_extra = CONFIGS[name]
    ours, theirs = [], []
    for r in range(a.rounds):
        ours.append(run_json(nanogpt_cmd(a, arch, b, t, ours_extra)))
        theirs.append(run_json(torch_cmd(a, py, arch, b, t, torch_extra)))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nanogpt", default=str(ROOT / "target" / "release" / "nanogpt"))
    ap.add_argument("--python", help="a Python with torch (default: scripts/compare/.venv, created)")
    ap.add_argument("--configs", default="quickstart,gpt2-256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-gflops", type=float,
                    help="GEMM peak for MFU (default: nanogpt measures it each run)")
    ap.add_argument("--json-out", help="also write the rows here")
    a = ap.parse_args()
    names = a.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if not Path(a.nanogpt).exists():
        sys.exit(f"no nanogpt binary at {a.nanogpt}: run `cargo build --release` first")
    py = torch_python(a.python)
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
    rows = [compare(a, py, n) for n in names]
    print(f"load average at end: {os.getloadavg()}", file=sys.stderr)
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
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
