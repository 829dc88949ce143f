#!/bin/bash
# milehpc job golden on site perlmutter-like, partition regular
# 4 rank(s) on 1 node(s): trainer ranks 0-1 (tp=1 pp=1 dp=2), 2 rollout engine(s) x 1
# Rendered by milehpc; rerun `milehpc render` rather than editing.
#SBATCH --job-name=golden
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --time=00:30:00
#SBATCH --output=/scratch/milehpc/runs/golden/logs/slurm-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --gpus-per-node=4
#SBATCH --account=abc123
#SBATCH --qos=regular
#SBATCH --constraint=gpu
set -eo pipefail

export MILEHPC_RUN_DIR=/scratch/milehpc/runs/golden
mkdir -p "$MILEHPC_RUN_DIR/logs" "$MILEHPC_RUN_DIR/.milehpc"

# Wall time / preemption: a signal asks the ranks to checkpoint at their next step boundary
# (milehpc.runtime.signals); the ranks then exit with 75.
milehpc_request_checkpoint() {
    echo "milehpc: signal received, asking the ranks to checkpoint" >&2
    : > "$MILEHPC_RUN_DIR/.milehpc/checkpoint-request"
}
trap milehpc_request_checkpoint USR1 TERM
rm -f "$MILEHPC_RUN_DIR/.milehpc/checkpoint-request" "$MILEHPC_RUN_DIR/.milehpc/stop-request"

module load cudatoolkit
module load nccl

# Environment of every rank (site values cite the site's user guide; job [env] last).
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=32
export NCCL_SOCKET_IFNAME=hsn
export NCCL_CROSS_NIC=1
export NCCL_NET_GDR_LEVEL=PHB
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_MR_CACHE_MONITOR=userfaultfd
export MILEHPC_EXAMPLE="${HOME}/data"
if [ "${SLURM_JOB_NUM_NODES:-1}" -eq 1 ]; then
    :
else
    export NCCL_NET='AWS Libfabric'
fi

# Rendezvous for torch.distributed: this shell runs on the first node; the port is seeded by the job id so
# that jobs sharing a node do not collide (rank 0 still checks it is free).
MASTER_ADDR=$(hostname)
export MASTER_ADDR
export MASTER_PORT=$(( 20000 + ${SLURM_JOB_ID:-$$} % 40000 ))
export MILEHPC_RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"


echo "milehpc: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST; master $MASTER_ADDR:$MASTER_PORT" >&2
# ONE MPI world holds the trainer and the rollout ranks; each rank finds its role in plan.json.
# Rank 0 writes this marker when every rank finished; a launcher can exit 0 without starting the ranks
# (e.g. srun after a PMIx failure), and that must not look like success.
rm -f "$MILEHPC_RUN_DIR/.milehpc/step-done"
rm -f "$MILEHPC_RUN_DIR/.milehpc/step-failed" "$MILEHPC_RUN_DIR/.milehpc/step-failed.abandoned"
srun --mpi=cray_shasta --nodes=1 --ntasks=4 --ntasks-per-node=4 --cpus-per-task=32 --cpu-bind=cores --gpus-per-task=1 --kill-on-bad-exit=1 /opt/milehpc/venv/bin/python -m milehpc launch "$MILEHPC_RUN_DIR" &
step=$!
# Rank 0 marks that it reported the job's failure; the other ranks end within seconds, and so does srun unless a node
# is unreachable (a partition): then srun waits for that node's step until Slurm declares the node down
# (SlurmdTimeout). Stop waiting 5 s after the mark (nor wait out KillWait for ranks that are gone):
# the probe below names the node.
watcher=""
if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
    (
        while kill -0 "$step" 2>/dev/null && [ ! -e "$MILEHPC_RUN_DIR/.milehpc/step-failed" ]; do sleep 0.5; done
        kill -0 "$step" 2>/dev/null || exit 0
        sleep 5
        if kill -0 "$step" 2>/dev/null; then
            echo "milehpc: rank 0 reported the failure 5 s ago and srun still runs (waiting for a node it cannot reach, or for KillWait): ending the step" >&2
            touch "$MILEHPC_RUN_DIR/.milehpc/step-failed.abandoned"
            # srun forwards an interrupt to the tasks it can reach; it cannot end the step without the lost node
            kill -INT "$step" 2>/dev/null || true; sleep 1; kill -KILL "$step" 2>/dev/null || true
        fi
    ) &
    watcher=$!
fi
# `wait` returns early (status > 128) when a trapped signal arrives: keep waiting for the step itself.
while true; do
    set +e
    wait "$step"
    rc=$?
    set -e
    kill -0 "$step" 2>/dev/null || break
done
if [ -n "$watcher" ]; then
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
fi
if [ -e "$MILEHPC_RUN_DIR/.milehpc/step-failed.abandoned" ] && { [ "$rc" -eq 0 ] || [ "$rc" -eq 75 ]; }; then
    rc=1  # a step ended by the shell failed, whatever srun's status says
fi
if [ "$rc" -eq 0 ] && [ ! -e "$MILEHPC_RUN_DIR/.milehpc/step-done" ]; then
    echo "milehpc: the launcher exited 0 but the ranks never reported finishing; treating the step as failed" >&2
    rc=1
fi
# `milehpc stop`: the ranks checkpointed as for a requeue; end the job here, successfully, and requeue nothing.
if [ -e "$MILEHPC_RUN_DIR/.milehpc/stop-request" ]; then
    rm -f "$MILEHPC_RUN_DIR/.milehpc/stop-request"
    if [ "$rc" -eq 75 ]; then
        echo "milehpc: ranks checkpointed and stopped on request (milehpc stop); resume with: milehpc submit --resume $MILEHPC_RUN_DIR" >&2
        exit 0
    fi
fi

# A node that died takes its ranks with it and srun aborts the step without saying which node it was (and Slurm
# notices only after SlurmdTimeout). One probe step, a task per node, names the nodes whose slurmd starts nothing;
# the job is then requeued without them and resumes from its last checkpoint.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 75 ] && [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
    live=$(timeout 120 srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
        --overlap --mpi=none --kill-on-bad-exit=0 printenv SLURMD_NODENAME 2>/dev/null) || true
    dead=$(comm -23 <(scontrol show hostnames "$SLURM_JOB_NODELIST" | sort) <(sort -u <<<"$live") | paste -sd, -)
    # A job Slurm itself is ending (scancel, or a node it already marked down: NODE_FAIL, requeued by Slurm) starts
    # no task anywhere: that says nothing about the nodes. Nor does a probe that failed as a whole (srun refused or
    # timed out): this shell's own node is alive, so a probe that does not list it names no dead node (excluding
    # every node would leave the job pending for ever).
    state=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -n 1) || state=""
    if [ -n "$dead" ] && [ "$state" = "JobState=RUNNING" ] && [ -n "${SLURMD_NODENAME:-}" ] && grep -qxF -- "$SLURMD_NODENAME" <<<"$live"; then
        restarts="${SLURM_RESTART_COUNT:-0}"
        echo "milehpc: node(s) $dead of job $SLURM_JOB_ID died (their slurmd starts no task): the step ended with status $rc" >&2
        if [ "$restarts" -lt 3 ]; then
            old=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*' | head -n 1) || old=""
            old=${old#ExcNodeList=}
            exclude=$dead
            if [ -n "$old" ] && [ "$old" != "(null)" ]; then exclude="$old,$dead"; fi
            # ExcNodeList can change only once the job is pending again: requeue first (this shell outlives the
            # requeue's TERM, which it traps, by KillWait), then exclude.
            if scontrol requeue "$SLURM_JOB_ID"; then
                # Until Slurm takes the update or ends this shell (KillWait after the requeue): by the clock, since
                # the requeue's TERM can cut the sleeps short, and a loaded slurmctld can take seconds to turn it.
                until_s=$((SECONDS + 60))
                why=""
                while [ "$SECONDS" -lt "$until_s" ]; do
                    if why=$(scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude" 2>&1); then
                        echo "milehpc: requeued without $exclude (restart $((restarts + 1)) of 3); it resumes from its last checkpoint" >&2
                        exit 0
                    fi
                    sleep 0.2 || true  # a killed sleep must not end the shell (set -e)
                done
                echo "milehpc: requeued, but Slurm refused to exclude $exclude (${why:-no answer})" >&2
                exit 0
            fi
        fi
        # The --set replaces the partition's access.options: keep the ones this job runs with (validated to SLURM_OPT,
        # no quote or $ among them).
        echo "milehpc: not requeued (restart $restarts of 3); resume with: milehpc submit --resume $MILEHPC_RUN_DIR --set 'site.access.options=[\"--exclude=$dead\"]'" >&2
    fi
fi

if [ "$rc" -eq 75 ]; then
    # scancel (TERM, then KILL after KillWait) leaves the job COMPLETING, and Slurm would requeue even that: only a
    # job Slurm still runs (wall-time warning) is requeued; one that is ending stays ended, with its checkpoint.
    state=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -n 1) || state=""
    if [ -n "$state" ] && [ "$state" != "JobState=RUNNING" ]; then
        echo "milehpc: ranks checkpointed; the job is ending (${state#JobState=}: scancel?), not requeueing it; resume with: milehpc submit --resume $MILEHPC_RUN_DIR" >&2
        exit "$rc"
    fi
    restarts="${SLURM_RESTART_COUNT:-0}"
    if [ "$restarts" -lt 3 ]; then
        echo "milehpc: ranks checkpointed; requeueing (restart $((restarts + 1)) of 3)" >&2
        if scontrol requeue "$SLURM_JOB_ID"; then
            exit 0
        fi
        # scancel: the job is ending, Slurm refuses the requeue; the checkpoint is there all the same.
        echo "milehpc: Slurm refused the requeue (job cancelled?); resume with: milehpc submit --resume $MILEHPC_RUN_DIR" >&2
        exit "$rc"
    fi
    echo "milehpc: ranks checkpointed but max_restarts (3) is reached; resume with: milehpc submit --resume $MILEHPC_RUN_DIR" >&2
fi
exit "$rc"
