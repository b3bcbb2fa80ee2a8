#!/usr/bin/env bash
# scaling.sh - weak scaling of data-parallel training, for docs/PERFORMANCE.md.
#
#   scripts/multinode/scaling.sh [NANOGPT_BINARY] [MODEL_ARGS...]
#
# Runs the same per-rank work (B x T tokens, one micro-step per rank per optimizer
# step, 1 thread per rank) as
#   1. one process,
#   2. two ranks on this host (Open MPI, shared memory),
#   3. three hosts made from network namespaces, links shaped to 1 Gbit/s and 1 ms
#      (ZeRO stage 0 and 1),
# and prints, per run, the median ms/step (iterations >= 1), tokens/s per rank, the
# weak-scaling efficiency (1-process ms/step / ms/step), the communication report
# (out_dir/comm.json) and the peak RSS of the largest rank.
#
# The 3-host part needs root and a cluster tool with link shaping: MPINET (default
# ../shared/tools/mpinet/netns-cluster.sh, our dev machines' tested harness; without
# sch_netem it emulates the delay with an NFQUEUE helper, which needs gcc,
# libnetfilter-queue-dev and iptables). Without it, that part is skipped.
# The binary must be built with `--features mpi`.
set -euo pipefail

BIN=$(realpath "${1:-target/release/nanogpt}")
shift || true
MODEL=("$@")
[ ${#MODEL[@]} -gt 0 ] || MODEL=(n_layer=12 n_head=12 n_embd=768 batch_size=2 block_size=256)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MPINET=${MPINET:-$ROOT/../shared/tools/mpinet/netns-cluster.sh}
STEPS=${STEPS:-5}
WORK=$(mktemp -d /tmp/nanogpt-scaling.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
"$BIN" prepare shakespeare --out data/shakespeare --tokenizer gpt2 >/dev/null

COMMON=(dataset=shakespeare "${MODEL[@]}" threads=1 max_iters=$STEPS eval_interval=0
    log_interval=1 warmup_iters=0 learning_rate=1e-4 decay_lr=false dropout=0
    always_save_checkpoint=false collective_timeout_s=600)

# Median ms of step rows with iter >= 1 (the first step warms caches and pools).
median_ms() {
    sed -n 's/.*"iter":\([0-9]*\),.*"ms":\([0-9.e]*\).*/\1 \2/p' "$1/metrics.jsonl" |
        awk '$1 >= 1 {print $2}' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'
}
# Largest "Maximum resident set size" (kB) among the per-rank /usr/bin/time logs, MB.
peak_mb() { cat "$@" | sed -n 's/.*Maximum resident set size (kbytes): //p' | sort -g | tail -1 | awk '{printf "%.0f", $1 / 1024}'; }
comm() { [ -e "$1/comm.json" ] && tr -d '\n ' <"$1/comm.json" || echo "-"; }

# Runs "$@" under /usr/bin/time, writing PREFIX.<rank> (Open MPI sets the rank).
TIMED=(sh -c 'p=$0; exec /usr/bin/time -v -o "$p.${OMPI_COMM_WORLD_RANK:-0}" "$@"')
BASE=""
report() {
    local name=$1 dir=$2 ranks=$3; shift 3
    local ms; ms=$(median_ms "$dir")
    [ -n "$BASE" ] || BASE=$ms
    local tok; tok=$(awk -v m="$ms" -v c="${MODEL[*]}" 'BEGIN {
        split(c, kv, " "); b = 0; t = 0
        for (i in kv) { split(kv[i], p, "="); if (p[1] == "batch_size") b = p[2]; if (p[1] == "block_size") t = p[2] }
        printf "%.1f", b * t / (m / 1000) }')
    printf '%-34s ranks %d  ms/step %8.1f  tokens/s/rank %7s  efficiency %5.1f%%  peak RSS %s MB\n' \
        "$name" "$ranks" "$ms" "$tok" "$(awk -v b="$BASE" -v m="$ms" 'BEGIN {print 100 * b / m}')" \
        "$(peak_mb "$@")"
    echo "    comm.json: $(comm "$dir")"
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -v "$BIN" train "${COMMON[@]}" gradient_accumulation_steps=1 out_dir=one \
    >one.log 2>one.time || { cat one.log one.time; exit 1; }
report "1 process" one 1 one.time

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -n 2 --bind-to none "${TIMED[@]}" "$WORK/two.time" "$BIN" train \
    "${COMMON[@]}" gradient_accumulation_steps=2 out_dir=two >two.log 2>&1 ||
    { cat two.log; exit 1; }
report "2 ranks, one host" two 2 two.time.*

if [ "$(id -u)" != 0 ] || [ ! -x "$MPINET" ]; then
    echo "3 hosts: SKIPPED (needs root and $MPINET)"
    exit 0
fi
export MPINET_PREFIX=ngscale MPIEXEC=mpirun.openmpi MPIEXEC_TIMEOUT=3000
"$MPINET" down >/dev/null 2>&1 || true
hostfile=$("$MPINET" up 3 | tail -1)
trap '"$MPINET" down >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
"$MPINET" netem delay 1ms rate 1gbit
for stage in 0 1; do
    "$MPINET" run "$hostfile" -- "${TIMED[@]}" "$WORK/three$stage.time" "$BIN" train \
        "${COMMON[@]}" gradient_accumulation_steps=3 zero_stage=$stage out_dir="$WORK/three$stage" \
        >three$stage.log 2>&1 || { cat three$stage.log; exit 1; }
    report "3 hosts, 1 Gbit/s 1 ms, ZeRO $stage" three$stage 3 three$stage.time.*
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
