#!/usr/bin/env bash
# A real single-host Slurm cluster for milehpc's tests: munged + slurmctld + slurmd (+ a second slurmd on request),
# all state under one directory, started as root in the background and stopped by PID.
#
#   tests/cluster/slurm.sh start [--second-node]   # idempotent; waits until the node(s) are idle
#   tests/cluster/slurm.sh stop                    # stops exactly the daemons this directory's pid files name
#   tests/cluster/slurm.sh status                  # exit 0 when the cluster answers, 1 otherwise
#   tests/cluster/slurm.sh env                     # prints `export SLURM_CONF=...` for eval
#
# Shape (environment; defaults in brackets) -- the site tests start one cluster per shipped site with its shape:
#   MILEHPC_CLUSTER_DIR         state directory [/tmp/milehpc-cluster]
#   MILEHPC_CLUSTER_NAME        ClusterName [milehpc-test]
#   MILEHPC_CLUSTER_PORT        slurmctld port; slurmd gets +1, the second slurmd +2 [6817]
#   MILEHPC_CLUSTER_PARTITIONS  partition names, the first is the default ["debug"]
#   MILEHPC_CLUSTER_SOCKETS / _CORES / _THREADS   sockets, cores per socket, threads per core [2/32/1]
#   MILEHPC_CLUSTER_GPUS        fake GPUs per node (symlinks to /dev/null) [8]
#   MILEHPC_CLUSTER_FEATURES    node features, comma-separated [gpu,nvme]
#   MILEHPC_CLUSTER_CORE_SPEC   cores per node reserved for the system (CoreSpecCount, Frontier's -S 8) [0]
#   MILEHPC_CLUSTER_ETC_LINK    1: link /etc/slurm/slurm.conf to this cluster's config when that path is free [1]
#
# The node declares more CPUs, memory and GPUs than the machine has (SlurmdParameters=config_overrides); no
# cgroups, no accounting database (sacct fails here, as on some real sites). Facts this relies on: Slurm 22.05,
# see tests/cluster/README.md.
set -euo pipefail

DIR=${MILEHPC_CLUSTER_DIR:-/tmp/milehpc-cluster}
NAME=${MILEHPC_CLUSTER_NAME:-milehpc-test}
PORT=${MILEHPC_CLUSTER_PORT:-6817}
PARTITIONS=${MILEHPC_CLUSTER_PARTITIONS:-debug}
SOCKETS=${MILEHPC_CLUSTER_SOCKETS:-2}
CORES=${MILEHPC_CLUSTER_CORES:-32}
THREADS=${MILEHPC_CLUSTER_THREADS:-1}
GPUS=${MILEHPC_CLUSTER_GPUS:-8}
FEATURES=${MILEHPC_CLUSTER_FEATURES:-gpu,nvme}
CORE_SPEC=${MILEHPC_CLUSTER_CORE_SPEC:-0}
ETC_LINK=${MILEHPC_CLUSTER_ETC_LINK:-1}
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge libpmix-dev openmpi-bin)

NODE=$(hostname -s)
NODE2="${NODE}-2"
CONF="$DIR/etc/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket.2"

say() { echo "slurm.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

# shellcheck source=tests/cluster/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "missing packages ${missing[*]} and not root to install them"
    say "installing ${missing[*]}"
    # apt never starts these daemons itself on a machine without systemd; this script starts them.
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}

want_second() { [ -f "$DIR/etc/second-node" ]; }

write_config() {  # writes slurm.conf + gres.conf into a temp dir, prints its path
    local tmp=$1 cpus=$((SOCKETS * CORES * THREADS)) nodes="$NODE" p first=1 gres="" gpu_files="" spec=""
    if [ "$CORE_SPEC" -gt 0 ]; then spec="CoreSpecCount=$CORE_SPEC"; fi
    if [ "$GPUS" -gt 0 ]; then
        gres="Gres=gpu:$GPUS"
        gpu_files="$DIR/dev/nvidia[0-$((GPUS - 1))]"
    fi
    if want_second; then nodes="$NODE,$NODE2"; fi
    {
        cat <<EOF
# Written by tests/cluster/slurm.sh -- single-host test cluster, state in $DIR
ClusterName=$NAME
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
EOF
        slurm_conf_common
        cat <<EOF
# Jobs may change the core specialisation (Frontier users pass -S 0 or -S 8).
AllowSpecResourcesUsage=YES
PlugStackConfig=$DIR/etc/plugstack.conf
NodeName=$NODE NodeAddr=127.0.0.1 Sockets=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS CPUs=$cpus RealMemory=1000000 ${gres} ${spec} Features=$FEATURES State=UNKNOWN
EOF
    } >"$tmp/slurm.conf"
    if want_second; then
        echo "NodeName=$NODE2 NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$((PORT + 2)) Sockets=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS CPUs=$cpus RealMemory=1000000 ${gres} ${spec} Features=$FEATURES State=UNKNOWN" >>"$tmp/slurm.conf"
    fi
    for p in ${PARTITIONS//,/ }; do
        echo "PartitionName=$p Nodes=$nodes Default=$([ $first -eq 1 ] && echo YES || echo NO) MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$tmp/slurm.conf"
        first=0
    done
    : >"$tmp/plugstack.conf"
    {
        echo "AutoDetect=off"
        if [ "$GPUS" -gt 0 ]; then
            echo "NodeName=$NODE Name=gpu File=$gpu_files"
            if want_second; then echo "NodeName=$NODE2 Name=gpu File=$gpu_files"; fi
        fi
    } >"$tmp/gres.conf"
}

start_munge() {
    if alive "$DIR/run/munged.pid" munged; then
        say "munged already running (pid $(cat "$DIR/run/munged.pid"))"
        return
    fi
    mkdir -p "$DIR/munge" && chmod 700 "$DIR/munge"
    if [ ! -s "$DIR/munge/munge.key" ]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$DIR/munge/munge.key"
    fi
    say "starting munged (socket $MUNGE_SOCKET)"
    munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" --force
    for _ in $(seq 50); do [ -S "$MUNGE_SOCKET" ] && return; sleep 0.1; done
    die "munged did not create its socket; see $DIR/log/munged.log"
}

start_daemon() {  # start_daemon NAME PIDFILE ARGV...
    local name=$1 pidfile=$2
    shift 2
    if alive "$pidfile" "$name"; then
        say "$name already running (pid $(cat "$pidfile"))"
        return
    fi
    say "starting $*"
    SLURM_CONF="$CONF" "$@"
    for _ in $(seq 100); do alive "$pidfile" "$name" && return; sleep 0.1; done
    die "$name did not start; see the logs in $DIR/log"
}


cmd_start() {
    [ "$(id -u)" -eq 0 ] || die "the test cluster runs its daemons as root; run as root"
    install_packages
    mkdir -p "$DIR"/{etc,run,log,state/ctld,dev}
    local second=0
    [ "${1:-}" = "--second-node" ] && second=1
    if [ $second -eq 1 ]; then touch "$DIR/etc/second-node"; else rm -f "$DIR/etc/second-node"; fi
    local tmp
    tmp=$(mktemp -d "$DIR/etc/new.XXXXXX")
    write_config "$tmp"
    if [ -f "$CONF" ] && ! cmp -s "$tmp/slurm.conf" "$CONF"; then
        if alive "$DIR/run/slurmctld.pid" slurmctld; then
            say "configuration changed; restarting the Slurm daemons"
            stop_slurm
        fi
    fi
    mv "$tmp/slurm.conf" "$CONF"
    mv "$tmp/gres.conf" "$DIR/etc/gres.conf"
    mv "$tmp/plugstack.conf" "$DIR/etc/plugstack.conf"
    rmdir "$tmp"
    local i
    for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$DIR/dev/nvidia$i"; done
    start_munge
    start_daemon slurmctld "$DIR/run/slurmctld.pid" slurmctld -f "$CONF"
    mkdir -p "$DIR/state/slurmd-$NODE"
    start_daemon slurmd "$DIR/run/slurmd-$NODE.pid" slurmd -f "$CONF" -N "$NODE"
    if [ $second -eq 1 ]; then
        mkdir -p "$DIR/state/slurmd-$NODE2"
        start_daemon slurmd "$DIR/run/slurmd-$NODE2.pid" slurmd -f "$CONF" -N "$NODE2"
    fi
    if [ "$ETC_LINK" = 1 ] && [ ! -e /etc/slurm/slurm.conf ] && [ ! -L /etc/slurm/slurm.conf ]; then
        mkdir -p /etc/slurm && ln -s "$CONF" /etc/slurm/slurm.conf
        say "linked /etc/slurm/slurm.conf -> $CONF"
    fi
    if want_second; then wait_idle 2; else wait_idle 1; fi
}

stop_pid() {  # stop_pid PIDFILE EXE-NAME
    local pid
    alive "$1" "$2" || { rm -f "$1"; return 0; }
    pid=$(cat "$1")
    say "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { rm -f "$1"; return 0; }; sleep 0.1; done
    say "$2 (pid $pid) ignored TERM for 10 s; killing it"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

stop_slurm() {
    local f
    for f in "$DIR"/run/slurmd-*.pid; do
        if [ -e "$f" ]; then stop_pid "$f" slurmd; fi
    done
    stop_pid "$DIR/run/slurmctld.pid" slurmctld
}

cmd_stop() {
    stop_slurm
    stop_pid "$DIR/run/munged.pid" munged
    if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF" ]; then
        rm -f /etc/slurm/slurm.conf
        say "removed the /etc/slurm/slurm.conf link"
    fi
    say "cluster $NAME stopped"
}

cmd_status() {
    local ok=0 f
    alive "$DIR/run/munged.pid" munged && say "munged: running (pid $(cat "$DIR/run/munged.pid"))" || { say "munged: not running"; ok=1; }
    alive "$DIR/run/slurmctld.pid" slurmctld && say "slurmctld: running (pid $(cat "$DIR/run/slurmctld.pid"))" || { say "slurmctld: not running"; ok=1; }
    for f in "$DIR"/run/slurmd-*.pid; do
        [ -e "$f" ] || { say "slurmd: not running"; ok=1; continue; }
        alive "$f" slurmd && say "slurmd $(basename "$f" .pid): running (pid $(cat "$f"))" || { say "$(basename "$f" .pid): not running"; ok=1; }
    done
    if [ $ok -eq 0 ]; then
        local states
        states=$(node_states) || { say "slurmctld does not answer"; return 1; }
        say "nodes: $(tr '\n' ' ' <<<"$states")"
        echo "export SLURM_CONF=$CONF"
    fi
    return $ok
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start [--second-node] | stop | status | env" >&2; exit 2 ;;
esac
