# Shared by tests/cluster/slurm.sh and tests/cluster/multinode.sh (sourced): the pid-file test and the slurm.conf
# settings both clusters use. Needs DIR (state directory) and MUNGE_SOCKET set by the caller.

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
