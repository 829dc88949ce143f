"""The real job, every loop mode: the rendered local job script runs `mpirun -np 2 milehpc launch`. A signal to the
job script (USR1 as Slurm's wall-time warning, TERM as a preemption) at a random step → checkpoint request file →
both ranks checkpoint after the same step and exit 75 → the script exits 75. Running the same script again resumes
(once per case; twice in separate-async-partial, so that a resumed run is itself interrupted and resumed). The final
parameters and optimizer state are bitwise equal to an uninterrupted run of the same job, each resume started from
the step its checkpoint holds, and every step has exactly one metrics record.

The steps and signals are drawn from a seeded RNG, printed; ``MILEHPC_RESUME_SEED`` sets it (default fixed, so that CI
runs the same interruptions every time; scripts/stress.sh can be given other seeds).

What makes the separate layouts exact (see the README's "Resume" section): the rollout rank runs ahead of the
trainer; its checkpoint holds the batches it sent that are not trained yet (resent on resume), its partial
rollouts and over-sampled groups, its engine's RNG and the weight version it holds; the trainer gives the rebuilt
engine exactly that version back (with ``update_weights_interval > 1`` an older one than its own, kept for that)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from ckpt_helpers import differences, final_state, prepare_local, start_script
from ckpt_reference import CASES, STEPS, case_toml

from milehpc.checkpoint import resume_run_dir
from milehpc.runtime import signals
from milehpc.runtime.loop.schedule import required_version
from milehpc.runtime.metrics import read_metrics

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

# Seed 7 draws USR1 and TERM each at least twice over the cases, and both in the case interrupted twice (TERM, then
# USR1 to the resumed run).
SEED = int(os.environ.get("MILEHPC_RESUME_SEED") or 7)
INTERRUPTIONS = {"separate-async-partial": 2}  # 1 elsewhere: each interruption costs a launch
# Every loop mode but plain one-step-off (CI time: three launches): its signal path is the interval-3 case's (the same
# loop; that checkpoint holds the sent, untrained batch too, and the older weight version besides), and its exact
# resume is tests/test_ckpt_interrupt_kill.py's separate-one_step_off scenario.
SIGNALLED = [c for c in CASES if c != "separate-one_step_off"]


def _log(run_dir: Path) -> str:
    return (run_dir / "logs" / "job.out").read_text(errors="replace")


def _interrupt(run_dir: Path, after: int, signum: int) -> int:
    """Start the job script, signal it once step ``after``'s dump exists, and return the step its checkpoint
    holds (it must exit 75)."""
    job = start_script(run_dir)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "rollouts" / f"step_{after:06d}.h5").exists():
            assert job.poll() is None, _log(run_dir)[-3000:]
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.01)
        job.send_signal(signum)
        assert job.wait(timeout=300) == signals.EXIT_REQUEUE, _log(run_dir)[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    done = json.loads(signals.checkpointed_path(run_dir).read_text())
    assert after < done["step"] < STEPS, (after, done)
    assert not signals.request_path(run_dir).exists()
    assert resume_run_dir(run_dir)["step"] == done["step"]
    return int(done["step"])


@pytest.mark.parametrize("case", SIGNALLED)
def test_interrupted_mpi_job_resumes_bitwise_in_every_loop_mode(tmp_path: Path, ckpt_reference, case: str) -> None:
    run_dir = prepare_local(tmp_path, "interrupted", case_toml(case, env={"MILEHPC_TEST_REWARD_DELAY": "0.1"}))
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["colocated"] == case.startswith("colocated")
    ref = ckpt_reference(case).start()  # side by side with the interrupted run (unless the session has it already)

    rng = random.Random(f"{case}-{SEED}")
    print(f"interruptions: MILEHPC_RESUME_SEED={SEED}")
    resumed_at: list[int] = []
    after = rng.randint(1, 3)
    for i in range(INTERRUPTIONS.get(case, 1)):
        if after >= STEPS - 2:
            break
        signum = rng.choice([signal.SIGUSR1, signal.SIGTERM])
        print(f"{signal.Signals(signum).name} after step {after}")
        step = _interrupt(run_dir, after, signum)
        if i == 0:
            manifest = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
            # both ranks wrote their shard: the trainer's model/optimizer, the rollout side's RNG, cursor, outbox
            assert {"rank-00000.pt", "rank-00001.pt", "rank-00001.h5"} <= set(manifest["files"])
            assert manifest["layout"]["parallel"]["world_size"] == 2
        resumed_at.append(step)
        after = step + rng.randint(1, 3)
    assert len(resumed_at) == INTERRUPTIONS.get(case, 1), resumed_at
    assert "ranks checkpointed; resume with: milehpc submit --resume" in _log(run_dir)

    again = start_script(run_dir)  # what `milehpc submit --resume RUN_DIR` resubmits
    assert again.wait(timeout=400) == 0, _log(run_dir)[-3000:]
    log = _log(run_dir)
    for step in resumed_at:  # each run started from the previous one's checkpoint, not from step 0
        assert f"(step {step}, restart 0)" in log, (step, log[-3000:])
    assert log.count("milehpc: resumed from") == len(resumed_at)

    # one record per step, in order: a resumed run rewrote the records of the steps it ran again
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(STEPS))
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))

    different = differences(ref.state(), final_state(run_dir, STEPS))
    assert not different, f"interrupted after steps {resumed_at}: {different[:5]}"
    if case == "separate-async":  # "scheduled": every batch came from exactly the version it requires
        for d in (ref.run_dir, run_dir):
            assert _generated_with(d) == {b: {required_version(_job(d), b)} for b in range(STEPS)}


def _job(run_dir: Path):
    from milehpc.config.load import load_job

    return load_job(run_dir / "job.toml")


def _generated_with(run_dir: Path) -> dict[int, set[int]]:
    """The weight versions that generated each step's samples (from the rollout dumps)."""
    from milehpc.samples.dumps import read_rollouts

    return {b: {s.weight_version for s in read_rollouts(run_dir, b)[0]} for b in range(STEPS)}
