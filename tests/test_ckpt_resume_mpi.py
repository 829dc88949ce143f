"""The real job: the rendered local job script runs `mpirun -np 2 milehpc launch` (1 trainer + 1 rollout rank,
sync loop). SIGUSR1 to the job script at a random step → checkpoint request file → both ranks checkpoint after the
same step and exit 75 → the script exits 75. Running the same script again resumes, and the final parameters
and optimizer state are bitwise equal to an uninterrupted run of the same job."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from ckpt_helpers import differences, final_state, job_toml, prepare_local, start_script

from milehpc.checkpoint import resume_run_dir
from milehpc.runtime import signals

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 16


def _log(run_dir: Path) -> str:
    return (run_dir / "logs" / "job.out").read_text(errors="replace")


LAYOUTS = {
    # 1 trainer + 1 rollout rank: the rollout rank runs ahead; its unsent/untrained batches are in the checkpoint
    "separate": {},
    # every rank both (DP=2 over gloo, one engine per rank): trainer and rollout state in each rank's shard
    "colocated": {"resources": "colocate = true", "trainer": "dp = 2", "rollout": "engines = 2"},
}


def _toml(layout: str, **kw: object) -> str:
    return job_toml(STEPS, extra="[checkpoint]\nkeep = 2", add=LAYOUTS[layout], **kw)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_signalled_mpi_job_checkpoints_exits_75_and_resumes_bitwise(tmp_path: Path, layout: str) -> None:
    ref_dir = prepare_local(tmp_path, "uninterrupted", _toml(layout))
    run_dir = prepare_local(tmp_path, "interrupted", _toml(layout, env={"MILEHPC_TEST_REWARD_DELAY": "0.1"}))
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["colocated"] == (layout == "colocated")
    ref = start_script(ref_dir)  # side by side with the interrupted run
    stop_after = random.Random(os.getpid()).randint(2, STEPS // 2)
    job = start_script(run_dir)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "rollouts" / f"step_{stop_after:06d}.h5").exists():
            assert job.poll() is None, _log(run_dir)[-3000:]
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.01)
        job.send_signal(signal.SIGUSR1)  # what Slurm's --signal=B:USR1@lead does to the batch shell
        assert job.wait(timeout=300) == signals.EXIT_REQUEUE, _log(run_dir)[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    done = json.loads(signals.checkpointed_path(run_dir).read_text())
    assert stop_after < done["step"] < STEPS, (stop_after, done)
    assert not signals.request_path(run_dir).exists()
    manifest = json.loads((Path(done["checkpoint"]) / "manifest.json").read_text())
    # both ranks wrote their shard: the trainer's model/optimizer, the rollout side's engine RNG, cursor, outbox
    assert {"rank-00000.pt", "rank-00001.pt", "rank-00001.h5"} <= set(manifest["files"])
    assert manifest["layout"]["parallel"]["world_size"] == 2
    assert resume_run_dir(run_dir)["step"] == done["step"]
    assert "ranks checkpointed; resume with: milehpc submit --resume" in _log(run_dir)

    again = start_script(run_dir)  # what `milehpc submit --resume RUN_DIR` resubmits
    assert again.wait(timeout=400) == 0, _log(run_dir)[-3000:]
    assert f"resumed from {done['checkpoint']} (step {done['step']}" in _log(run_dir)
    assert ref.wait(timeout=400) == 0, _log(ref_dir)[-3000:]

    different = differences(final_state(ref_dir, STEPS), final_state(run_dir, STEPS))
    assert not different, f"interrupted after step {done['step']}: {different[:5]}"
