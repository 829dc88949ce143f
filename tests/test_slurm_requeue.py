"""Wall-time handling for real: a job with a 1-minute limit asks for ``--signal=B:USR1@20``; Slurm signals the
batch shell, whose trap asks the ranks to checkpoint (milehpc.runtime.signals); the payload saves its cursor and
exits 75; the script runs ``scontrol requeue``; the restarted job (SLURM_RESTART_COUNT=1) continues counting from
where it stopped. Nothing may be counted twice or lost.

Slurm sends the warning signal up to one slurmctld time-limit pass (30 s) before ``limit - lead``, so with a
60 s limit and a 20 s lead it arrives 10-40 s into the run. A requeued job is held until cred_expire + 1 s; the test
releases it early (``scontrol update StartTime=now``, see harness.wait_for) to stay short."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "cluster"))
import harness  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_wall_time_signal_checkpoints_requeues_and_continues(cli, tmp_path):
    job = harness.write_job(tmp_path / "job.toml", "count", name="requeue", time_limit="00:01:00",
                            extra="[checkpoint]\nsignal_lead_s = 20\nmax_restarts = 3\n",
                            env={"COUNT_AFTER_RESTART": "8"})
    run_dir = tmp_path / "run"
    script = cli("render", str(job), "--site", "local-slurm", "--run-dir", str(run_dir)).stdout
    assert "#SBATCH --signal=B:USR1@20" in script and "#SBATCH --requeue" in script
    job_id = cli.submit(job, run_dir)["job_id"]
    sts = harness.wait_for(job_id, timeout=200, release_holds=True)
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert [s.state for s in sts] == ["COMPLETED"], log

    info = harness.scontrol_show(job_id)
    restarts = int(info["Restarts"])
    assert restarts >= 1, log
    assert "milehpc: signal received, asking the ranks to checkpoint" in log
    assert "ranks checkpointed; requeueing (restart 1 of 3)" in log
    assert f"milehpc: job {job_id} restart 1" in log  # the restarted job knows it is one

    rows = [tuple(map(int, line.split())) for line in (run_dir / "out" / "steps.txt").read_text().splitlines()]
    steps = [s for s, _ in rows]
    assert steps == list(range(len(steps))), f"steps lost or counted twice: {steps}"
    runs = [r for _, r in rows]
    assert runs == sorted(runs) and set(runs) == set(range(restarts + 1)), runs
    assert runs.count(0) >= 1 and runs.count(restarts) == 8  # the last run counted its 8 and ended
    done = json.loads((run_dir / ".milehpc" / "checkpointed").read_text())
    assert done["step"] == runs.count(0) + sum(runs.count(r) for r in range(1, restarts))  # the last cursor saved
    assert not (run_dir / ".milehpc" / "checkpoint-request").exists()
    [st] = cli.status(job_id)
    assert st["state"] == "COMPLETED" and st["restarts"] == restarts
