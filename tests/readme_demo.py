"""Run one of the README's ``milehpc run examples/cpu-demo.toml ...`` command lines as written (the line picked by a
text it contains), in a fresh run folder; shared by the demo-learning tests of each engine and trainer setup."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ".venv/bin/milehpc run examples/cpu-demo.toml"


def run_readme_demo(tmp_path: Path, marker: str, *extra: str, timeout: float = 1200) -> tuple[list[dict], Path]:
    """(the metrics records, the run folder) of the README's one demo line containing ``marker``, with ``extra``
    arguments appended (e.g. a lower ``--set run.target_reward``: CI time)."""
    [line] = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith(DEMO) and marker in ln]
    argv = shlex.split(line)
    argv[0] = str(Path(sys.executable).with_name("milehpc"))
    run_dir = tmp_path / "run"
    proc = subprocess.run([*argv, *extra, "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "MILEHPC_PROGRESS": "plain"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()], run_dir


def learned(records: list[dict]) -> tuple[float, float]:
    """Mean exact-match reward of the first and of the last 10 steps."""
    rewards = [r["rollout/reward_mean"] for r in records]
    return sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10


def assert_engine_demo_learns(tmp_path: Path, engine: str, target: float, steps: int) -> None:
    """The README's demo line for rollout engine ``engine`` (1 rollout rank + 1 trainer rank) run to ``target``
    within ``steps``: it starts at <= 0.3, gets there, never restarts its engine, and its last batch came from the
    weights synced one step before (one-step-off)."""
    from milehpc.samples.dumps import read_rollouts

    records, run_dir = run_readme_demo(tmp_path, f'rollout.engine="{engine}"', "--set", f"run.target_reward={target}",
                                       "--set", f"run.steps={steps}")
    start, end = learned(records)
    assert start <= 0.3 and end >= target and len(records) < steps, (start, end, len(records))
    job = json.loads((run_dir / "job.json").read_text())
    assert job["rollout"]["engine"] == engine and job["run"]["target_reward"] == target
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 2
    assert all(r["rollout/engine_restarts"] == 0 for r in records)
    last = len(records) - 1
    assert {s.weight_version for s in read_rollouts(run_dir, last)[0]} == {last - 1}
