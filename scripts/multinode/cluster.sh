#!/usr/bin/env bash
# cluster.sh - N fake hosts on this machine, for testing multi-node MPI runs.
#
#   cluster.sh up N                 make hosts h1..hN (prints the hostfile path)
#   cluster.sh run [MPIRUN OPTS] -- CMD ARGS...
#                                   mpirun across the hosts, one rank per host
#   cluster.sh bytes                per host: "hI TX_BYTES RX_BYTES" of its eth0
#   cluster.sh pid HOST PATTERN     pids inside HOST whose command line matches PATTERN
#   cluster.sh cut HOST            takes HOST's link down (a cut cable)
#   cluster.sh mend HOST           brings it up again
#   cluster.sh down                 remove everything `up` made
#
# Each host is a network namespace with one veth link ("eth0", 10.78.0.I/24) to a
# bridge in a switch namespace, where mpirun runs (the "head", 10.78.0.254). Nothing
# is added to the root namespace and no route leads out. Processes still share the
# filesystem, so every host sees the same binary, data and out_dir.
#
# mpirun reaches the hosts through an ssh stand-in ($STATE/ssh) that runs the
# remote command inside the host's namespace, in its own UTS namespace whose
# hostname is the host's name. Open MPI (Debian's mpirun.openmpi) and MPICH/Hydra
# (mpiexec.hydra, mpiexec.mpich) are both driven; both are told to use TCP on the
# veths only, since all namespaces share one kernel and MPI would otherwise move
# the data through shared memory and nothing would cross a link.
#
# Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), iproute2 and unshare (util-linux).
# After `run`, $STATE/leftover lists the processes the job left on the hosts (then
# killed). CLUSTER_OVERLAY="DIR ..." gives hosts their own disks: host hI sees DIR.hI
# (where it exists) in place of DIR.
# Open MPI's runtime is told to notice a lost host in seconds (TCP keepalive on its
# out-of-band channel); without it mpirun hangs after an abort when a link is cut.
# Env: CLUSTER_PREFIX (ngpt), CLUSTER_SUBNET (10.78.0), CLUSTER_STATE
# (/run/$CLUSTER_PREFIX-cluster), MPIRUN (mpirun), CLUSTER_TIMEOUT (job limit for
# `run`, seconds, default 600), CLUSTER_LINGER (seconds `run` waits for what a job
# left on the hosts to end by itself before listing it, default 0).
set -euo pipefail

PREFIX=${CLUSTER_PREFIX:-ngpt}
SUBNET=${CLUSTER_SUBNET:-10.78.0}
STATE=${CLUSTER_STATE:-/run/$PREFIX-cluster}
MPIRUN=${MPIRUN:-mpirun}
SWITCH=$PREFIX-sw
HEAD=$SUBNET.254

fail() { echo "cluster.sh: $*" >&2; exit 1; }
hosts() { cat "$STATE/n" 2>/dev/null || fail "no cluster is up ($0 up N)"; }
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(sw|h[0-9]+)\$" || true; }

up() {
    local n=${1:-3} i ns
    [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 100 ] || fail "up: N must be 1..100"
    [ -e "$STATE" ] && fail "$STATE exists: a cluster is up ($0 down first)"
    [ -z "$(our_namespaces)" ] || fail "namespaces $PREFIX-* exist ($0 down first)"
    command -v unshare >/dev/null || fail "unshare (util-linux) is missing"
    mkdir -p "$STATE"
    ip netns add "$SWITCH"
    ip -n "$SWITCH" link set lo up
    ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" addr add "$HEAD/24" dev br0
    ip -n "$SWITCH" link set br0 up

    local names="127.0.0.1 localhost"$'\n'"$HEAD head"
    for i in $(seq 1 "$n"); do names+=$'\n'"$SUBNET.$i h$i"; done
    : > "$STATE/hostfile"
    for i in $(seq 1 "$n"); do
        ns=$PREFIX-h$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # The veth is created in the switch namespace with its peer moved straight
        # into the host's: the root namespace never sees either end.
        ip -n "$SWITCH" link add "port$i" type veth peer name eth0 netns "$ns"
        ip -n "$SWITCH" link set "port$i" master br0 up
        ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
        echo "h$i" >> "$STATE/hostfile"
    done
    # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts: names
    # h1..hN and head resolve in every namespace.
    for ns in "$SWITCH" $(seq -f "$PREFIX-h%g" 1 "$n"); do
        mkdir -p "/etc/netns/$ns"
        printf '%s\n' "$names" > "/etc/netns/$ns/hosts"
    done
    echo "$n" > "$STATE/n"

    # The ssh stand-in: ssh [options] HOST COMMAND-WORDS...; like ssh, the words are
    # joined into one command line for a shell on the "remote" host.
    cat > "$STATE/ssh" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do
    case "\$1" in
        -p|-l|-o|-i|-F) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=\$1; shift
case "\$host" in
    h[0-9]*) ;;
    $SUBNET.*) host=h\${host##*.} ;;
    *) echo "cluster ssh: unknown host \$host" >&2; exit 255 ;;
esac
# Own disks, where asked: each folder D of \$CLUSTER_OVERLAY for which D.HOST exists
# is replaced by it for this host's processes (a private mount namespace).
exec ip netns exec "$PREFIX-\$host" unshare --uts --mount sh -c '
    hostname "\$0" || exit 1
    for d in \${CLUSTER_OVERLAY:-}; do
        [ -d "\$d.\$0" ] && { mount --bind "\$d.\$0" "\$d" || exit 1; }
    done
    eval "\$1"' "\$host" "\$*"
EOF
    chmod +x "$STATE/ssh"

    # Every host must reach the head over its link: a TCP connection to a closed
    # port there must be refused (a reply came back), not time out.
    local out
    for i in $(seq 1 "$n"); do
        out=$(ip netns exec "$PREFIX-h$i" timeout 3 bash -c "exec 3<>/dev/tcp/$HEAD/9" 2>&1 || true)
        case $out in *refused*) ;; *) fail "h$i cannot reach the head: $out" ;; esac
    done
    echo "$STATE/hostfile"
}

run() {
    local opts=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
    [ "${1:-}" = "--" ] || fail "run: put -- before the command"
    shift
    local n; n=$(hosts)
    local limit=${CLUSTER_TIMEOUT:-600} rc=0
    # (Read whole: `grep -q` would close the pipe early, and with pipefail the
    # launcher's SIGPIPE would count as no match.)
    local version; version=$("$MPIRUN" --version 2>&1 || true)
    if grep -qE "Open MPI|OpenRTE" <<<"$version"; then
        # Open MPI: its rsh launcher with our ssh stand-in; TCP on the veth subnet
        # only, for the data (btl) and for the runtime (oob).
        timeout -k 10 "$limit" ip netns exec "$SWITCH" "$MPIRUN" --allow-run-as-root \
            --hostfile "$STATE/hostfile" -np "$n" --map-by node \
            --mca plm_rsh_agent "$STATE/ssh" \
            --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 1 \
            --mca oob_tcp_keepalive_probes 3 \
            --mca btl tcp,self --mca pml ob1 \
            --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24" \
            "${opts[@]}" "$@" || rc=$?
    else
        # MPICH / Intel MPI (Hydra): the reference setup's `-f hosts -n N -ppn 1`.
        # UCX would see one kernel and use shared memory: force TCP on eth0.
        UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 FI_PROVIDER=tcp \
            timeout -k 10 "$limit" ip netns exec "$SWITCH" "$MPIRUN" \
            -f "$STATE/hostfile" -n "$n" -ppn 1 \
            -launcher ssh -launcher-exec "$STATE/ssh" -localhost "$HEAD" \
            "${opts[@]}" "$@" || rc=$?
    fi
    # CLUSTER_LINGER=S: give what is left up to S seconds to end by itself first.
    local linger=${CLUSTER_LINGER:-0}
    while [ "$linger" -gt 0 ] && [ -n "$(leftovers)" ]; do sleep 1; linger=$((linger - 1)); done
    leftovers > "$STATE/leftover"
    reap
    return $rc
}

# What a finished job left running on the hosts (one "HOST COMMAND" a line).
leftovers() {
    local ns p
    for ns in $(our_namespaces); do
        for p in $(ip netns pids "$ns" 2>/dev/null); do
            echo "${ns#"$PREFIX-"} $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | command cut -c1-120)"
        done
    done
    return 0
}

# Kills whatever a job left inside the host namespaces.
reap() {
    local ns p
    for ns in $(our_namespaces); do
        for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    done
}

bytes() {
    local n i; n=$(hosts)
    for i in $(seq 1 "$n"); do
        # `ip netns exec` mounts a /sys of the namespace: its own eth0.
        ip netns exec "$PREFIX-h$i" sh -c \
            "echo h$i \$(cat /sys/class/net/eth0/statistics/tx_bytes) \$(cat /sys/class/net/eth0/statistics/rx_bytes)"
    done
}

pid() {
    local host=${1:?pid HOST PATTERN} pattern=${2:?pid HOST PATTERN} p
    for p in $(ip netns pids "$PREFIX-$host" 2>/dev/null); do
        tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q -- "$pattern" && echo "$p"
    done
    return 0
}

cut() {
    local host=${1:?cut HOST}
    ip -n "$PREFIX-$host" link set eth0 down
}

mend() {
    local host=${1:?mend HOST}
    ip -n "$PREFIX-$host" link set eth0 up
}

down() {
    local ns
    reap
    for ns in $(our_namespaces); do
        ip netns del "$ns"      # takes its veth ends (and the bridge) with it
        rm -rf "/etc/netns/$ns"
    done
    rm -rf "$STATE"
}

case "${1:-}" in
    up | run | bytes | pid | cut | mend | down) cmd=$1; shift; "$cmd" "$@" ;;
    *) sed -n '2,11p' "$0"; exit 2 ;;
esac
