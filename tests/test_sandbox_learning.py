"""The code task learns: examples/cpu-code.toml (a tiny policy writes one-line Python functions, the reward is the
fraction of the shipped unit tests it passes, run in the bubblewrap sandbox) raises its reward under GRPO. Also:
every shipped problem's reference solution passes its own tests in the sandbox, and a wrong body does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_battery import require_bwrap

from milehpc.config.job import RewardSpec
from milehpc.rewards import RewardRunner
from milehpc.samples import Sample
from milehpc.sandbox import choice

REPO = Path(__file__).resolve().parent.parent
PROBLEMS = REPO / "examples" / "code-list-functions.jsonl"


def test_the_shipped_problems_are_solved_by_their_labels_and_not_by_a_wrong_body(monkeypatch) -> None:
    require_bwrap()
    monkeypatch.delenv("MILEHPC_RUN_DIR", raising=False)  # the default choice: bubblewrap
    choice.reset()
    rows = [json.loads(line) for line in PROBLEMS.read_text().splitlines()]
    right = [Sample(prompt_ids=[1], response_text=r["label"], metadata={"tests": r["tests"]}) for r in rows]
    wrong = [Sample(prompt_ids=[1], response_text="def f(a):return 0", metadata={"tests": r["tests"]}) for r in rows]
    RewardRunner.from_spec(RewardSpec(name="code_tests", params={"cache": False})).score(right + wrong)
    assert [s.scalar_reward for s in right] == [1.0] * len(rows), [(r["prompt"], s.reward) for r, s in zip(rows, right, strict=True)]
    assert all(s.scalar_reward < 1.0 for s in wrong), [s.reward for s in wrong]


@pytest.mark.slow(minutes=3)
def test_the_code_example_reward_rises(tmp_path: Path) -> None:
    require_bwrap()
    rdir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILEHPC_PROGRESS": "plain"}
    proc = subprocess.run([str(Path(sys.executable).with_name("milehpc")), "run", str(REPO / "examples" / "cpu-code.toml"),
                           "--site", "local", "--run-dir", str(rdir), "--set", f'data.source="{PROBLEMS}"',
                           # 40 steps at 3x the example's rate: a rise of 0.046 -> 0.154 (seeds 1, 2: +0.15, +0.10)
                           # where the example's 1e-4 needs 60 steps for a clear one; the sandbox is 87% of a step.
                           "--set", "run.steps=40", "--set", "trainer.lr=3e-4"],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 40 and max(r.get("rollout/failed", 0) for r in records) == 0
    start, end = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert end >= start + 0.08, (start, end)
