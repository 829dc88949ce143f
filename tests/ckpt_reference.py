"""The uninterrupted reference runs of the checkpoint tests, one per loop mode, made once per test session.

tests/test_ckpt_resume_mpi.py (USR1/TERM), tests/test_ckpt_interrupt_kill.py (SIGKILL) and
tests/test_ckpt_engine_supervisor.py (a killed engine process; separate-sync) compare an interrupted run with an
uninterrupted run of the same job. A launch costs seconds of imports per rank, so each reference is run once and
shared: under pytest-xdist the files run on different workers, which meet in the session's temporary root (a file
lock per case: one worker runs it, another that needs it waits for it).

The reference checkpoints only at the end; the interrupted jobs differ from it in their ``[checkpoint]`` table alone
(and the supervisor test in its engine's process), which must not change the training (that is part of what the
tests assert)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import final_state, job_toml, prepare_local, start_script

STEPS = 12

CASES = {
    # 1 trainer + 1 rollout rank, generating with the weights after step k-1
    "separate-sync": {},
    # the rollout rank generates batch k+1 while step k trains: a sent, untrained batch is in every checkpoint
    "separate-one_step_off": {"run": 'loop = "one_step_off"'},
    # weights reach the engine every 3rd step: between syncs the engine holds older weights than the trainer
    "separate-one_step_off-interval3": {"run": 'loop = "one_step_off"\nupdate_weights_interval = 3'},
    # up to 2 batches ahead, each with exactly the version 2 steps back (async_weights = "scheduled")
    "separate-async": {"run": 'loop = "async"\nmax_staleness = 2\nasync_weights = "scheduled"',
                       "rollout": "partial_rollout = false"},
    # the same with partial rollouts (samples continued over batches keep their stale first chunk: corrected)
    "separate-async-partial": {"run": 'loop = "async"\nmax_staleness = 2\nasync_weights = "scheduled"\n'
                                      'stale_policy = "correct"',
                               "algorithm": 'off_policy_correction = "tis"'},
    # every rank both (DP=2 over gloo, one engine per rank): trainer and rollout state in each rank's shard
    "colocated-sync": {"resources": "colocate = true", "trainer": "dp = 2", "rollout": "engines = 2"},
}


def case_toml(case: str, checkpoint: str = "keep = 2", **kw: Any) -> str:
    """The job of a case; the reference's is this with the defaults."""
    return job_toml(STEPS, extra=f"[checkpoint]\n{checkpoint}", add=CASES[case], **kw)


def _shared_root(factory: pytest.TempPathFactory) -> Path:
    """The session's temporary root: under pytest-xdist the parent of the worker's own (``pytest-N/popen-gwK``),
    otherwise the session's (a folder a later session does not reuse, so no reference outlives its code)."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ckpt-references"
    root.mkdir(exist_ok=True)
    return root


class Reference:
    """The uninterrupted run of ``case``: :meth:`start` it (side by side with the run under test), then
    :meth:`state` waits for it; a run another test of the session already made is not run again. Made through the
    ``ckpt_reference`` fixture (tests/conftest.py), which closes it when its test failed half-way."""

    def __init__(self, factory: pytest.TempPathFactory, case: str) -> None:
        root = _shared_root(factory)
        self.run_dir = root / case
        self._done = root / f"{case}.done"
        self._lock_path = root / f"{case}.lock"
        self._lock: Any = None
        self._held = False
        self._proc: subprocess.Popen[bytes] | None = None
        self.case = case

    def start(self) -> Reference:
        if self._lock is not None:
            return self
        self._lock = self._lock_path.open("w")
        try:  # held until state() has it; another worker's state() waits for the run
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another worker is making it: the run under test need not wait for that
            return self
        self._held = True
        self._launch_if_missing()
        return self

    def _launch_if_missing(self) -> None:
        if self._done.exists():
            return
        if self.run_dir.exists():  # a failed earlier attempt
            shutil.rmtree(self.run_dir)
        prepare_local(self.run_dir.parent, self.case, case_toml(self.case))
        self._proc = start_script(self.run_dir)

    def state(self) -> dict[str, Any]:
        """The final model parameters and optimizer state (trainer rank 0) of the finished reference."""
        self.start()
        try:
            if not self._held:
                fcntl.flock(self._lock, fcntl.LOCK_EX)
                self._held = True
                self._launch_if_missing()  # the other worker's run failed: this one makes it
            if self._proc is not None:
                rc = self._proc.wait(timeout=400)
                assert rc == 0, (self.run_dir / "logs" / "job.out").read_text(errors="replace")[-3000:]
                self._done.touch()
        finally:
            self.close()
        return final_state(self.run_dir, STEPS)

    def close(self) -> None:
        """Stop a run still going (its test failed) and let the other workers at this case."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # the job script's trap: the ranks checkpoint and end (75)
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._lock is not None:
            self._lock.close()  # releases the lock if held
            self._lock = None
        self._held = False
