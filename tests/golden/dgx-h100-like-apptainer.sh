#!/bin/bash
# milehpc job golden on site dgx-h100-like, partition batch
# 4 rank(s) on 1 node(s): trainer ranks 0-1 (tp=1 pp=1 dp=2), 2 rollout engine(s) x 1
# Rendered by milehpc; rerun `milehpc render` rather than editing.
#SBATCH --job-name=golden
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=14
#SBATCH --time=00:30:00
#SBATCH --output=/scratch/milehpc/runs/golden/logs/slurm-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --gpus-per-node=8
#SBATCH --partition=batch
#SBATCH --exclusive
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


# Environment of every rank (site values cite the site's user guide; job [env] last).
export PYTHONUNBUFFERED=1
export NCCL_IB_HCA=mlx5
export NCCL_SOCKET_IFNAME='^lo,docker'
export NCCL_NET_GDR_LEVEL=PHB
export MILEHPC_EXAMPLE="${HOME}/data"

# Rendezvous for torch.distributed: this shell runs on the first node; the port is seeded by the job id so
# that jobs sharing a node do not collide (rank 0 still checks it is free).
MASTER_ADDR=$(hostname)
export MASTER_ADDR
export MASTER_PORT=$(( 20000 + ${SLURM_JOB_ID:-$$} % 40000 ))
export MILEHPC_RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"


# Each task enters the container with a clean environment; pass on what the ranks need by name.
milehpc_rank() {
    local v
    for v in $(compgen -e); do
        case "$v" in
            SLURM_*|PMIX_*|PMI_*|OMPI_*|MILEHPC_*|MASTER_*|*TOKEN*|*KEY*|*SECRET*|*PASSWORD*) export "APPTAINERENV_$v=${!v}" ;;
        esac
    done
    for v in CUDA_VISIBLE_DEVICES GPU_DEVICE_ORDINAL MILEHPC_EXAMPLE NCCL_IB_HCA NCCL_NET_GDR_LEVEL NCCL_SOCKET_IFNAME PYTHONUNBUFFERED ROCR_VISIBLE_DEVICES; do
        if [ -n "${!v+x}" ]; then export "APPTAINERENV_$v=${!v}"; fi
    done
    exec apptainer exec --cleanenv --nv --bind /scratch/milehpc/runs/golden,/raid /images/milehpc.sif python3 -m milehpc launch "$MILEHPC_RUN_DIR"
}
export -f milehpc_rank

echo "milehpc: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST; master $MASTER_ADDR:$MASTER_PORT" >&2
# ONE MPI world holds the trainer and the rollout ranks; each rank finds its role in plan.json.
# Rank 0 writes this marker when every rank finished; a launcher can exit 0 without starting the ranks
# (e.g. srun after a PMIx failure), and that must not look like success.
rm -f "$MILEHPC_RUN_DIR/.milehpc/step-done"
srun --mpi=pmix --nodes=1 --ntasks=4 --ntasks-per-node=4 --cpus-per-task=14 --cpu-bind=none --kill-on-bad-exit=1 bash -c milehpc_rank &
step=$!
# `wait` returns early (status > 128) when a trapped signal arrives: keep waiting for the step itself.
while true; do
    set +e
    wait "$step"
    rc=$?
    set -e
    kill -0 "$step" 2>/dev/null || break
done
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
