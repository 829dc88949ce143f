# Shared by tests/cluster/slurm.sh and tests/cluster/multinode.sh (sourced): the pid-file test and the slurm.conf
# settings both clusters use, the wait for idle nodes. Needs DIR (state directory), MUNGE_SOCKET, CONF (slurm.conf)
# and NAME set, and say/die defined, by the caller.

alive() {  # alive PIDFILE EXE-NAME: the pid file names a live process running EXE-NAME
    local pid
    [ -f "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ]
}

slurm_conf_common() {  # the daemons, state, plugins and scheduling every test cluster shares (prints them)
    cat <<CONF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Own munged socket; short credential life so that a requeued job is held only cred_expire+1 s.
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=30
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/slurmd-%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups here (containers, no systemd).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: no accounting (sacct fails), completed jobs stay visible to scontrol for MinJobAge.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MinJobAge=3600
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Heterogeneous jobs are started by the backfill pass only: run it every second, not every 30 s.
SchedulerParameters=bf_interval=1
GresTypes=gpu
JobRequeue=1
MpiDefault=pmix
MailProg=/bin/true
ReturnToService=2
KillWait=10
# The nodes declare more CPUs, memory and GPUs than exist.
SlurmdParameters=config_overrides
CONF
}

node_states() {
    SLURM_CONF="$CONF" timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u
}

wait_idle() {  # wait_idle COUNT: until COUNT nodes are idle (or mix/alloc: jobs of an earlier start still running)
    local states
    for _ in $(seq 300); do
        states=$(node_states || true)
        if [ "$(grep -cE ' (idle|mix|alloc)$' <<<"$states")" -ge "$1" ]; then
            say "cluster $NAME up: $(tr '\n' ' ' <<<"$states")(SLURM_CONF=$CONF)"
            return
        fi
        sleep 0.1
    done
    die "node(s) not idle after 30 s: ${states:-no answer}; see $DIR/log/slurmctld.log"
}
