#!/usr/bin/env bash
# overlap.sh - how much of the gradient reduction backward hides (2 ranks on this host, or
# 3 emulated hosts), for docs/PERFORMANCE.md (communication section) and docs/multinode.md.
#
#   bench/overlap.sh [NANOGPT_BINARY] [MODEL_ARGS...]
#
# Runs the same job (Open MPI, 1 thread per rank; default GPT-2
# 124M shape, B 2 x T 256 per rank) once per setting below and prints, per run, the
# communication report's step time, exposed and stand-alone reduction times, the
# hidden share (1 - exposed / alone, a ratio within one run), the skew (how much
# longer the slowest rank computed than rank 0, mean per step: a wait no overlap
# removes) and the hidden share net of it (1 - max(0, exposed - skew) / alone), the other
# collectives' time, and the all-gather of the updated weights (ZeRO-1/2): its
# exposed time (exposed_gather_ms: the blocking gather, or starting the gathers and
# waiting for what had not arrived when the next forward needed it) and whether it
# was left in flight (gathers_in_flight). Settings:
#   before   - embeddings' bucket last (NANOGPT_EMBEDDINGS_FIRST=0), default progress
#              thread (off on one host, on across hosts): the code before issue 16's work
#   first    - embeddings' bucket first (NANOGPT_EMBEDDINGS_FIRST=1), default thread,
#              the weights' all-gathers left in flight (the default)
#   +thread  - first, progress thread forced on (NANOGPT_PROGRESS_THREAD=1)
#   -thread  - first, progress thread forced off (NANOGPT_PROGRESS_THREAD=0)
#   ag-block - first, the weights' all-gather one blocking collective right after the
#              update (NANOGPT_AG_OVERLAP=0); "first ag-block" at ZeRO 1 or 2 is the
#              in-flight vs blocking A/B
# each for ZeRO 0 and ZeRO 1 (ZERO_STAGES, default "0 1"; 2 as well), all settings
# ROUNDS times (default 1, alternating them), plus EXTRA key=value pairs (e.g.
# EXTRA=grad_reduce_dtype=bfloat16). E.g. the gathers in flight vs blocking:
#   ZERO_STAGES=1 SETTINGS="first ag-block" ROUNDS=2 bench/overlap.sh
# The binary must be built with `--features mpi`. Needs ~3 GB per rank at 124M.
#
# HOSTS=3: three hosts made from network namespaces instead (needs root and MPINET,
# default ../shared/tools/mpinet/netns-cluster.sh), links shaped to 1 Gbit/s + 1 ms,
# gradient_accumulation_steps=3, as scripts/multinode/scaling.sh does.
# SETTINGS overrides the list of settings (e.g. "first +thread").
# NANOGPT_RING_REDUCE=0 in the environment is forwarded to every rank (ZeRO 1-3 then
# reduce with MPI's reduce-scatter instead of our ring). Each run also prints every
# rank's peak RSS (/usr/bin/time).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$(realpath "${1:-target/release/nanogpt}")
shift || true
MODEL=("$@")
[ ${#MODEL[@]} -gt 0 ] || MODEL=(n_layer=12 n_head=12 n_embd=768 batch_size=2 block_size=256)
STEPS=${STEPS:-3}
WORK=$(mktemp -d /tmp/nanogpt-overlap.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
"$BIN" prepare shakespeare --out data/shakespeare --tokenizer gpt2 >/dev/null

HOSTS=${HOSTS:-1}
COMMON=(dataset=shakespeare "${MODEL[@]}" threads=1 max_iters=$STEPS eval_interval=0
    log_interval=1 warmup_iters=0 learning_rate=1e-4 decay_lr=false dropout=0
    always_save_checkpoint=false collective_timeout_s=600)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ "$HOSTS" = 3 ]; then
    MPINET=${MPINET:-$ROOT/../shared/tools/mpinet/netns-cluster.sh}
    export MPINET_PREFIX=${MPINET_PREFIX:-ngovl} MPINET_SUBNET=${MPINET_SUBNET:-10.79.0}
    export MPIEXEC=mpirun.openmpi MPIEXEC_TIMEOUT=3000
    "$MPINET" down >/dev/null 2>&1 || true
    hostfile=$("$MPINET" up 3 | tail -1)
    trap '"$MPINET" down >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
    "$MPINET" netem delay 1ms rate 1gbit
    # Open MPI forwards environment variables only when named.
    launch() { "$MPINET" run "$hostfile" "${XS[@]}" -- "$@"; }
    COMMON+=(gradient_accumulation_steps=3)
else
    launch() { mpirun -n 2 --bind-to none "$@"; }
    COMMON+=(gradient_accumulation_steps=2)
fi

field() { sed -n "s/.*\"$1\": *\([^,}]*\).*/\1/p" "$2" | head -1; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "${ROUNDS:-1}"); do
for stage in ${ZERO_STAGES:-0 1}; do
    for setting in ${SETTINGS:-before first +thread}; do
        ag=1
        case $setting in
        before) ef=0 pt= ;;
        first) ef=1 pt= ;;
        +thread) ef=1 pt=1 ;;
        -thread) ef=1 pt=0 ;;
        ag-block) ef=1 pt= ag=0 ;;
        *) echo "unknown setting $setting (before, first, +thread, -thread, ag-block)" >&2; exit 1 ;;
        esac
        out="$WORK/r$round-z$stage-$setting"
        export NANOGPT_EMBEDDINGS_FIRST=$ef NANOGPT_AG_OVERLAP=$ag
        XS=(-x NANOGPT_EMBEDDINGS_FIRST -x NANOGPT_AG_OVERLAP)
        [ -z "${NANOGPT_RING_REDUCE:-}" ] || XS+=(-x NANOGPT_RING_REDUCE)
        unset NANOGPT_PROGRESS_THREAD
        [ -z "$pt" ] || { export NANOGPT_PROGRESS_THREAD=$pt; XS+=(-x NANOGPT_PROGRESS_THREAD); }
        # shellcheck disable=SC2086
        launch sh -c 'p=$0; exec /usr/bin/time -f %M -o "$p.rss.${OMPI_COMM_WORLD_RANK:-0}" "$@"' \
            "$out" "$BIN" train "${COMMON[@]}" \
            zero_stage=$stage ${EXTRA:-} out_dir="$out" >"$out.log" 2>&1 ||
            { cat "$out.log"; exit 1; }
        tr -d '\n ' <"$out/comm.json" >"$out.json"
        printf 'hosts %s ZeRO %s %-8s %s step %8.1f ms  exposed %7.1f ms  alone %7.1f ms  hidden %5.1f%%  skew %7.1f ms  hidden net of skew %5.1f%%  other %7.1f ms  gather %7.1f ms  in_flight %-5s  grad_bytes %s\n' \
            "$HOSTS" "$stage" "$setting" "${EXTRA:-}" "$(field step_ms "$out.json")" "$(field exposed_reduce_ms "$out.json")" \
            "$(field reduce_alone_ms "$out.json")" \
            "$(awk -v h="$(field hidden_fraction "$out.json")" 'BEGIN {print 100 * h}')" \
            "$(field skew_ms "$out.json")" \
            "$(awk -v h="$(field hidden_fraction_net_of_skew "$out.json")" 'BEGIN {print 100 * h}')" \
            "$(field other_comm_ms "$out.json")" "$(field exposed_gather_ms "$out.json")" \
            "$(field gathers_in_flight "$out.json")" "$(field grad_bytes "$out.json")"
        printf '    peak RSS by rank (MB):'
        for f in "$out".rss.*; do awk '{printf " %.0f", $1 / 1024}' "$f"; done
        echo
    done
done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
