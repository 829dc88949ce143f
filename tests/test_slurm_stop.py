"""Ending a job by hand, for real, on the test Slurm cluster: `milehpc stop` (the stop request of
milehpc.runtime.signals, item 7) and `scancel` (TERM to the batch shell and to every rank, KILL after KillWait;
item 8). Either way the ranks checkpoint at a step boundary (the payload's cursor, tests/cluster/payload.py:count),
nothing requeues the job, and `milehpc submit --resume RUN_DIR` continues from the checkpoint: no step lost or
counted twice."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

AFTER_RESUME = 5  # steps the resumed run counts before it ends


def _count_job(cli: Any, tmp_path: Path, checkpoint_s: float = 0.0) -> tuple[str, Path]:
    """A counting job with room to run (no wall-time signal in its 5 minutes), started and past step 3; its
    checkpoint takes ``checkpoint_s``."""
    job = harness.write_job(tmp_path / "job.toml", "count", name="stop", time_limit="00:05:00",
                            env={"COUNT_AFTER_RESTART": str(AFTER_RESUME), "COUNT_CHECKPOINT_S": str(checkpoint_s)})
    run_dir = tmp_path / "run"
    job_id = cli.submit(job, run_dir)["job_id"]
    steps = run_dir / "out" / "steps.txt"
    deadline = time.monotonic() + 180
    while not (steps.exists() and len(steps.read_text().splitlines()) >= 3):
        [st] = cli.status(job_id)
        assert not st["terminal"], f"job ended before counting: {st}"
        assert time.monotonic() < deadline, "the job did not count 3 steps within 180 s"
        time.sleep(0.2)
    return job_id, run_dir


def _steps(run_dir: Path) -> list[int]:
    return [int(line.split()[0]) for line in (run_dir / "out" / "steps.txt").read_text().splitlines()]


def _assert_checkpointed(run_dir: Path) -> int:
    """A complete checkpoint (the cursor after the step the ranks finished) and no request left behind; returns
    the cursor."""
    done = json.loads((run_dir / ".milehpc" / "checkpointed").read_text())
    cursor = json.loads((run_dir / "out" / "state.json").read_text())["next"]
    assert done["step"] == cursor == len(_steps(run_dir)), (done, cursor, _steps(run_dir))
    assert not (run_dir / ".milehpc" / "checkpoint-request").exists()
    assert not (run_dir / ".milehpc" / "stop-request").exists()
    return cursor


def _assert_checkpointed_and_resumable(cli: Any, run_dir: Path) -> None:
    """:func:`_assert_checkpointed`, and a resumed submission that continues from it: every step exactly once."""
    cursor = _assert_checkpointed(run_dir)
    res = json.loads(cli("submit", "--resume", str(run_dir), "--site", "local-slurm", "--json").stdout)
    cli.submitted.append(res["job_id"])
    [st] = harness.wait_for(res["job_id"], timeout=180)
    log = (run_dir / "logs" / f"slurm-{res['job_id']}.out").read_text()
    assert st.state == "COMPLETED", log
    assert f"payload count: starting at step {cursor}" in log
    assert _steps(run_dir) == list(range(cursor + AFTER_RESUME)), "steps lost or counted twice"


def test_stop_checkpoints_ends_completed_without_requeue_and_resumes(cli, tmp_path: Path) -> None:
    job_id, run_dir = _count_job(cli, tmp_path)
    # A job waiting on this one is pending: stopping it cancels it (nothing runs that could checkpoint).
    waiting = cli.submit(tmp_path / "job.toml", tmp_path / "waiting", "--after", job_id)["job_id"]
    out = cli("stop", waiting).stdout
    assert f"job {waiting} was pending" in out and "cancelled it" in out, out

    out = cli("stop", str(run_dir)).stdout  # by run directory: resolved through the job record
    assert f"asked job {job_id} to checkpoint" in out and f"milehpc submit --resume {run_dir.resolve()}" in out
    [st] = harness.wait_for(job_id, timeout=120)
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert st.state == "COMPLETED", log
    assert harness.scontrol_show(job_id)["Restarts"] == "0", log  # not requeued
    assert "ranks checkpointed and stopped on request (milehpc stop); resume with: milehpc submit --resume" in log
    assert "requeueing" not in log
    [wst] = harness.wait_for(waiting, timeout=60)
    assert wst.state == "CANCELLED"
    _assert_checkpointed_and_resumable(cli, run_dir)

    proc = cli("stop", job_id, check=False)  # ended: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "already ended (COMPLETED)" in proc.stderr


def test_scancel_lets_the_ranks_checkpoint_before_kill_wait(cli, tmp_path: Path) -> None:
    # The checkpoint takes 4 s of the cluster's KillWait=10 (tests/cluster/slurm.sh): nothing may kill the ranks
    # in between (srun forwards TERM; the script only waits).
    job_id, run_dir = _count_job(cli, tmp_path, checkpoint_s=4.0)
    cli("cancel", job_id)  # scancel: TERM to the batch shell and to the ranks, KILL after KillWait
    [st] = harness.wait_for(job_id, timeout=120)
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert st.state == "CANCELLED", log
    assert "payload count: checkpoint request after step" in log, log  # the ranks were not killed by TERM
    assert "the job is ending (COMPLETING: scancel?), not requeueing it; resume with: milehpc submit --resume" in log
    # Its resume is not run again here: the RL loop's scancel test below resumes after a scancel.
    _assert_checkpointed(run_dir)


def test_scancel_of_the_rl_loop_leaves_a_checkpoint_that_resume_continues(cli, tmp_path: Path) -> None:
    """The same with the real loop (1 trainer + 1 rollout rank under srun --mpi=pmix, 1 s per step until the
    scancel; the resumed run does not sleep)."""
    from ckpt_helpers import job_toml

    from milehpc.checkpoint import list_checkpoints

    steps = 12
    slow = tmp_path / "slow"
    slow.touch()
    job = tmp_path / "job.toml"
    job.write_text(job_toml(steps, env={"MILEHPC_TEST_REWARD_DELAY": "1", "MILEHPC_TEST_REWARD_DELAY_WHILE": str(slow)},
                            time_limit="00:10:00"))
    run_dir = tmp_path / "run"
    job_id = cli.submit(job, run_dir)["job_id"]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        [st] = cli.status(job_id)
        assert not st["terminal"] and time.monotonic() < deadline, st
        time.sleep(0.3)
    cli("cancel", job_id)
    [st] = harness.wait_for(job_id, timeout=120)
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text(errors="replace")
    assert st.state == "CANCELLED" and "(COMPLETING: scancel?), not requeueing it" in log, log[-3000:]
    slow.unlink()
    stopped = json.loads((run_dir / ".milehpc" / "checkpointed").read_text())["step"]
    assert 2 <= stopped < steps and list_checkpoints(run_dir / "checkpoints")[0].step == stopped

    res = json.loads(cli("submit", "--resume", str(run_dir), "--site", "local-slurm", "--json").stdout)
    cli.submitted.append(res["job_id"])
    [st] = harness.wait_for(res["job_id"], timeout=300)
    log = (run_dir / "logs" / f"slurm-{res['job_id']}.out").read_text(errors="replace")
    assert st.state == "COMPLETED" and f"(step {stopped}, restart 0" in log, log[-3000:]
    assert list_checkpoints(run_dir / "checkpoints")[0].step == steps
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(steps))  # each once
