#!/bin/bash
# milehpc job golden on site local (no scheduler): 4 rank(s) with mpirun
# trainer ranks 0-1 (tp=1 pp=1 dp=2), 2 rollout engine(s) x 1
# Rendered by milehpc; rerun `milehpc render` rather than editing.
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
export OMP_NUM_THREADS=1
export OMPI_MCA_btl='^ofi,tcp'
export MILEHPC_EXAMPLE="${HOME}/data"

# Rendezvous for torch.distributed: this shell runs on the first node; the port is seeded by the job id so
# that jobs sharing a node do not collide (rank 0 still checks it is free).
MASTER_ADDR=127.0.0.1
export MASTER_ADDR
export MASTER_PORT=$(( 20000 + ${SLURM_JOB_ID:-$$} % 40000 ))
export MILEHPC_RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"

# Open MPI refuses to start as root unless told (containers and CI run as root).
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# ONE MPI world holds the trainer and the rollout ranks; each rank finds its role in plan.json.
# Rank 0 writes this marker when every rank finished; a launcher can exit 0 without starting the ranks
# (e.g. srun after a PMIx failure), and that must not look like success.
rm -f "$MILEHPC_RUN_DIR/.milehpc/step-done"
/opt/milehpc/venv/bin/mpirun -np 4 --oversubscribe --bind-to none /opt/milehpc/venv/bin/python -m milehpc launch "$MILEHPC_RUN_DIR" &
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
    echo "milehpc: ranks checkpointed; resume with: milehpc submit --resume $MILEHPC_RUN_DIR" >&2
fi
exit "$rc"
