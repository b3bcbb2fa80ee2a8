#!/usr/bin/env bash
# ag_overlap.sh - what leaving ZeRO-1/2's all-gather of the updated weights in flight
# saves (2 ranks on this host, Open MPI), for docs/multinode.md.
#
#   bench/ag_overlap.sh [NANOGPT_BINARY] [MODEL_ARGS...]
#
# Runs the same job (1 thread per rank; default GPT-2 124M shape, B 2 x T 256 per rank,
# gradient_accumulation_steps=2, ZeRO 1) with the gathers in flight (default) and
# blocking (NANOGPT_AG_OVERLAP=0), alternating, PAIRS times (default 2), and prints per
# run the communication report's step time and the all-gather's exposed time
# (exposed_gather_ms: the blocking gather, or starting the gathers and waiting for
# what had not arrived when the next forward needed it). STAGE (default 1) picks the
# ZeRO stage, EXTRA adds key=value pairs. The binary must be built with
# `--features mpi`. Needs ~2.5 GB per rank at 124M.
#
# HOSTS=3: three hosts made from network namespaces instead (needs root and MPINET,
# default ../shared/tools/mpinet/netns-cluster.sh), links shaped to 1 Gbit/s + 1 ms,
# gradient_accumulation_steps=3, as bench/overlap.sh does.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-target/release/nanogpt}")
shift || true
MODEL=("$@")
[ ${#MODEL[@]} -gt 0 ] || MODEL=(n_layer=12 n_head=12 n_embd=768 batch_size=2 block_size=256)
STEPS=${STEPS:-4}
WORK=$(mktemp -d /tmp/nanogpt-agoverlap.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
"$BIN" prepare shakespeare --out data/shakespeare --tokenizer gpt2 >/dev/null
COMMON=(dataset=shakespeare "${MODEL[@]}" threads=1 max_iters=$STEPS eval_interval=0
    log_interval=1 warmup_iters=0 learning_rate=1e-4 decay_lr=false dropout=0
    always_save_checkpoint=false collective_timeout_s=600 zero_stage=${STAGE:-1})
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
HOSTS=${HOSTS:-1}
if [ "$HOSTS" = 3 ]; then
    MPINET=${MPINET:-$ROOT/../shared/tools/mpinet/netns-cluster.sh}
    export MPINET_PREFIX=${MPINET_PREFIX:-ngag} MPINET_SUBNET=${MPINET_SUBNET:-10.78.0}
    export MPIEXEC=mpirun.openmpi MPIEXEC_TIMEOUT=3000
    "$MPINET" down >/dev/null 2>&1 || true
    hostfile=$("$MPINET" up 3 | tail -1)
    trap '"$MPINET" down >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
    "$MPINET" netem delay 1ms rate 1gbit
    # Open MPI forwards environment variables only when named.
    launch() { "$MPINET" run "$hostfile" -x NANOGPT_AG_OVERLAP -- "$@"; }
    COMMON+=(gradient_accumulation_steps=3)
else
    launch() { mpirun -n 2 --bind-to none -x NANOGPT_AG_OVERLAP "$@"; }
    COMMON+=(gradient_accumulation_steps=2)
fi
field() { sed -n "s/.*\"$1\": *\([^,}]*\).*/\1/p" "$2" | head -1; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for pair in $(seq "${PAIRS:-2}"); do
    for ag in 1 0; do
        out="$WORK/run-$pair-$ag"
        # shellcheck disable=SC2086
        NANOGPT_AG_OVERLAP=$ag launch "$BIN" train "${COMMON[@]}" ${EXTRA:-} out_dir="$out" >"$out.log" 2>&1 ||
            { cat "$out.log"; exit 1; }
        tr -d '\n ' <"$out/comm.json" >"$out.json"
        printf 'hosts %s ZeRO %s NANOGPT_AG_OVERLAP=%s in_flight %-5s step %8.1f ms  gather exposed %7.1f ms  reduce exposed %7.1f ms  other %6.1f ms\n' \
            "$HOSTS" "${STAGE:-1}" "$ag" "$(field gathers_in_flight "$out.json")" "$(field step_ms "$out.json")" \
            "$(field exposed_gather_ms "$out.json")" "$(field exposed_reduce_ms "$out.json")" \
            "$(field other_comm_ms "$out.json")"
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
