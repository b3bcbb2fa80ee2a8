#!/usr/bin/env bash
# Fault injection over the multi-file outputs (see docs/reliability.md, "Outputs of
# several files"): `export`, `export --adapter-only` and `prepare --format alpaca`,
# each run TRIALS times over a missing destination or over a previous output, and
# stopped at a random point: SIGKILL sent from outside after a random delay within
# the command's own duration, or one of the test-only faults of src/fault.rs at a
# random step (`kill-at-write:N`, `kill-at-rename:N`, `eio-write:N`, `eio-rename:N`).
# After each trial the destination must be exactly what it was (absent, or the
# previous output) or exactly the complete new output: anything else is counted as
# mixed or partial. Then the command runs again, uninterrupted, and must leave the
# new output and no temporary folder beside it.
#
#   scripts/fault_outputs.sh [TRIALS] [CASE...]    (default: 200 trials; all cases:
#                                                   export adapter prepare)
#
# Exit status 1 if any trial left a mixed or partial output. The short version of
# these checks runs in `cargo test` (tests/outputs.rs). NANOGPT_BIN=PATH runs that
# binary instead of building the release one (the one `cargo test` built, say:
# target/debug/nanogpt, where a release build would take too long).
set -euo pipefail

cd "$(dirname "$0")/.."
TRIALS=${1:-200}
shift || true
CASES=("$@")
[ ${#CASES[@]} -eq 0 ] && CASES=(export adapter prepare)

if [ -n "${NANOGPT_BIN:-}" ]; then
    BIN=$(realpath "$NANOGPT_BIN")
else
    cargo build --release --quiet --bin nanogpt
    BIN=$PWD/target/release/nanogpt
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
export RAYON_NUM_THREADS=1
unset NANOGPT_FAULT

# A tiny GPT-2-vocabulary base (trained 2 steps from scratch, exported), and two LoRA
# runs on it whose adapters and merged models differ (their last step saved, not the
# best: a fine-tune keeps only the best, which can be step 2 for both).
for i in $(seq 40); do echo "To be, or not to be, that is the question:"; done >text.txt
"$BIN" prepare text.txt --out data --tokenizer gpt2 --val-fraction 0.2 >/dev/null
TINY=(n_layer=1 n_head=2 n_embd=8 block_size=8 batch_size=2 eval_iters=1 threads=1)
"$BIN" train dataset=data out_dir=tiny "${TINY[@]}" max_iters=2 eval_interval=2 >/dev/null 2>&1
"$BIN" export --from tiny --to base >/dev/null
for run in run1:2 run2:4; do
    "$BIN" train init_from=base dataset=data "out_dir=${run%:*}" "${TINY[@]}" lora_rank=2 \
        "max_iters=${run#*:}" eval_interval=2 learning_rate=1e-2 warmup_iters=0 \
        always_save_checkpoint=true >/dev/null 2>&1
done
alpaca() { # alpaca N SALT
    for i in $(seq "$1"); do
        printf '{"instruction": "Count to %d", "input": "", "output": "%s %d"}\n' "$i" "$2" "$i"
    done
}
alpaca 12 old >a.jsonl
alpaca 14 new >b.jsonl

args_of() { # args_of CASE old|new DEST
    local from=run1 src=a.jsonl
    [ "$2" = new ] && from=run2 src=b.jsonl
    case $1 in
    export) echo "export --from $from --to $3" ;;
    adapter) echo "export --from $from --to $3 --adapter-only" ;;
    prepare) echo "prepare $src --out $3 --format alpaca --tokenizer char --val-fraction 0.3" ;;
    esac
}

# A hash of every file under a folder (the lock file left out); "absent" if none, or
# if the folder holds nothing but the lock (`prepare` locks its --out folder first:
# killed before anything was written, it leaves no dataset, only that folder).
digest() {
    if [ ! -d "$1" ] || [ -z "$(find "$1" -type f ! -name .nanogpt.lock -print -quit)" ]; then
        echo absent
        return
    fi
    (cd "$1" && find . -type f ! -name .nanogpt.lock -print0 | sort -z | xargs -0 -r sha256sum) |
        sha256sum | cut -c1-16
}

leftovers() { # leftovers DEST: temporary folders of interrupted outputs beside DEST
    find . -maxdepth 1 \( -name ".$1.tmp-*" -o -name ".$1.commit-*" \) | wc -l
}

status=0
declare -A RESULTS
for case in "${CASES[@]}"; do
    # The reference outputs, and how long the command takes.
    read -ra old <<<"$(args_of "$case" old ref)"
    "$BIN" "${old[@]}" >/dev/null 2>&1
    OLD=$(digest ref)
    rm -rf ref
    read -ra new <<<"$(args_of "$case" new ref)"
    start=$(date +%s%N)
    "$BIN" "${new[@]}" >/dev/null 2>&1
    ms=$((($(date +%s%N) - start) / 1000000))
    NEW=$(digest ref)
    rm -rf ref
    [ "$OLD" != "$NEW" ] || { echo "$case: the two outputs are the same" >&2; exit 2; }
    mixed=0 whole_old=0 whole_new=0 absent=0 bad_rerun=0
    declare -A KINDS=()
    for trial in $(seq "$TRIALS"); do
        dest=out$trial
        read -ra old <<<"$(args_of "$case" old "$dest")"
        read -ra new <<<"$(args_of "$case" new "$dest")"
        previous=$((RANDOM % 2))
        [ $previous -eq 1 ] && "$BIN" "${old[@]}" >/dev/null 2>&1
        before=$(digest "$dest")
        how=$((RANDOM % 5))
        if [ $how -eq 0 ]; then
            kind=sigkill
            delay_us=$((RANDOM * 32768 + RANDOM))
            delay_us=$((delay_us % (ms * 1000 + 1)))
            "$BIN" "${new[@]}" >/dev/null 2>&1 &
            pid=$!
            sleep "$(printf '0.%06d' "$delay_us")"
            kill -9 $pid 2>/dev/null || true
            wait $pid 2>/dev/null || true
        else
            kinds=(kill-at-write kill-at-rename eio-write eio-rename)
            kind=${kinds[$((how - 1))]}
            NANOGPT_FAULT="$kind:$((RANDOM % 8 + 1))" "$BIN" "${new[@]}" >/dev/null 2>&1 || true
        fi
        KINDS[$kind]=$((${KINDS[$kind]:-0} + 1))
        now=$(digest "$dest")
        if [ "$now" = "$NEW" ]; then
            whole_new=$((whole_new + 1))
        elif [ "$now" = "$before" ]; then
            if [ "$now" = absent ]; then absent=$((absent + 1)); else whole_old=$((whole_old + 1)); fi
        else
            mixed=$((mixed + 1))
            echo "$case trial $trial ($kind, previous output: $previous): mixed or partial" >&2
            ls -la "$dest" >&2 || true
        fi
        if ! "$BIN" "${new[@]}" >rerun.log 2>&1 || [ "$(digest "$dest")" != "$NEW" ] ||
            [ "$(leftovers "$dest")" -ne 0 ]; then
            bad_rerun=$((bad_rerun + 1))
            echo "$case trial $trial ($kind): the run after it did not leave the new output alone" >&2
            tail -3 rerun.log >&2
            ls -la "$dest" >&2 || true
        fi
        rm -rf "$dest"
    done
    kinds_line=""
    for k in "${!KINDS[@]}"; do kinds_line+="$k ${KINDS[$k]}, "; done
    RESULTS[$case]="$TRIALS trials ($((ms)) ms a run; ${kinds_line%, }): new output $whole_new, previous output $whole_old, absent $absent, mixed or partial $mixed, bad re-runs $bad_rerun"
    [ $mixed -eq 0 ] && [ $bad_rerun -eq 0 ] || status=1
    unset KINDS
done
for case in "${CASES[@]}"; do
    echo "$case: ${RESULTS[$case]}"
done
exit $status
