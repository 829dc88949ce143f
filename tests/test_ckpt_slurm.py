"""On the test Slurm cluster: the RL job (1 trainer + 1 rollout rank under `srun --mpi=pmix`, the one-step-off loop
as in the shipped examples: a generated, untrained batch is in flight at every checkpoint) has a 2-minute time
limit and `--signal=B:USR1@75`. Slurm signals the batch shell mid-run, the ranks checkpoint and exit 75, the script
requeues the job, the restarted job resumes from the checkpoint (again if signalled again) and finishes; the final
parameters and optimizer state are bitwise equal to an uninterrupted local (mpirun) run of the same job, and every
step has exactly one metrics record (nothing lost or counted twice over the requeues).

In the first run each step sleeps 3 s in the reward (tests/ckpt_helpers.py), so 24 steps outlast the signal, which
arrives 15-45 s into the run (Slurm sends it up to one 30 s slurmctld pass before limit - lead;
tests/cluster/README.md; a signal before the ranks run leaves its request for their first step boundary); the
2-minute limit leaves room for a slow start on a loaded machine. Restarted runs do not sleep."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_helpers import differences, final_state, job_toml, prepare_local, start_script

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ONE_STEP_OFF = {"run": 'loop = "one_step_off"'}
STEPS, DELAY = 24, 3.0  # 72 s of steps: more than the 15-45 s before the signal, so it must requeue


def _wait_releasing_late(job_id: str, *, timeout: float) -> list:
    """Wait for the job to end. A requeued job is held until cred_expire + 1 s (121 s here): release it, but only
    a few seconds after the hold began, once the previous incarnation's step is gone (releasing at once races
    with its teardown on a single node: "step aborted before step completely launched"). The restarted job gets
    a 10-minute limit: on a loaded machine the ranks' start alone can outlast a 2-minute job's signal time, and
    the point here is the first, short-limit incarnation."""
    from milehpc.scheduler.slurm import query

    deadline = time.monotonic() + timeout
    held_since: float | None = None
    while time.monotonic() < deadline:
        [st] = query([job_id])[job_id]
        if st.terminal:
            return [st]
        if st.state == "PENDING" and "BeginTime" in st.reason:
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since > 5:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=00:10:00"],
                               capture_output=True, timeout=30)
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True,
                               timeout=30)
                held_since = None
        else:
            held_since = None
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not done within {timeout} s")


def test_time_limit_signal_checkpoints_requeues_resumes_and_matches_local_run(cli, tmp_path: Path) -> None:
    extra = "[checkpoint]\nsignal_lead_s = 75\nmax_restarts = 4\nkeep = 2\n"
    job = tmp_path / "job.toml"
    job.write_text(job_toml(STEPS, add=ONE_STEP_OFF, extra=extra, env={"MILEHPC_TEST_REWARD_DELAY": str(DELAY)},
                            time_limit="00:02:00"))
    run_dir = tmp_path / "run"
    script = cli("render", str(job), "--site", "local-slurm", "--run-dir", str(run_dir)).stdout
    assert "#SBATCH --signal=B:USR1@75" in script and "#SBATCH --requeue" in script
    job_id = cli.submit(job, run_dir)["job_id"]
    # The uninterrupted run (locally, mpirun, no delay) beside it: the Slurm job's ranks mostly sleep in the reward.
    ref_dir = prepare_local(tmp_path, "uninterrupted", job_toml(STEPS, add=ONE_STEP_OFF, extra=extra))
    ref = start_script(ref_dir)
    try:
        sts = _wait_releasing_late(job_id, timeout=600)
        assert ref.wait(timeout=400) == 0, (ref_dir / "logs" / "job.out").read_text()[-3000:]
    finally:
        if ref.poll() is None:
            ref.kill()
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text(errors="replace")
    assert [s.state for s in sts] == ["COMPLETED"], log[-4000:]
    restarts = int(harness.scontrol_show(job_id)["Restarts"])
    assert restarts >= 1, log[-4000:]
    [st] = cli.status(job_id)  # milehpc's own status reports the requeues
    assert st["state"] == "COMPLETED" and st["restarts"] == restarts, st
    assert "milehpc: signal received, asking the ranks to checkpoint" in log
    assert "ranks checkpointed; requeueing (restart 1 of 4)" in log
    assert f"milehpc: job {job_id} restart 1" in log  # the restarted job knows it is one
    assert log.count("milehpc: resumed from ") == restarts, log[-4000:]  # every restart resumed
    done = json.loads((run_dir / ".milehpc" / "checkpointed").read_text())
    assert 0 < done["step"] < STEPS and done["restart_count"] == restarts - 1
    assert f"(step {done['step']}, restart {restarts}" in log, log[-4000:]  # the last run from the last checkpoint
    assert not (run_dir / ".milehpc" / "checkpoint-request").exists()
    # one record per step, in order: no step lost or counted twice over the requeues
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(STEPS))

    different = differences(final_state(ref_dir, STEPS), final_state(run_dir, STEPS))
    assert not different, f"{restarts} restart(s): {different[:5]}"
