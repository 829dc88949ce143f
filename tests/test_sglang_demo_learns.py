"""Issue 12: the README's CPU demo with the REAL sglang engine as its rollout engine learns under real mpirun, 1 SGLang
rollout rank + 1 trainer rank: every step's weights reach SGLang's scheduler through its own update group. Run to
0.4 instead of the README's 0.8 (CI time): measured 0.18 -> 0.4 in 81 steps, 0.5 in 109, 0.8 in 282; an engine left
on its first weights (a broken sync) stays near its start, ~0.2. SGLang's CPU attention (torch_native) is ~5x slower per step
than the reference engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_demo import assert_engine_demo_learns
from sglang_real import require_real_sglang

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=2), pytest.mark.timeout(1500)]

TARGET = 0.4
STEPS = 400  # ~5x the steps to TARGET measured: a run that stops learning fails here, not at the timeout


def test_the_readmes_sglang_demo_command_learns(tmp_path: Path) -> None:
    require_real_sglang()
    assert_engine_demo_learns(tmp_path, "sglang", TARGET, STEPS)
