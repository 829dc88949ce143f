"""The quick tier (`bash scripts/test.sh --quick` = pytest -m quick, tests/conftest.py): it holds the tests that
launch no MPI job, need no Slurm cluster and are not slow, plus the `smoke` end-to-end launches, and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def test_the_quick_tier_is_the_light_tests_and_the_smoke_launches() -> None:
    quick = _collected("-m", "quick", "tests/test_loop_mpi.py", "tests/test_slurm_lifecycle.py",
                       "tests/test_alg_losses.py")
    heavy = {t for t in quick if not t.startswith("tests/test_alg_losses.py")}
    # Of the MPI and Slurm files, the smoke launches alone: one RL loop under mpirun, one job through Slurm.
    assert heavy == {"tests/test_loop_mpi.py::test_sync_loop_logprobs_agree_right_after_each_sync",
                     "tests/test_slurm_lifecycle.py::test_submit_runs_to_completion_with_expected_output"}, heavy
    assert quick - heavy == _collected("tests/test_alg_losses.py")  # the unit tests are in, all of them
