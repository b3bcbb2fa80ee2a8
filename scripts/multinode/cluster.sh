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
#   cluster.sh exec HOST -- CMD...  runs CMD inside HOST (its network, its host name)
#   cluster.sh overlay "DIR ..."    from now on host hI sees DIR.hI (where it exists) as DIR
#   cluster.sh bridge | unbridge    adds (removes) a docker0-style bridge, 172.17.0.1/16 with
#                                   a carrier, on every host
#   cluster.sh sshd                 real OpenSSH on every host (keys made here); prints the
#                                   ssh command (a wrapper: `ssh -F <our config>`) to use
#   cluster.sh forget HOST | learn  drops HOST's key from our known_hosts (restores all)
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
# killed). `overlay "DIR ..."` gives hosts their own disks: processes started on host hI
# (through the ssh stand-in or sshd) see DIR.hI, where it exists, in place of DIR.
# `sshd` adds real OpenSSH servers (Debian's openssh-server), one per host on its eth0
# with a host key each; its client is told StrictHostKeyChecking=yes and BatchMode=yes,
# and `forget` makes one host's key unknown. CLUSTER_FROM=h1 makes `run` start mpirun on
# h1 (as a user logged into the first host does) instead of the head.
# Open MPI's runtime is told to notice a lost host in seconds (TCP keepalive on its
# out-of-band channel); without it mpirun hangs after an abort when a link is cut.
# Env: CLUSTER_PREFIX (ngpt), CLUSTER_SUBNET (10.78.0), CLUSTER_STATE
# (/run/$CLUSTER_PREFIX-cluster), MPIRUN (mpirun), CLUSTER_TIMEOUT (job limit for
# `run`, seconds, default 600), CLUSTER_LINGER (seconds `run` waits for what a job
# left on the hosts to end by itself before listing it, default 0), CLUSTER_FROM
# (head, or a host: where `run` starts mpirun).
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
# Own disks, where asked: each folder D of $STATE/overlay for which D.HOST exists
# is replaced by it for this host's processes (a private mount namespace).
exec ip netns exec "$PREFIX-\$host" unshare --uts --mount sh -c '
    hostname "\$0" || exit 1
    for d in \$(cat "$STATE/overlay" 2>/dev/null); do
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
    # Where mpirun runs: the head (the switch namespace), or a host.
    local where=(ip netns exec "$SWITCH") localhost=(-localhost "$HEAD")
    case ${CLUSTER_FROM:-head} in
        head) ;;
        h[0-9]*) where=("$0" exec "$CLUSTER_FROM" --) localhost=() ;;
        *) fail "CLUSTER_FROM must be head or a host (h1...)" ;;
    esac
    # (Read whole: `grep -q` would close the pipe early, and with pipefail the
    # launcher's SIGPIPE would count as no match.)
    local version; version=$("$MPIRUN" --version 2>&1 || true)
    if grep -qE "Open MPI|OpenRTE" <<<"$version"; then
        # Open MPI: its rsh launcher with our ssh stand-in; TCP on the veth subnet
        # only, for the data (btl) and for the runtime (oob).
        timeout -k 10 "$limit" "${where[@]}" "$MPIRUN" --allow-run-as-root \
            --hostfile "$STATE/hostfile" -np "$n" --map-by node \
            --mca plm_rsh_agent "$STATE/ssh" \
            --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 1 \
            --mca oob_tcp_keepalive_probes 3 \
            --mca btl tcp,self --mca pml ob1 \
            --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24" \
            "${opts[@]}" "$@" || rc=$?
    else
        # MPICH / Intel MPI (Hydra): the reference setup's `-f hosts -n N -ppn 1`, with
        # `-disable-auto-cleanup` as `nanogpt launch` writes it (rank 0 ends a job with a
        # lost rank itself, after naming it). UCX would see one kernel and use shared
        # memory: force TCP on eth0.
        UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 FI_PROVIDER=tcp \
            timeout -k 10 "$limit" "${where[@]}" "$MPIRUN" \
            -f "$STATE/hostfile" -n "$n" -ppn 1 -disable-auto-cleanup \
            -launcher ssh -launcher-exec "$STATE/ssh" "${localhost[@]}" \
            "${opts[@]}" "$@" || rc=$?
    fi
    # CLUSTER_LINGER=S: give what is left up to S seconds to end by itself first.
    local linger=${CLUSTER_LINGER:-0}
    while [ "$linger" -gt 0 ] && [ -n "$(leftovers)" ]; do sleep 1; linger=$((linger - 1)); done
    leftovers > "$STATE/leftover"
    reap
    return $rc
}

# The processes that belong to the cluster itself (the sshd servers), never reaped.
ours() { cat "$STATE"/sshd/*.pid 2>/dev/null | tr '\n' ' ' || true; }

# What a finished job left running on the hosts (one "HOST COMMAND" a line).
leftovers() {
    local ns p keep; keep=" $(ours) "
    for ns in $(our_namespaces); do
        for p in $(ip netns pids "$ns" 2>/dev/null); do
            [[ $keep == *" $p "* ]] && continue
            # an sshd serving a session still closing is the server's, not the job's
            [ "$(cat "/proc/$p/comm" 2>/dev/null)" = sshd ] && continue
            echo "${ns#"$PREFIX-"} $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | command cut -c1-120)"
        done
    done
    return 0
}

# Kills whatever a job left inside the host namespaces (the sshd servers stay).
reap() {
    local ns p keep; keep=" $(ours) "
    for ns in $(our_namespaces); do
        for p in $(ip netns pids "$ns" 2>/dev/null); do
            [[ $keep == *" $p "* ]] && continue
            kill -9 "$p" 2>/dev/null || true
        done
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

exec_in() {
    local host=${1:?exec HOST -- CMD...}; shift
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || fail "exec: no command"
    [ -n "$(ip netns list | awk -v ns="$PREFIX-$host" '$1 == ns')" ] || fail "no host $host"
    exec ip netns exec "$PREFIX-$host" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

overlay() {
    hosts >/dev/null
    echo "${1:-}" > "$STATE/overlay"
}

# A docker0 as Docker leaves it on every host: a bridge with the same address
# everywhere, and a carrier (a veth pair with one end in it, as a container's).
bridge() {
    local n i ns; n=$(hosts)
    for i in $(seq 1 "$n"); do
        ns=$PREFIX-h$i
        ip -n "$ns" link add docker0 type bridge
        ip -n "$ns" addr add 172.17.0.1/16 dev docker0
        ip -n "$ns" link add dk0 type veth peer name dk1
        ip -n "$ns" link set dk0 master docker0
        ip -n "$ns" link set dk0 up
        ip -n "$ns" link set dk1 up
        ip -n "$ns" link set docker0 up
    done
}

unbridge() {
    local n i; n=$(hosts)
    for i in $(seq 1 "$n"); do
        ip -n "$PREFIX-h$i" link del dk0 2>/dev/null || true
        ip -n "$PREFIX-h$i" link del docker0 2>/dev/null || true
    done
}

# Real OpenSSH: an sshd per host on its eth0 (host key made here), a client key in
# authorized_keys, and $STATE/sshd/ssh, the client told our known_hosts,
# StrictHostKeyChecking=yes and BatchMode=yes. Sessions run through `session`, which
# mounts the host's own disks (overlay) first.
start_sshd() {
    local n i d=$STATE/sshd; n=$(hosts)
    [ -x /usr/sbin/sshd ] || fail "sshd: openssh-server is not installed"
    [ -e "$d" ] && fail "sshd: already started"
    mkdir -p "$d"
    # sshd's privilege separation directory (Debian's package makes it at boot).
    [ -d /run/sshd ] || { mkdir -p /run/sshd; chmod 755 /run/sshd; touch "$STATE/made-run-sshd"; }
    ssh-keygen -q -t ed25519 -N '' -C "nanogpt-cluster" -f "$d/id_ed25519"
    cp "$d/id_ed25519.pub" "$d/authorized_keys"
    {
        echo '#!/bin/sh'
        echo "# sshd's ForceCommand: the client's command, with this host's own disks mounted."
        echo "exec unshare --mount sh -c '"
        echo "    for d in \$(cat \"$STATE/overlay\" 2>/dev/null); do"
        echo "        [ -d \"\$d.\$0\" ] && { mount --bind \"\$d.\$0\" \"\$d\" || exit 1; }"
        echo "    done"
        echo "    exec sh -c \"\$1\"' \"\$(hostname)\" \"\$SSH_ORIGINAL_COMMAND\""
    } > "$d/session"
    chmod +x "$d/session"
    : > "$d/known_hosts.all"
    for i in $(seq 1 "$n"); do
        ssh-keygen -q -t ed25519 -N '' -C "h$i" -f "$d/host_h$i"
        printf '%s\n' "ListenAddress $SUBNET.$i:22" "HostKey $d/host_h$i" "PidFile $d/h$i.pid" \
            "AuthorizedKeysFile $d/authorized_keys" "PermitRootLogin prohibit-password" \
            "PubkeyAuthentication yes" "PasswordAuthentication no" \
            "KbdInteractiveAuthentication no" "UsePAM no" "StrictModes no" "PrintMotd no" \
            "ForceCommand $d/session" "LogLevel ERROR" > "$d/sshd_h$i.conf"
        echo "h$i,$SUBNET.$i $(command cut -d' ' -f1,2 "$d/host_h$i.pub")" >> "$d/known_hosts.all"
        ip netns exec "$PREFIX-h$i" unshare --uts sh -c \
            'hostname "$0" && exec /usr/sbin/sshd -f "$1" -E "$2"' \
            "h$i" "$d/sshd_h$i.conf" "$d/sshd_h$i.log" ||
            fail "sshd on h$i did not start: $(cat "$d/sshd_h$i.log")"
    done
    cp "$d/known_hosts.all" "$d/known_hosts"
    printf '%s\n' "Host *" "    User root" "    IdentityFile $d/id_ed25519" \
        "    IdentitiesOnly yes" "    UserKnownHostsFile $d/known_hosts" \
        "    GlobalKnownHostsFile /dev/null" "    StrictHostKeyChecking yes" \
        "    BatchMode yes" "    ConnectTimeout 10" "    LogLevel ERROR" > "$d/config"
    printf '#!/bin/sh\nexec ssh -F %s "$@"\n' "$d/config" > "$d/ssh"
    chmod +x "$d/ssh"
    # sshd daemonizes once listening: wait for each pid file, then one login each.
    local t
    for i in $(seq 1 "$n"); do
        t=0
        until [ -s "$d/h$i.pid" ]; do sleep 0.1; t=$((t + 1)); [ $t -lt 50 ] || fail "sshd h$i: no pid"; done
        ip netns exec "$SWITCH" "$d/ssh" "h$i" true ||
            fail "ssh h$i true failed: $(cat "$d/sshd_h$i.log")"
    done
    echo "$d/ssh"
}

forget() {
    local host=${1:?forget HOST} d=$STATE/sshd
    grep -v "^$host," "$d/known_hosts.all" > "$d/known_hosts"
}

learn() {
    cp "$STATE/sshd/known_hosts.all" "$STATE/sshd/known_hosts"
}

down() {
    local ns p
    for p in $(ours); do kill "$p" 2>/dev/null || true; done
    reap
    for ns in $(our_namespaces); do
        for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
        ip netns del "$ns"      # takes its veth ends (and the bridges) with it
        rm -rf "/etc/netns/$ns"
    done
    if [ -e "$STATE/made-run-sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
    rm -rf "$STATE"
}

case "${1:-}" in
    up | run | bytes | pid | cut | mend | overlay | bridge | unbridge | forget | learn | down)
        cmd=$1; shift; "$cmd" "$@" ;;
    sshd) shift; start_sshd "$@" ;;
    exec) shift; exec_in "$@" ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
esac
