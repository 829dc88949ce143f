"""Interruptions at any point, by SIGKILL (a node dies, KillWait expired): a rank of a real `mpirun` job is killed
at a chosen point of a chosen step (``MILEHPC_FAULT``, :mod:`milehpc.faults`): before a generation, during a weight
broadcast, before the optimizer step, or in the checkpoint commit. Nothing half-written may ever be loaded: the
rerun resumes from the last *committed* checkpoint, ends bitwise equal to an uninterrupted run (resume is exact, so
"equal to the run resumed from the last committed checkpoint" is the same thing), and its metrics have one record
per step (the lost run's records after that checkpoint are dropped).

Property-style: each test run draws its scenarios (loop mode, layout, point, step) from a seeded RNG — the seed is
printed; ``MILEHPC_INTERRUPT_SEED`` sets it, default fixed so that CI is repeatable) and ``MILEHPC_INTERRUPT_RUNS``
sets how many (default 3, bounded time; scripts/stress.sh can ask for more and other seeds). USR1 and TERM interruptions are in tests/test_ckpt_resume_mpi.py."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from ckpt_helpers import differences, final_state, prepare_local, start_script
from ckpt_reference import CASES as ALL_CASES
from ckpt_reference import STEPS, case_toml

from milehpc.checkpoint import list_checkpoints
from milehpc.runtime import signals
from milehpc.runtime.metrics import read_metrics

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

INTERVAL = 3  # committed checkpoints after steps 3, 6 and 9 (and 12, the end)

# The loop modes (tests/ckpt_reference.py); their uninterrupted runs are shared with tests/test_ckpt_resume_mpi.py.
CASES = {c: ALL_CASES[c] for c in ("separate-sync", "separate-one_step_off", "separate-async", "colocated-sync")}
# Where each point can be reached: the colocated ranks load weights in place (no broadcast).
POINTS = {"generate": list(CASES), "optimizer": list(CASES), "commit": list(CASES),
          "broadcast": [c for c in CASES if c.startswith("separate")]}


def _toml(case: str) -> str:
    return case_toml(case, f"keep = 3\ninterval_steps = {INTERVAL}")


def _log(run_dir: Path) -> str:
    return (run_dir / "logs" / "job.out").read_text(errors="replace")


def _scenarios() -> list[tuple[str, str, int]]:
    # A fixed default: CI runs the same scenarios every time; scripts/stress.sh draws new seeds. 3832: three loop
    # modes, colocated included (separate-async broadcast@5, colocated-sync optimizer@5, separate-one_step_off
    # commit@6). Seed 2128 (commit@3) kills a job before its first committed checkpoint: the rerun starts afresh
    # and drops the lost attempt's records (tests/test_loop_local.py covers that in one process).
    seed = int(os.environ.get("MILEHPC_INTERRUPT_SEED") or 3832)
    print(f"interruption scenarios: MILEHPC_INTERRUPT_SEED={seed}")
    rng = random.Random(seed)
    points = list(POINTS)
    rng.shuffle(points)
    out = []
    for i in range(int(os.environ.get("MILEHPC_INTERRUPT_RUNS", "3"))):
        point = points[i % len(points)]  # every point before any repeats
        case = rng.choice(POINTS[point])
        # generate: batch; broadcast: weight version (>= 1); optimizer: 0-based step; commit: steps done
        step = {"generate": rng.randint(1, STEPS - 1), "broadcast": rng.randint(1, STEPS - 2),
                "optimizer": rng.randint(1, STEPS - 1), "commit": rng.choice([INTERVAL, 2 * INTERVAL])}[point]
        out.append((case, point, step))
    return out


@pytest.mark.parametrize("scenario", _scenarios(), ids=lambda s: f"{s[0]}-{s[1]}@{s[2]}")
def test_killed_job_resumes_from_the_last_committed_checkpoint_bitwise(tmp_path: Path, ckpt_reference,
                                                                     scenario) -> None:
    case, point, step = scenario
    run_dir = prepare_local(tmp_path, "killed", _toml(case))
    os.environ["MILEHPC_FAULT"] = f"{point}:{step}"
    try:
        killed = start_script(run_dir)
    finally:
        del os.environ["MILEHPC_FAULT"]
    rc = killed.wait(timeout=400)
    log = _log(run_dir)
    assert rc not in (0, signals.EXIT_REQUEUE), f"the fault {point}:{step} did not fire:\n{log[-3000:]}"
    committed = [c.step for c in list_checkpoints(run_dir / "checkpoints")]
    if point == "commit":  # its shards are on disk in a temporary directory, never committed
        assert step not in committed and any((run_dir / "checkpoints").glob(f".tmp-*{step:08d}*")), committed
    resume_step = max(committed, default=0)

    again = start_script(run_dir)  # what `milehpc submit --resume RUN_DIR` resubmits
    assert again.wait(timeout=400) == 0, _log(run_dir)[-3000:]
    log = _log(run_dir)
    if resume_step:
        assert f"(step {resume_step}, restart 0)" in log, (resume_step, log[-3000:])
    else:
        assert "milehpc: resumed from" not in log
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "a temporary checkpoint directory was left"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(STEPS))
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))

    different = differences(ckpt_reference(case).state(), final_state(run_dir, STEPS))
    assert not different, f"killed at {point}:{step}, resumed from step {resume_step}: {different[:5]}"
