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
