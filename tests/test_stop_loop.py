"""`milehpc stop` on the real RL loop (1 trainer + 1 rollout rank), started as a user does on the local site
(`milehpc submit --site local`: the rendered script's mpirun): the ranks commit a checkpoint at a step boundary and
the script exits 0 with the resume hint, without a requeue; `milehpc submit --resume RUN_DIR` starts from that
checkpoint and goes on to a `run.target_reward` end, which is checkpointed like the last step (both ranks' shards).
Also the arguments `stop` refuses, each with one line and exit 2, and the rank's TERM handler."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import job_toml

STEPS = 16  # the target (every mean reward is >= 0) ends the run at WINDOW, before this
WINDOW = 10  # schedule.TARGET_WINDOW


def _milehpc(tmp_path: Path, *args: str, state: str = "state", check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MILEHPC_STATE_DIR": str(tmp_path / state), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "milehpc", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=check)


def _ended(job_id: str) -> bool:
    return not Path(f"/proc/{job_id.removeprefix('local-')}").exists()


def _wait_ended(job_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not _ended(job_id):
        assert time.monotonic() < deadline, f"{job_id} did not end within {timeout} s"
        time.sleep(0.3)


def _steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.mpi
@pytest.mark.slow
def test_stop_the_rl_loop_then_resume_to_a_target_end(tmp_path: Path) -> None:
    from milehpc.checkpoint import list_checkpoints, resume_run_dir

    # 1 s per step (the reward sleeps) while `slow` exists: the stop lands mid-run whatever the machine's load.
    slow = tmp_path / "slow"
    slow.touch()
    job = tmp_path / "job.toml"
    job.write_text(job_toml(STEPS, add={"run": "target_reward = 0.0"},
                            env={"MILEHPC_TEST_REWARD_DELAY": "1", "MILEHPC_TEST_REWARD_DELAY_WHILE": str(slow)}))
    run_dir = tmp_path / "run"
    job_id = json.loads(_milehpc(tmp_path, "submit", str(job), "--site", "local", "--run-dir", str(run_dir),
                                 "--json").stdout)["job_id"]
    log_path = run_dir / "logs" / "local.out"
    try:
        deadline = time.monotonic() + 300
        while len(_steps_logged(run_dir)) < 2:
            assert not _ended(job_id), log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "2 steps not within 300 s"
            time.sleep(0.2)
        out = _milehpc(tmp_path, "stop", job_id).stdout  # by job id: through the job record
        assert f"asked job {job_id} to checkpoint" in out, out
        _wait_ended(job_id)
    finally:
        if not _ended(job_id):
            os.killpg(int(job_id.removeprefix("local-")), signal.SIGKILL)
    slow.unlink()  # the resumed run need not sleep
    log = log_path.read_text()
    assert "ranks checkpointed and stopped on request (milehpc stop); resume with: milehpc submit --resume" in log, \
        log[-3000:]
    assert "requeueing" not in log
    stopped = json.loads((run_dir / ".milehpc" / "checkpointed").read_text())["step"]
    assert 2 <= stopped < WINDOW and list_checkpoints(run_dir / "checkpoints")[0].step == stopped
    assert not (run_dir / ".milehpc" / "stop-request").exists()

    proc = _milehpc(tmp_path, "stop", job_id, check=False)  # ended now: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "is not running" in proc.stderr

    res = json.loads(_milehpc(tmp_path, "submit", "--resume", str(run_dir), "--site", "local", "--json").stdout)
    _wait_ended(res["job_id"])
    log = log_path.read_text()
    assert f"(step {stopped}, restart 0" in log and "milehpc: resumed from" in log, log[-3000:]
    # The target window came back with the checkpoint: the run ends at step WINDOW, not WINDOW steps after the stop,
    # and that end is a checkpoint of both ranks (tests/test_ckpt_resume_local.py resumes from one, in one process).
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    assert newest.step == WINDOW and resume_run_dir(run_dir)["step"] == WINDOW, log[-3000:]
    assert {"rank-00000.pt", "rank-00001.pt", "rank-00001.h5"} <= set(newest.manifest["files"])
    assert _steps_logged(run_dir) == list(range(WINDOW))  # no step lost or counted twice

    # A run directory without a job record (submitted from elsewhere): the request is written all the same.
    out = _milehpc(tmp_path, "stop", str(run_dir), state="other-state").stdout
    assert "no milehpc job record" in out and "asked any job running there to checkpoint and stop" in out, out
    assert (run_dir / ".milehpc" / "stop-request").exists() and (run_dir / ".milehpc" / "checkpoint-request").exists()


@pytest.mark.parametrize(("arg", "expected"), [
    ("not-a-job", "expected a job id (1234, 1234_5, local-1234) or an existing milehpc run directory, got "),
    ("/etc/hostname", "/etc/hostname is not a milehpc run directory"),
    ("/etc", "/etc is not a milehpc run directory (no plan.json"),
    ("local-abc", "expected a job id like local-1234, got 'local-abc'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path, arg: str, expected: str) -> None:
    proc = _milehpc(tmp_path, "stop", arg, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_term_to_a_rank_becomes_a_checkpoint_request(tmp_path: Path) -> None:
    """What `milehpc launch` installs first (signals item 8): scancel's TERM must not kill a rank mid-step."""
    from milehpc.runtime.signals import install_rank_handlers, request_path

    previous = install_rank_handlers(tmp_path)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert request_path(tmp_path).read_text().startswith("signal SIGTERM")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
