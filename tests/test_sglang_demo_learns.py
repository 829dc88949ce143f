"""Issue 12: the README's CPU demo with the REAL sglang engine as its rollout engine learns (exact-match from <= 0.3
to >= 0.8; run.target_reward ends it there) under real mpirun, 1 SGLang rollout rank + 1 trainer rank: every step's
weights reach SGLang's scheduler through its own update group. About 5 minutes on an idle 2-core machine: SGLang's CPU
attention (torch_native) is ~5x slower per step than the reference engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from readme_demo import learned, run_readme_demo
from sglang_real import require_real_sglang

pytestmark = [pytest.mark.mpi, pytest.mark.slow(minutes=5), pytest.mark.timeout(1500)]


def test_the_readmes_sglang_demo_command_learns(tmp_path: Path) -> None:
    require_real_sglang()
    records, run_dir = run_readme_demo(tmp_path, 'rollout.engine="sglang"')
    start, end = learned(records)
    assert start <= 0.3 and end >= 0.8 and len(records) < 1500, (start, end, len(records))
    job = json.loads((run_dir / "job.json").read_text())
    assert job["rollout"]["engine"] == "sglang"
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 2
    assert all(r["rollout/engine_restarts"] == 0 for r in records)
    from milehpc.samples.dumps import read_rollouts

    # The last batch came from the weights the trainer synced into the engine one step before (one-step-off).
    last = len(records) - 1
    assert {s.weight_version for s in read_rollouts(run_dir, last)[0]} == {last - 1}
