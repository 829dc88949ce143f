"""Run a function on several spawned processes (torch.multiprocessing, no mpirun): the cheap way to test real
torch.distributed over gloo in one test. A rank that hangs past the deadline fails the test in one line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], world: int, *, seconds: float, what: str) -> None:
    """``fn(rank, *args)`` on ``world`` spawned processes; fails the test if they are not done within ``seconds``
    (a rank's exception is raised here)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish within {seconds:.0f} s ({world} ranks over gloo)")
    assert len(ctx.processes) == world
