#!/usr/bin/env bash
# check.sh - data-parallel training across 3 hosts joined by network links, on one
# machine (see cluster.sh), checked against a one-process run of the same config:
#
#   1. the same tiny config trained by 1 process and by 3 ranks on hosts h1..h3
#      (launched from a hostfile), with ZeRO stage 0 and 1: per-step and eval losses
#      agree to 1e-5 (relative), and so do the final checkpoints' losses;
#   2. the gradient traffic really crossed the links (each host's eth0 counters);
#   3. `nanogpt doctor` by hand, and `nanogpt launch` from h1 over real OpenSSH
#      (sshd on every host, StrictHostKeyChecking, BatchMode) with a docker0 bridge
#      (172.17.0.1 on every host) and `--iface eth0`: launch picks the launcher of
#      the linked MPI and the job trains; before MPI starts, launch refuses (naming
#      the host and the fix) the bridge without --iface, an unknown host key, a
#      missing binary and another build on h3; by hand, a missing binary on h3 is
#      named by the start-up timer (or the launcher) and another build at start;
#   4. mismatches: other data on h2 (its own disk) refuses the job before step 1,
#      naming the rank, host and file; another config file on h3 is reported and
#      ignored (the run equals the 1-process one);
#   5. faults, with the default collective_timeout_s and heartbeat_timeout_s: a rank
#      killed on h2, a rank stopped on h3, a link cut to h3 each end the job within
#      30 s with rank 0's message naming the host and the checkpoint to resume
#      from, leaving no process behind; the run then resumes from it;
#   6. stopping: a signal to the launcher, or Ctrl-C to `nanogpt launch` (exit 130),
#      stops every rank with a checkpoint that resumes exactly;
#   7. with OTHER_BIN (the other MPI's build): each MPI's launcher starting the other
#      MPI's binary, by hand and through launch, is refused on every rank.
#
#   scripts/multinode/check.sh [NANOGPT_BINARY]    (default target/release/nanogpt)
#   MPIRUN=mpiexec.hydra scripts/multinode/check.sh target/mpich/debug/nanogpt
#
# MPIRUN picks the launcher (default mpirun): Open MPI's, or MPICH's Hydra
# (mpiexec.hydra, the reference setup's `-f hosts -n 3 -ppn 1`). The binary must be
# built with `--features mpi` against the same MPI; OTHER_BIN, if set, is a build
# against the other MPI. Needs root and openssh-server. Where network namespaces are
# not permitted (unprivileged containers) it says so and exits 0 without checking
# anything; any failed check exits 1.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BIN=$(realpath "${1:-target/release/nanogpt}")
# Resolved here, before the script moves into its work folder.
[ -z "${OTHER_BIN:-}" ] || OTHER_BIN=$(realpath "$OTHER_BIN")
CLUSTER="$HERE/cluster.sh"
export CLUSTER_PREFIX=${CLUSTER_PREFIX:-ngptchk} CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT:-300}

say() { echo "multinode: $*"; }
die() { echo "multinode: FAILED: $*" >&2; exit 1; }

[ -x "$BIN" ] || die "no binary at $BIN (cargo build --release --features mpi)"
export MPIRUN=${MPIRUN:-mpirun}
command -v "$MPIRUN" >/dev/null || die "$MPIRUN is not installed"
version=$("$MPIRUN" --version 2>&1 || true)
if grep -qE "Open MPI|OpenRTE" <<<"$version"; then FLAVOUR=openmpi; else FLAVOUR=hydra; fi

# Can this machine make network namespaces and veth links at all?
probe=$CLUSTER_PREFIX-probe
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null ||
    ! ip netns add "$probe" 2>/dev/null; then
    say "SKIPPED: network namespaces are not permitted here (needs root, iproute2 and" \
        "unshare, and a kernel/container that allows 'ip netns add'); no multi-host check ran"
    exit 0
fi
if ! ip -n "$probe" link add vprobe0 type veth peer name vprobe1 2>/dev/null; then
    ip netns del "$probe"
    say "SKIPPED: veth links are not permitted here; no multi-host check ran"
    exit 0
fi
ip netns del "$probe"

WORK=$(mktemp -d /tmp/nanogpt-multinode.XXXXXX)
"$CLUSTER" down >/dev/null 2>&1 || true
cleanup() { "$CLUSTER" down >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT
"$CLUSTER" up 3 >/dev/null
cd "$WORK"
"$BIN" prepare shakespeare --out data/shakespeare_char --tokenizer char >/dev/null

# Six micro-steps per step: two per rank on three hosts.
CONFIG=(dataset=shakespeare_char n_layer=2 n_head=2 n_embd=64 block_size=32 batch_size=4
    gradient_accumulation_steps=6 eval_iters=6 eval_interval=5 log_interval=1 warmup_iters=2
    lr_decay_iters=10 learning_rate=3e-3 dropout=0.1 threads=1 always_save_checkpoint=true
    collective_timeout_s=60)

# "iter loss" of every step row, then "e<iter> val_loss" of every eval row.
curve() {
    sed -n 's/.*"iter":\([0-9]*\),"loss":\([-0-9.e]*\).*/\1 \2/p' "$1/metrics.jsonl"
    sed -n 's/.*"iter":\([0-9]*\),"train_loss".*"val_loss":\([-0-9.e]*\).*/e\1 \2/p' "$1/metrics.jsonl"
    "$BIN" eval --init-from "$1" --data data/shakespeare_char/val.bin --block-size 32 --json |
        sed -n 's/.*"loss":\([-0-9.e]*\).*/final \1/p'
}

same_curve() {
    local a=$1 b=$2
    paste -d' ' <(curve "$a") <(curve "$b") | awk -v a="$a" -v b="$b" '
        $1 != $3 { print "row " NR ": " $1 " vs " $3; bad = 1; next }
        { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2)
          if (r > 1e-5) { print a " vs " b " at " $1 ": " $2 " vs " $4; bad = 1 }
          if (r > worst) worst = r; n++ }
        END { if (n < 12) { print "only " n " rows"; bad = 1 }
              printf "%s vs %s: %d losses agree, largest relative difference %.2g\n", a, b, n, worst
              exit bad }'
}

host_bytes() { "$CLUSTER" bytes | awk '{print $2 + $3}'; }

say "reference: 1 process"
"$BIN" train "${CONFIG[@]}" max_iters=10 out_dir=one >one.log 2>&1 || { cat one.log; die "1-process run"; }

say "doctor across the 3 hosts"
"$CLUSTER" run -- "$BIN" doctor "${CONFIG[@]}" out_dir="$WORK/doctor" >doctor.log 2>&1 ||
    { cat doctor.log; die "doctor found a problem"; }
grep -av "setpgid" doctor.log | sed 's/^/multinode:   /'
for i in 1 2 3; do
    # Each rank's route to the others leaves through its own link.
    grep -aqE "^$((i - 1)) +h$i .* eth0 10\.78\.0\.$i\$" doctor.log ||
        die "doctor: h$i's network interface is not eth0 10.78.0.$i"
done

# `nanogpt launch` from h1, as a user logged into the first host runs it, over real
# OpenSSH, with a docker0 bridge (the same address on every host) in the way: it
# picks the launcher of the MPI it links, checks every host over ssh, then runs the
# doctor and the training. The binary is launched from $WORK/bin, so that a host can
# be given another one (an overlay). UCX is told to use TCP (the hosts share one
# kernel); nothing else is set by hand.
STATE_DIR=/run/$CLUSTER_PREFIX-cluster
SSH=$("$CLUSTER" sshd)
"$CLUSTER" bridge
mkdir -p bin
cp "$BIN" bin/nanogpt
"$CLUSTER" overlay "$WORK/bin"
case $FLAVOUR in
    openmpi) launch_env=(OMPI_MCA_plm_rsh_agent="$SSH") want=mpirun.openmpi ;;
    hydra) launch_env=(HYDRA_LAUNCHER_EXEC="$SSH" UCX_TLS=tcp,self) want=mpiexec.hydra ;;
esac
launch() { # launch [launch options] -- train ...: from h1, `nanogpt launch` over sshd
    env -u NANOGPT_MPIRUN "${launch_env[@]}" timeout 180 "$CLUSTER" exec h1 -- \
        "$WORK/bin/nanogpt" launch --hosts "$STATE_DIR/hostfile" -n 3 "$@"
}
say "nanogpt launch from h1 over sshd, docker0 on every host, --iface eth0 ($FLAVOUR)"
start=$SECONDS
launch --iface eth0 -- train "${CONFIG[@]}" max_iters=5 out_dir="$WORK/launched" \
    >launched.log 2>&1 || { cat launched.log; die "nanogpt launch"; }
grep -aq "^$want " launched.log || { cat launched.log; die "launch did not pick $want"; }
grep -aq "^launch: 3 host(s) reached over $SSH, each with this build" launched.log &&
    grep -aq "^ok: every rank" launched.log && grep -aq "data parallel: 3 ranks" launched.log &&
    [ -e launched/ckpt.safetensors ] || { cat launched.log; die "nanogpt launch did not train"; }
say "  trained after $((SECONDS - start)) s: $(head -1 launched.log | cut -c1-160) ..."

# Refused before MPI starts, each naming the host and the fix.
refused() { # refused NAME WANT [launch args...]: launch must fail, saying WANT
    local name=$1 want=$2; shift 2
    local start=$SECONDS
    if launch "$@" -- train "${CONFIG[@]}" max_iters=5 out_dir="$WORK/$name" >$name.log 2>&1; then
        cat $name.log; die "launch ran with $name"
    fi
    grep -aqF -- "$want" $name.log || { cat $name.log; die "$name: no clear refusal"; }
    grep -aqE "^(step|iter) [0-9]+" $name.log && die "$name: trained"
    [ -e "$name" ] && die "$name: wrote $name"
    say "  $name: refused after $((SECONDS - start)) s: $(grep -aF -- "$want" $name.log | head -1 | cut -c1-200)"
}
say "launch refuses, before MPI starts:"
refused no-iface "all have the address 172.17.0.1 (docker0): MPI would take it" 
grep -aq "add --iface eth0" no-iface.log || { cat no-iface.log; die "no-iface: no fix named"; }
"$CLUSTER" forget h3
refused unknown-key "launch: host h3: its SSH host key is not in known_hosts" --iface eth0
grep -aq "accept it once with \`ssh h3 true\`" unknown-key.log || die "unknown-key: no fix"
"$CLUSTER" learn
mkdir -p bin.h3
refused no-binary "launch: host h3: there is no nanogpt at $WORK/bin/nanogpt: copy this binary there" --iface eth0
# Another build: the same binary with one byte more (it still runs).
cp "$BIN" bin.h3/nanogpt && printf '\0' >>bin.h3/nanogpt
refused other-build "launch: host h3: another build of nanogpt is at $WORK/bin/nanogpt there" --iface eth0

# By hand (mpirun on h1, the article's way): another build is refused as MPI starts;
# a missing binary on h3 ends the job with the start-up timer naming rank 2 as never
# started (Hydra), or Open MPI's launcher names the host itself.
say "by hand, from h1:"
start=$SECONDS
if CLUSTER_FROM=h1 "$CLUSTER" run -- "$WORK/bin/nanogpt" train "${CONFIG[@]}" max_iters=5 \
    out_dir="$WORK/hand-build" >hand-build.log 2>&1; then cat hand-build.log; die "another build ran"; fi
grep -aq "refusing to start: rank 2 (host h3) runs build " hand-build.log ||
    { cat hand-build.log; die "by hand: another build on h3 not named"; }
say "  another build on h3: refused after $((SECONDS - start)) s"
rm bin.h3/nanogpt
start=$SECONDS
if NANOGPT_START_TIMEOUT_S=10 CLUSTER_FROM=h1 "$CLUSTER" run -- "$WORK/bin/nanogpt" train \
    "${CONFIG[@]}" max_iters=5 out_dir="$WORK/hand-missing" >hand-missing.log 2>&1; then
    cat hand-missing.log; die "a job without the binary on h3 ran"
fi
took=$((SECONDS - start))
if grep -aq "never started (see the launcher's output for why, e.g. a missing binary or library): rank 2" hand-missing.log; then
    say "  no binary on h3: the start-up timer named rank 2 as never started after $took s:"
    grep -a "never started" hand-missing.log | head -1 | cut -c1-240 | sed 's/^/multinode:   /'
elif [ $FLAVOUR = openmpi ] && grep -aq "h3" hand-missing.log; then
    say "  no binary on h3: Open MPI's launcher named the host after $took s:"
    grep -a "h3" hand-missing.log | head -2 | cut -c1-200 | sed 's/^/multinode:   /'
else
    cat hand-missing.log; die "by hand: the missing binary on h3 is not named"
fi
[ $took -le 30 ] || die "by hand: a missing binary took $took s to end the job"
rm -rf bin.h3
"$CLUSTER" overlay ""
"$CLUSTER" unbridge

for stage in 0 1; do
    say "3 hosts, ZeRO stage $stage"
    before=($(host_bytes))
    "$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" max_iters=10 zero_stage=$stage \
        out_dir="$WORK/three$stage" >three$stage.log 2>&1 || { cat three$stage.log; die "3-host run (stage $stage)"; }
    after=($(host_bytes))
    grep -aq "data parallel: 3 ranks" three$stage.log || die "not 3 ranks: $(head -3 three$stage.log)"
    for i in 0 1 2; do
        moved=$((after[i] - before[i]))
        # 11 steps of ~0.5 MB of gradients, each sent and received over the link.
        [ "$moved" -gt 2000000 ] || die "h$((i + 1)) moved only $moved bytes over eth0"
        say "  h$((i + 1)) eth0: $moved bytes sent + received"
    done
    same_curve one "three$stage" || die "3 hosts (stage $stage) and 1 process disagree"
    grep -aE "^3 ranks:" three$stage.log | sed 's/^/multinode:   /'
done

# Mismatches. Hosts get their own disks: h2 sees data.h2 as data, h3 conf.h3 as conf.
"$CLUSTER" overlay "$WORK/data $WORK/conf"
say "mismatches"
cp -r data data.h2
# One 4 KiB piece of h2's train.bin replaced by another: same size, same vocabulary.
dd if=data/shakespeare_char/train.bin of=data.h2/shakespeare_char/train.bin bs=4096 count=1 \
    seek=100 conv=notrunc status=none
cmp -s data/shakespeare_char/train.bin data.h2/shakespeare_char/train.bin && die "data.h2 unchanged"
start=$SECONDS
if "$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" max_iters=10 out_dir="$WORK/mismatch" \
    >mismatch.log 2>&1; then
    cat mismatch.log; die "the job with other data on h2 ran"
fi
grep -aq "refusing to start" mismatch.log &&
    grep -aq "rank 1 (host h2): .*shakespeare_char/train.bin has other content" mismatch.log ||
    { cat mismatch.log; die "no clear refusal for other data on h2"; }
grep -aqE "^iter [0-9]+:" mismatch.log && die "the job with other data on h2 trained"
[ -e mismatch/ckpt.safetensors ] && die "the job with other data on h2 wrote a checkpoint"
say "  other data on h2: refused before step 1 after $((SECONDS - start)) s:"
grep -a "refusing to start" mismatch.log | cut -c1-240 | sed 's/^/multinode:   /'
rm -rf data.h2

mkdir -p conf conf.h3
# The quick start's config (what the 1-process run used); h3's has another weight decay.
cp "$HERE/../../configs/train_shakespeare_char.toml" conf/run.toml
sed 's/^weight_decay = .*/weight_decay = 0.9/' conf/run.toml >conf.h3/run.toml
cmp -s conf/run.toml conf.h3/run.toml && die "conf.h3 unchanged"
"$CLUSTER" run -- "$BIN" train "$WORK/conf/run.toml" "${CONFIG[@]}" max_iters=10 \
    out_dir="$WORK/conf3" >conf3.log 2>&1 || { cat conf3.log; die "the job with another config on h3"; }
grep -aq "note: rank 2 (host h3): config $WORK/conf/run.toml here differs" conf3.log ||
    { cat conf3.log; die "no note about h3's config"; }
same_curve one conf3 || die "h3's config was used"
say "  another config file on h3: reported and ignored (the run equals 1 process)"
rm -rf conf.h3
"$CLUSTER" overlay ""

# Faults, with the default collective_timeout_s (300 s) and heartbeat_timeout_s
# (10 s). A long run; once it has a checkpoint, hurt the rank on one host: the job
# must end within 30 s, rank 0 naming the host and the checkpoint to resume from.
fault() {
    local out=$1 host=$2 signal=$3
    "$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" max_iters=100000 lr_decay_iters=100000 \
        eval_interval=20 collective_timeout_s=300 out_dir="$WORK/$out" >$out.log 2>&1 &
    local job=$! t=0 pid=""
    until [ -e "$out/ckpt.safetensors" ]; do
        sleep 0.2; t=$((t + 1))
        kill -0 $job 2>/dev/null || { cat $out.log; die "$out: the job ended early"; }
        [ $t -lt 600 ] || die "$out: no checkpoint after 120 s"
    done
    if [ "$signal" = cut ]; then
        "$CLUSTER" cut "$host"
    else
        until [ -n "$pid" ]; do pid=$("$CLUSTER" pid "$host" "out_dir=$WORK/$out" | head -1); done
        kill "$signal" "$pid"
    fi
    local start=$SECONDS rc=0
    wait $job || rc=$?
    local took=$((SECONDS - start))
    [ $rc -ne 0 ] || die "$out: the job succeeded after $signal"
    [ $took -le 30 ] || { cat $out.log; die "$out: the job took $took s to end"; }
    # Hydra's proxy on a cut-off host cannot be told to end (nor can it report): only
    # nanogpt must be gone there, by its own heartbeat (listed after a linger).
    local left; left=$(grep -v "hydra_pmi_proxy" "$STATE_DIR/leftover" || true)
    [ -z "$left" ] || { echo "$left"; die "$out: processes left behind"; }
    grep -q "hydra_pmi_proxy" "$STATE_DIR/leftover" &&
        say "  (Hydra's proxy on $host was left running, and reaped)"
    local ckpt
    ckpt="resume from $WORK/$out/ckpt.safetensors (iteration $(sed -n 's/.*"iter_num": *\([0-9]*\).*/\1/p' $out/ckpt.json))"
    grep -a "^error: rank 0 of 3 (host h1): " $out.log | grep -a "(host $host)" | grep -aqF "$ckpt" ||
        { cat $out.log; die "$out: rank 0 did not name $host and the checkpoint ($ckpt)"; }
    say "  $signal on $host: job ended with status $rc after $took s, nothing left running:"
    grep -a "^error: rank 0 of 3 (host h1): " $out.log | head -1 | cut -c1-250 | sed 's/^/multinode:   /'
}

say "faults (default settings)"
fault killed h2 -KILL
grep -aq "rank 1 (host h2) is gone" killed.log || die "killed: not named as gone"
fault stopped h3 -STOP
grep -aq "no heartbeat from rank 2 (host h3) for 1[0-9] s" stopped.log || die "stopped: not named"
# The rank on the cut-off host ends by its own heartbeat (10 s + 5 s abort grace),
# and Open MPI's daemon there by its keepalive once its rank is gone; the launcher on
# h1 can return before either, so the hosts get 20 s to empty by themselves.
CLUSTER_LINGER=20 fault cutlink h3 cut
"$CLUSTER" mend h3
# By rank 0's heartbeat, or (Open MPI) when its runtime, having noticed the lost host by
# its keepalive first, sends rank 0 SIGTERM: "no heartbeat has come from rank 2 ...".
grep -aqE "no heartbeat (has come )?from rank 2 \(host h3\)" cutlink.log || die "cutlink: not named"
saved=$(sed -n 's/.*"iter_num": *\([0-9]*\).*/\1/p' killed/ckpt.json)
"$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" max_iters=$((saved + 2)) lr_decay_iters=100000 \
    eval_interval=20 init_from=resume out_dir="$WORK/killed" >resume.log 2>&1 ||
    { cat resume.log; die "resuming after the fault"; }
say "  resumed from iteration $saved and trained to $((saved + 2))"
# Stopping. A signal to the launcher, as a user at the terminal sends it (Hydra:
# SIGTERM, which it forwards; Open MPI: SIGUSR1, the one it forwards), or Ctrl-C to
# `nanogpt launch`: every rank stops after the same step, rank 0 writes that step's
# checkpoint, and the run resumed from it equals the same job uninterrupted. (Not
# one process: over 60 steps the 3 ranks' other summation order drifts to 1e-4.)
STOP=(max_iters=60 lr_decay_iters=60 eval_interval=20)
"$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" "${STOP[@]}" out_dir="$WORK/three60" \
    >three60.log 2>&1 || { cat three60.log; die "3-host run of 60 iterations"; }
# The pid of the process in host $1's namespace whose command line starts with $2.
host_pid() {
    local p
    for p in $(ip netns pids "$CLUSTER_PREFIX-$1"); do
        tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | grep -q "^$2" && { echo "$p"; return; }
    done
    return 0
}
# The pid of the process in the switch namespace whose command line starts with $1.
head_pid() {
    local p
    for p in $(ip netns pids "$CLUSTER_PREFIX-sw"); do
        tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | grep -q "^$1" && { echo "$p"; return; }
    done
    return 0
}
stop() {
    local out=$1 signal=$2 how=$3 pid=""
    if [ "$how" = launch ]; then
        launch --iface eth0 -- train "${CONFIG[@]}" "${STOP[@]}" out_dir="$WORK/$out" \
            >$out.log 2>&1 &
    else
        "$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" "${STOP[@]}" out_dir="$WORK/$out" \
            >$out.log 2>&1 &
    fi
    local job=$! t=0
    until [ -e "$out/ckpt.safetensors" ]; do
        sleep 0.1; t=$((t + 1))
        kill -0 $job 2>/dev/null || { cat $out.log; die "$out: the job ended early"; }
        [ $t -lt 1200 ] || die "$out: no checkpoint after 120 s"
    done
    case $how in
        launch) pid=$(host_pid h1 "$WORK/bin/nanogpt launch") ;;
        *) pid=$(head_pid "$MPIRUN ") ;;
    esac
    [ -n "$pid" ] || die "$out: no $how process to signal"
    kill "-$signal" "$pid"
    local start=$SECONDS rc=0
    wait $job || rc=$?
    grep -aqE "^stopped by SIG[A-Z0-9]+ after iteration [0-9]+: checkpoint written" $out.log ||
        { cat $out.log; die "$out: no checkpoint after SIG$signal to $how"; }
    local last
    last=$(sed -n 's/^stopped by SIG[A-Z0-9]* after iteration \([0-9]*\):.*/\1/p' $out.log)
    [ "$last" -lt 60 ] || die "$out: the run ended before the signal"
    # `launch` says "stopped, resume me" as the ranks do (Hydra itself reports 0).
    [ "$how" != launch ] || [ $rc = 130 ] || die "$out: launch exited $rc after Ctrl-C, not 130"
    say "  SIG$signal to $how: stopped after iteration $last with a checkpoint, exit $rc, after $((SECONDS - start)) s"
    "$CLUSTER" run -- "$BIN" train "${CONFIG[@]}" "${STOP[@]}" init_from=resume \
        out_dir="$WORK/$out" >$out-resume.log 2>&1 || { cat $out-resume.log; die "$out: resuming"; }
    same_curve three60 $out || die "$out: the stopped and resumed run differs from the uninterrupted one"
}
say "stopping"
case $FLAVOUR in
    openmpi) stop stopped-by-hand USR1 mpirun ;;
    hydra) stop stopped-by-hand TERM mpirun ;;
esac
stop stopped-launch INT launch

# The other MPI's launcher, by hand (each of the two directions) and through launch:
# every rank refuses before training, naming both MPIs; nothing trains alone.
if [ -n "${OTHER_BIN:-}" ]; then
    say "the other MPI's launcher"
    case $FLAVOUR in
        openmpi) other=mpiexec.hydra mine="Open MPI" theirs="MPICH" ;;
        hydra) other=mpirun.openmpi mine="MPICH" theirs="Open MPI" ;;
    esac
    for pair in "$other $BIN $mine" "$MPIRUN $OTHER_BIN $theirs"; do
        read -r by bin built <<<"$pair"
        out=solo-$(basename "$by")
        if MPIRUN=$by "$CLUSTER" run -- "$bin" train "${CONFIG[@]}" max_iters=5 \
            out_dir="$WORK/$out" >$out.log 2>&1; then cat $out.log; die "$out: the job ran"; fi
        # Every rank refuses as it starts (Open MPI's launcher may kill a rank that
        # is slower to say so: it ends a job as soon as one process fails).
        n=$(grep -ac "built against $built (.*), started by " $out.log || true)
        [ "$n" -ge 1 ] || { cat $out.log; die "$out: no rank refused"; }
        grep -aqE "^(step|iter) [0-9]+" $out.log && die "$out: a rank trained"
        [ -e "$out" ] && die "$out: a rank wrote its out_dir"
        say "  $by starting the $built build: refused on $n of 3 ranks (no rank trained):"
        grep -a "built against" $out.log | head -1 | cut -c1-220 | sed 's/^/multinode:   /'
    done
    "$CLUSTER" overlay "$WORK/bin"
    refused other-launcher "is $( [ $FLAVOUR = openmpi ] && echo "Hydra, the launcher of MPICH and Intel MPI" || echo "Open MPI's launcher"), but this nanogpt is built against" \
        --mpirun $other --iface eth0
    "$CLUSTER" overlay ""
fi

say "OK: 3 hosts agree with 1 process (ZeRO 0 and 1), traffic crossed the links, launch over" \
    "sshd works with a bridge in the way and refuses broken hosts before MPI starts," \
    "mismatches are refused or ignored before step 1, faults end the whole job within 30 s" \
    "naming the host and checkpoint, a stopped job resumes exactly"
