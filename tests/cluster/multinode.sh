#!/usr/bin/env bash
# A real multi-node Slurm cluster on one machine: every node is a network + UTS + mount namespace with its own host
# name, address (a veth on a private bridge), /tmp, /etc/hosts and slurmd; slurmctld and munged run beside them in
# the root namespaces. Nothing leaves the machine: the addresses exist only on the bridge this script creates.
#
#   tests/cluster/multinode.sh start        # idempotent; waits until every node is idle
#   tests/cluster/multinode.sh stop         # daemons by PID, every process left in a node, namespaces, veths, bridge
#   tests/cluster/multinode.sh status       # exit 0 when every daemon runs and slurmctld answers
#   tests/cluster/multinode.sh env          # prints `export SLURM_CONF=...` for eval
#   tests/cluster/multinode.sh kill-node N  # node N dies: its slurmd and every process in its namespace, SIGKILL
#   tests/cluster/multinode.sh cut-node N   # node N's link goes down (a partition: its processes live on)
#   tests/cluster/multinode.sh revive-node N  # a fresh boot: its processes gone, link up, a new slurmd
#   tests/cluster/multinode.sh exec N CMD...  # run CMD inside node N (its namespaces)
#
# Shape (environment; defaults in brackets):
#   MILEHPC_MN_DIR      state directory, outside /tmp (each node mounts its own /tmp) [/var/tmp/milehpc-multinode]
#   MILEHPC_MN_NODES    number of nodes [4]          MILEHPC_MN_PREFIX  host names PREFIX1..N [mn]
#   MILEHPC_MN_SUBNET   first three octets of the bridge's /24 [10.231.7]; slurmctld .1, node i .(10+i)
#   MILEHPC_MN_PORT     slurmctld port; every slurmd uses +1 in its own namespace [6837]
#   MILEHPC_MN_IFNAME   the node's interface name, as a site's high-speed network (Slingshot's hsn0) [hsn0]
#   MILEHPC_MN_GPUS     fake GPUs per node [4]
# The single-node cluster (slurm.sh: /tmp/milehpc-cluster, port 6817) can run beside this one.
# Facts this relies on: tests/cluster/README.md ("The multi-node cluster").
set -euo pipefail

DIR=${MILEHPC_MN_DIR:-/var/tmp/milehpc-multinode}
NODES=${MILEHPC_MN_NODES:-4}
PREFIX=${MILEHPC_MN_PREFIX:-mn}
SUBNET=${MILEHPC_MN_SUBNET:-10.231.7}
PORT=${MILEHPC_MN_PORT:-6837}
IFNAME=${MILEHPC_MN_IFNAME:-hsn0}
GPUS=${MILEHPC_MN_GPUS:-4}
NAME="milehpc-$PREFIX"
BRIDGE="mhbr-$PREFIX"  # one bridge per cluster (interface names: 15 characters at most)
CONF="$DIR/etc/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket.2"
CTLD_HOST=$(hostname -s)

say() { echo "multinode.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "MILEHPC_MN_NODES must be 1-99, got '$NODES'"
[[ "$PREFIX" =~ ^[a-z][a-z0-9-]{0,7}$ ]] || die "MILEHPC_MN_PREFIX must be a short lower-case name, got '$PREFIX'"
case "$DIR" in /tmp | /tmp/*) die "MILEHPC_MN_DIR must be outside /tmp: every node mounts its own /tmp, got '$DIR'" ;; esac
[[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "MILEHPC_MN_SUBNET must be three octets, got '$SUBNET'"

host() { echo "$PREFIX$1"; }            # host name of node i
netns() { echo "milehpc-$PREFIX$1"; }   # its network namespace
veth() { echo "mhv-$PREFIX$1"; }        # the bridge end of its link
addr() { echo "$SUBNET.$((10 + $1))"; }

# shellcheck source=tests/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

write_config() {
    local cpus=64 i nodes gres=""
    nodes="$(host 1)"
    for ((i = 2; i <= NODES; i++)); do nodes+=",$(host "$i")"; done
    [ "$GPUS" -gt 0 ] && gres="Gres=gpu:$GPUS"
    {
        cat <<EOF
# Written by tests/cluster/multinode.sh -- $NODES namespaced nodes on bridge $BRIDGE ($SUBNET.0/24), state in $DIR
ClusterName=$NAME
SlurmctldHost=$CTLD_HOST($SUBNET.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
EOF
        slurm_conf_common
        cat <<EOF
# A dead node's slurmd is noticed within SlurmdTimeout (default 300 s; short here, but longer than milehpc's own reaction); a node that registers again is idle.
SlurmdTimeout=60
# How long srun and the daemons wait for an answer (default 10 s): the probe of a dead node waits this long.
MessageTimeout=5
NodeName=DEFAULT Sockets=2 CoresPerSocket=32 ThreadsPerCore=1 CPUs=$cpus RealMemory=1000000 $gres Features=gpu,nvme State=UNKNOWN
EOF
    } >"$1/slurm.conf"
    for ((i = 1; i <= NODES; i++)); do
        echo "NodeName=$(host "$i") NodeAddr=$(addr "$i")" >>"$1/slurm.conf"
    done
    echo "PartitionName=batch Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$1/slurm.conf"
    {
        echo "AutoDetect=off"
        [ "$GPUS" -gt 0 ] && echo "Name=gpu File=$DIR/dev/nvidia[0-$((GPUS - 1))]"
    } >"$1/gres.conf"
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 $CTLD_HOST"
        for ((i = 1; i <= NODES; i++)); do echo "$(addr "$i") $(host "$i")"; done
    } >"$1/hosts"
}

net_up() {
    ip link show "$BRIDGE" >/dev/null 2>&1 || {
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    }
    ip link set "$BRIDGE" up
    local i ns
    for ((i = 1; i <= NODES; i++)); do
        ns=$(netns "$i")
        [ -e "/var/run/netns/$ns" ] || ip netns add "$ns"
        if ! ip link show "$(veth "$i")" >/dev/null 2>&1; then
            ip link add "$(veth "$i")" type veth peer name "$IFNAME" netns "$ns"
            ip link set "$(veth "$i")" master "$BRIDGE"
            ip -n "$ns" addr add "$(addr "$i")/24" dev "$IFNAME"
        fi
        ip link set "$(veth "$i")" up
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$IFNAME" up
    done
}

start_slurmd() {  # start_slurmd I: slurmd inside node I's namespaces, with the node's own host name, /tmp, hosts
    local i=$1 h pidfile
    h=$(host "$i")
    pidfile="$DIR/run/slurmd-$h.pid"
    alive "$pidfile" slurmd && return
    mkdir -p "$DIR/state/slurmd-$h" "$DIR/nodes/$h/tmp"
    chmod 1777 "$DIR/nodes/$h/tmp"
    # The mount namespace gives the node its own /tmp (Slurm's PMIx directories are named by job and step only,
    # so nodes sharing one /tmp collide) and /etc/hosts (every node resolves every other by name).
    nsenter --net="/var/run/netns/$(netns "$i")" unshare --uts --mount --propagation private -- bash -c '
        hostname "$1" && mount --bind "$2/etc/hosts" /etc/hosts && mount --bind "$2/nodes/$1/tmp" /tmp &&
        SLURM_CONF="$3" exec slurmd -f "$3" -N "$1"' slurmd-node "$h" "$DIR" "$CONF"
    for _ in $(seq 100); do alive "$pidfile" slurmd && return; sleep 0.1; done
    die "slurmd of $h did not start; see $DIR/log/slurmd-$h.log"
}


cmd_start() {
    [ "$(id -u)" -eq 0 ] || die "the multi-node cluster makes namespaces and runs its daemons as root; run as root"
    command -v slurmd >/dev/null || die "Slurm is not installed; tests/cluster/slurm.sh start installs it"
    ip netns list >/dev/null 2>&1 || die "this machine cannot make network namespaces (ip netns list failed)"
    mkdir -p "$DIR"/{etc,run,log,state/ctld,dev,nodes}
    local tmp i
    tmp=$(mktemp -d "$DIR/etc/new.XXXXXX")
    write_config "$tmp"
    if [ -f "$CONF" ] && ! cmp -s "$tmp/slurm.conf" "$CONF"; then
        say "configuration changed; stopping the old cluster first"
        cmd_stop
        mkdir -p "$DIR"/{etc,run,log,state/ctld,dev,nodes}
    fi
    mv "$tmp"/* "$DIR/etc/" && rmdir "$tmp"
    for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$DIR/dev/nvidia$i"; done
    net_up
    if ! alive "$DIR/run/munged.pid" munged; then
        mkdir -p "$DIR/munge" && chmod 700 "$DIR/munge"
        [ -s "$DIR/munge/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$DIR/munge/munge.key"; }
        munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
            --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" --force
        for _ in $(seq 50); do [ -S "$MUNGE_SOCKET" ] && break; sleep 0.1; done
    fi
    if ! alive "$DIR/run/slurmctld.pid" slurmctld; then
        SLURM_CONF="$CONF" slurmctld -f "$CONF"
        for _ in $(seq 100); do alive "$DIR/run/slurmctld.pid" slurmctld && break; sleep 0.1; done
        alive "$DIR/run/slurmctld.pid" slurmctld || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    fi
    for ((i = 1; i <= NODES; i++)); do start_slurmd "$i"; done
    wait_idle "$NODES"
}

stop_pid() {  # stop_pid PIDFILE EXE-NAME
    local pid
    alive "$1" "$2" || { rm -f "$1"; return 0; }
    pid=$(cat "$1" 2>/dev/null) || return 0  # the daemon removes its pid file as it exits
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

kill_namespace() {  # kill_namespace I: SIGKILL every process whose network namespace is node I's
    local ns pids
    ns=$(netns "$1")
    [ -e "/var/run/netns/$ns" ] || return 0
    for _ in 1 2 3 4 5; do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -z "$pids" ] && return 0
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
        sleep 0.2
    done
}

cmd_stop() {
    local i f
    # TERM every daemon first: each takes a second or two to exit, together rather than one after another.
    for f in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"; do
        alive "$f" "$(basename "$f" .pid | cut -d- -f1)" && kill "$(cat "$f")" 2>/dev/null
    done
    for ((i = 1; i <= NODES; i++)); do
        stop_pid "$DIR/run/slurmd-$(host "$i").pid" slurmd
        kill_namespace "$i"
        ip link del "$(veth "$i")" 2>/dev/null || true
        [ -e "/var/run/netns/$(netns "$i")" ] && ip netns del "$(netns "$i")"
    done
    stop_pid "$DIR/run/slurmctld.pid" slurmctld
    stop_pid "$DIR/run/munged.pid" munged
    ip link del "$BRIDGE" 2>/dev/null || true
    # Slurm state of ended jobs goes too: a fresh start must not resurrect them.
    rm -rf "$DIR/state" "$DIR/nodes"
    say "cluster $NAME stopped"
}

cmd_status() {
    local ok=0 i
    alive "$DIR/run/munged.pid" munged || { say "munged: not running"; ok=1; }
    alive "$DIR/run/slurmctld.pid" slurmctld || { say "slurmctld: not running"; ok=1; }
    for ((i = 1; i <= NODES; i++)); do
        alive "$DIR/run/slurmd-$(host "$i").pid" slurmd || { say "slurmd of $(host "$i"): not running"; ok=1; }
    done
    [ $ok -eq 0 ] || return 1
    local states
    states=$(node_states) || { say "slurmctld does not answer"; return 1; }
    say "nodes: $(tr '\n' ' ' <<<"$states")"
    echo "export SLURM_CONF=$CONF"
}

node_arg() {
    [[ "${1:-}" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le "$NODES" ] || die "expected a node number 1-$NODES, got '${1:-}'"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    kill-node) node_arg "${2:-}"; kill_namespace "$2"; rm -f "$DIR/run/slurmd-$(host "$2").pid"; say "node $(host "$2") killed" ;;
    cut-node) node_arg "${2:-}"; ip link set "$(veth "$2")" down; say "node $(host "$2") cut off" ;;
    # A repaired node boots afresh: whatever a cut left running there goes, and a new slurmd registers (a DOWN node
    # returns to service on registration, ReturnToService=2).
    revive-node) node_arg "${2:-}"; kill_namespace "$2"; rm -f "$DIR/run/slurmd-$(host "$2").pid"
        ip link set "$(veth "$2")" up; start_slurmd "$2"; say "node $(host "$2") back" ;;
    exec) node_arg "${2:-}"; i=$2; shift 2
        exec nsenter --net="/var/run/netns/$(netns "$i")" unshare --uts --mount --propagation private -- bash -c \
            'hostname "$1"; mount --bind "$2/etc/hosts" /etc/hosts; mount --bind "$2/nodes/$1/tmp" /tmp; shift 2; exec "$@"' \
            node-exec "$(host "$i")" "$DIR" "$@" ;;
    *) echo "usage: $0 start | stop | status | env | kill-node N | cut-node N | revive-node N | exec N CMD..." >&2; exit 2 ;;
esac
