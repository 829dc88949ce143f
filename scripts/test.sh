#!/bin/bash
# Run the whole test suite: start the single-host test Slurm cluster, run pytest, stop the cluster
# (whatever the result). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

cluster=tests/cluster/slurm.sh
started=0
if [ -x "$cluster" ] || [ -f "$cluster" ]; then
    if bash "$cluster" start; then
        started=1
        eval "$(bash "$cluster" env)"
    else
        echo "test.sh: the test Slurm cluster did not start; Slurm tests will say why they skip" >&2
    fi
fi
stop_cluster() { [ "$started" -eq 1 ] && bash "$cluster" stop; }
trap stop_cluster EXIT

.venv/bin/python -m pytest -ra "$@"
