"""An in-process run (:func:`milehpc.runtime.loop.run_local`) cut by SIGUSR1 (as Slurm signals the batch shell)
after one step, then resumed from its checkpoint: shared by the LoRA resume tests."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from milehpc.config.job import JobSpec
from milehpc.runtime import signals
from milehpc.runtime.loop import run_local


def run_cut_and_resumed(job: JobSpec, run_dir: Path, *, stop_after: int) -> None:
    """Run ``job`` in ``run_dir``, requeued by a signal after step ``stop_after``, then run it again to the end."""
    previous = signals.forward_signals(run_dir, (signal.SIGUSR1,))
    try:
        def stop(step: int, metrics: dict) -> None:
            if step == stop_after:
                os.kill(os.getpid(), signal.SIGUSR1)

        with pytest.raises(signals.RequeueExit):
            run_local(job, run_dir, on_step=stop, checkpointing=True)
        run_local(job, run_dir, checkpointing=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
