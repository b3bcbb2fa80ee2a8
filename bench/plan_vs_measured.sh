#!/usr/bin/env bash
# plan_vs_measured.sh - one row of docs/PERFORMANCE.md's "plan vs measured" table: the
# memory plan of a run, per rank, against each rank's peak RSS.
#
#   bench/plan_vs_measured.sh NANOGPT_BINARY RANKS [key=value ...]
#
# Trains two optimizer steps (max_iters=1: the second step's backward holds the
# AdamW moments, the steady state the plan predicts; one step peaks at its optimizer
# step, lower) through the final checkpoint, on RANKS ranks of this host (Open MPI,
# 1 thread each), with a config file so that no closing sample runs;
# bench/footprint.py gives each rank's peak RSS and its peak of resident plus swapped
# memory (the same where nothing is swapped out; on a host that swaps, what the rank
# would hold resident with enough memory). Then `nanogpt plan` of the same settings.
# Prints: rank, plan MB, measured MB (the latter peak), error (plan - measured) /
# measured, and the peak RSS where it is lower.
# The binary must be built with `--features mpi`. Runs above 3 GB on the shared dev
# machine go under `flock /work/notes/bigmem.lock`. Writes only under $OUT (default
# a new temporary directory).
set -euo pipefail
here=$(dirname "$(realpath "$0")")
bin=$(realpath "$1")
ranks=$2
shift 2
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
printf 'dataset = "shakespeare"\n' >"$out/cfg.toml"
args=(out_dir="$out/run" eval_interval=0 threads=1 max_iters=1 "$@")
mpirun.openmpi --allow-run-as-root --oversubscribe -n "$ranks" bash -c \
    'python3 "$0" "$1.$OMPI_COMM_WORLD_RANK" "${@:2}"' "$here/footprint.py" "$out/peak_kb" \
    "$bin" train "$out/cfg.toml" "${args[@]}" >"$out/train.log" 2>&1
"$bin" plan "$out/cfg.toml" "${args[@]}" --world-size "$ranks" --ranks-per-host "$ranks" \
    --json >"$out/plan.json"
rm -rf "$out/run"
for ((r = 0; r < ranks; r++)); do
    python3 - "$out/plan.json" "$out/peak_kb.$r" "$r" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
rss_kb, kb = map(int, open(sys.argv[2]).read().split())
rank = int(sys.argv[3])
# The plan lists rank 0 and the largest of the others.
mb = plan["ranks"][0 if rank == 0 else -1]["peak_rss_mb"]
measured, rss = kb * 1024 / 1e6, rss_kb * 1024 / 1e6
swapped = f" (peak RSS {rss:,.0f} MB, the rest swapped out)" if kb > rss_kb * 1.01 else ""
print(f"rank {rank}: plan {mb:,.0f} MB, measured {measured:,.0f} MB, "
      f"error {100 * (mb - measured) / measured:+.1f} %{swapped}")
EOF
done
