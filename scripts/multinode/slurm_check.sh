#!/usr/bin/env bash
# slurm_check.sh - nanogpt under Slurm's srun (PMIx) agrees with one process.
#
#   scripts/multinode/slurm_check.sh [NANOGPT_BINARY]   (default target/release/nanogpt)
#
# Needs root and Debian's slurmd, slurmctld, slurm-client and munge
# (`apt-get install slurmd slurmctld slurm-client munge`). Starts a one-node cluster
# on this machine when none answers (munged, slurmctld, slurmd with a minimal
# /etc/slurm/slurm.conf; an existing slurm.conf is left alone), runs the same tiny
# config as 1 process and as `srun -n 2 --mpi=pmix`, and compares every logged loss.
# The binary must be built with `--features mpi` against Open MPI (PMIx support).
set -euo pipefail
BIN=$(realpath "${1:-target/release/nanogpt}")
say() { echo "slurm: $*"; }
die() { echo "slurm: FAILED: $*" >&2; exit 1; }
command -v srun >/dev/null && command -v slurmd >/dev/null ||
    { say "SKIPPED: Slurm is not installed (slurmd slurmctld slurm-client munge)"; exit 0; }
[ "$(id -u)" = 0 ] || { say "SKIPPED: starting a Slurm cluster needs root"; exit 0; }

# (sinfo retries for minutes when no controller is configured: bound it.)
if ! timeout 10 sinfo -h >/dev/null 2>&1; then
    host=$(hostname)
    mkdir -p /etc/slurm /var/spool/nanogpt-slurmd /var/spool/nanogpt-slurmctld /var/log/slurm /run/munge
    if [ ! -e /etc/munge/munge.key ]; then
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    fi
    chown munge:munge /run/munge
    pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged
    [ -e /etc/slurm/slurm.conf ] || cat >/etc/slurm/slurm.conf <<CONF
ClusterName=nanogpt-check
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/nanogpt-slurmctld
SlurmdSpoolDir=/var/spool/nanogpt-slurmd
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$(nproc) RealMemory=1000 State=UNKNOWN
PartitionName=check Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    for _ in $(seq 50); do timeout 5 sinfo -h -t idle 2>/dev/null | grep -q idle && break; sleep 0.2; done
fi
if ! timeout 10 sinfo -h >/dev/null 2>&1; then
    say "SKIPPED: could not start a one-node Slurm cluster here (see" \
        "/var/log/slurm/slurmctld.log and slurmd.log); nanogpt was not run"
    exit 0
fi

WORK=$(mktemp -d /tmp/nanogpt-slurm.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
"$BIN" prepare shakespeare --out data/shakespeare_char --tokenizer char >/dev/null
CONFIG=(dataset=shakespeare_char n_layer=2 n_head=2 n_embd=64 block_size=32 batch_size=4
    gradient_accumulation_steps=4 eval_iters=4 eval_interval=5 max_iters=10 log_interval=1
    dropout=0.1 threads=1 collective_timeout_s=60)
"$BIN" train "${CONFIG[@]}" out_dir=one >one.log 2>&1 || { cat one.log; die "1 process"; }
timeout 300 srun -n 2 --mpi=pmix "$BIN" train "${CONFIG[@]}" out_dir=two >two.log 2>&1 ||
    { cat two.log; die "srun -n 2"; }
grep -q "data parallel: 2 ranks" two.log || die "srun did not start 2 ranks: $(head -3 two.log)"
losses() { sed -n 's/.*"loss":\([-0-9.e]*\).*/\1/p' "$1/metrics.jsonl"; }
paste -d' ' <(losses one) <(losses two) | awk '
    { d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > worst) worst = r; n++ }
    END { printf "slurm: %d losses, largest relative difference %.2g\n", n, worst
          exit (n < 11 || worst > 1e-5) }' || die "srun -n 2 and 1 process disagree"
say "OK: srun -n 2 --mpi=pmix agrees with 1 process"
