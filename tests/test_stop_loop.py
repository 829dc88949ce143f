"""`milehpc stop RUN_DIR` and a `run.target_reward` end on the real RL loop (1 trainer + 1 rollout rank under the
rendered local script's mpirun): the ranks commit a checkpoint at a step boundary and the script exits 0 without a
requeue; the resumed run (`milehpc submit --resume RUN_DIR`) starts from that checkpoint and goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import job_toml, prepare_local, start_script

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 12


def _milehpc(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MILEHPC_STATE_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "milehpc", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=True)


def _resume_to_end(tmp_path: Path, run_dir: Path) -> str:
    """`milehpc submit --resume RUN_DIR` on the local site; wait until that run ended and return its log."""
    res = json.loads(_milehpc(tmp_path, "submit", "--resume", str(run_dir), "--site", "local", "--json").stdout)
    pid = int(res["job_id"].removeprefix("local-"))
    deadline = time.monotonic() + 300
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, "the resumed run did not end within 300 s"
        time.sleep(0.3)
    return (run_dir / "logs" / "local.out").read_text()


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_stop_the_rl_loop_then_resume_to_the_end(tmp_path: Path) -> None:
    from milehpc.checkpoint import list_checkpoints

    # 1 s per step (the reward sleeps): the stop lands mid-run whatever the machine's load.
    run_dir = prepare_local(tmp_path, "run", job_toml(STEPS, env={"MILEHPC_TEST_REWARD_DELAY": "1"}))
    proc = start_script(run_dir)
    try:
        deadline = time.monotonic() + 300
        while _steps_logged(run_dir) < 2:
            assert proc.poll() is None, (run_dir / "logs" / "job.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "2 steps not within 300 s"
            time.sleep(0.2)
        out = _milehpc(tmp_path, "stop", str(run_dir)).stdout  # no job record: a run directory is enough
        assert "asked any job running there to checkpoint and stop" in out, out
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (run_dir / "logs" / "job.out").read_text()
    assert "ranks checkpointed and stopped on request (milehpc stop)" in log, log[-3000:]
    stopped = json.loads((run_dir / ".milehpc" / "checkpointed").read_text())["step"]
    assert 2 <= stopped < STEPS and list_checkpoints(run_dir / "checkpoints")[0].step == stopped

    log = _resume_to_end(tmp_path, run_dir)
    assert f"(step {stopped}, restart 0" in log and "milehpc: resumed from" in log, log[-3000:]
    assert list_checkpoints(run_dir / "checkpoints")[0].step == STEPS, log[-3000:]  # the end of the run


def test_a_target_reward_end_leaves_a_checkpoint_that_submit_resume_continues(tmp_path: Path) -> None:
    """run.target_reward ends the run early (every mean reward is >= 0): the end is checkpointed like the last step,
    and `milehpc submit --resume` continues from it (the restored target window ends it again one step later)."""
    from milehpc.checkpoint import list_checkpoints, resume_run_dir

    window = 10  # schedule.TARGET_WINDOW
    run_dir = prepare_local(tmp_path, "run", job_toml(STEPS + 4, add={"run": "target_reward = 0.0"}))
    assert start_script(run_dir).wait(timeout=300) == 0, (run_dir / "logs" / "job.out").read_text()[-3000:]
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    assert newest.step == window and resume_run_dir(run_dir)["step"] == window
    assert {"rank-00000.pt", "rank-00001.pt", "rank-00001.h5"} <= set(newest.manifest["files"])  # both ranks

    log = _resume_to_end(tmp_path, run_dir)
    assert f"(step {window}, restart 0" in log, log[-3000:]
    assert list_checkpoints(run_dir / "checkpoints")[0].step == window + 1, log[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(window + 1))
