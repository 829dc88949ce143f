"""The two collectives checkpointing needs (a barrier and an integer max) over a single process or a bare mpi4py
communicator; the job's own timed helpers implement it in ``runtime.loop.checkpointing``. Every call has a timeout
and says what it waited for."""

from __future__ import annotations

import time
from typing import Any, Protocol

from milehpc.errors import RuntimeFailure


class Collective(Protocol):
    """The two collectives checkpointing needs; every call has a timeout and says what it waited for."""

    rank: int
    size: int

    def barrier(self, what: str) -> None: ...

    def allreduce_max(self, values: list[int], what: str) -> list[int]: ...


class Solo:
    """A world of one process."""

    rank = 0
    size = 1

    def barrier(self, what: str) -> None:
        return None

    def allreduce_max(self, values: list[int], what: str) -> list[int]:
        return list(values)


class MPICollective:
    """mpi4py non-blocking collectives polled until a timeout, so a dead rank ends the wait with a message
    instead of a hang."""

    def __init__(self, comm: Any, timeout_s: float = 600.0) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout_s = timeout_s

    def _wait(self, request: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
        while not request.Test():
            if time.monotonic() > deadline:
                raise RuntimeFailure(
                    f"rank {self.rank}: {what}: no answer from the other {self.size - 1} rank(s) within "
                    f"{self.timeout_s:g} s (a rank died or is stuck; see its log)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def barrier(self, what: str) -> None:
        self._wait(self.comm.Ibarrier(), what)

    def allreduce_max(self, values: list[int], what: str) -> list[int]:
        import numpy as np
        from mpi4py import MPI

        send = np.asarray(values, dtype=np.int64)
        recv = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, recv, op=MPI.MAX), what)
        return [int(v) for v in recv]
