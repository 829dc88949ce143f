#!/bin/bash
# Run the test suite: install what the tests need (scripts/setup-tests.sh: about a second when nothing changed), start
# the single-host and the multi-node test Slurm clusters, run pytest, stop them (whatever the result). Extra arguments
# go to pytest.
#
#   bash scripts/test.sh            # everything (what CI runs)
#   bash scripts/test.sh --quick    # the quick tier (under 5 minutes on 2 cores; tests/conftest.py says what it holds)
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

quick=()
args=()
for arg in "$@"; do
    if [ "$arg" = "--quick" ]; then quick=(-m quick); else args+=("$arg"); fi
done

bash scripts/setup-tests.sh || exit $?

cluster=tests/cluster/slurm.sh
started=0
if [ -f "$cluster" ]; then
    if bash "$cluster" start; then
        started=1
        eval "$(bash "$cluster" env)"
    else
        echo "test.sh: the test Slurm cluster did not start; Slurm tests will say why they skip" >&2
    fi
fi
# The multi-node cluster (tests/cluster/multinode.sh: 4 nodes in network namespaces, its own directory and ports) beside
# it: tests/test_multinode_cluster.py. Not for the quick tier, which runs no multi-node test.
multinode=tests/cluster/multinode.sh
mn_started=0
if [ ${#quick[@]} -eq 0 ] && [ -f "$multinode" ]; then
    if bash "$multinode" start; then
        mn_started=1
    else
        echo "test.sh: the multi-node test cluster did not start; its tests will say why they skip" >&2
    fi
fi
stop_cluster() {
    [ "$mn_started" -eq 1 ] && bash "$multinode" stop
    [ "$started" -eq 1 ] && bash "$cluster" stop
}
trap stop_cluster EXIT

# Two pytest workers by default: much of a test's time is process start-up, MPI rendezvous and Slurm scheduling,
# so two share the 2 cores of the CI machine well. A file's tests stay on one worker (--dist loadfile; tests/conftest.py
# puts the long files first): the module fixtures that launch MPI jobs run once. MILEHPC_TEST_WORKERS=0 runs everything
# in this one process.
.venv/bin/python -m pytest -ra -n "${MILEHPC_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder ${quick[@]+"${quick[@]}"} \
    ${args[@]+"${args[@]}"}
