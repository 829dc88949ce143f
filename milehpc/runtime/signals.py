"""The checkpoint/requeue contract between the job script (batch shell) and the ranks.

Why a file and not a signal to the ranks: Slurm's ``--signal=B:USR1@<lead>`` reaches only the batch shell, NCCL
may intercept USR1 inside ranks, a signal that arrives before a rank installed its handler kills the rank, and
``mpirun``/``srun``/``apptainer`` forward signals differently. A file in the shared run directory works the same
under all of them. The contract, precisely:

Paths (``RUN_DIR`` = the run directory, shared by all nodes; ``CTL = RUN_DIR/.milehpc``):

1. ``CTL/checkpoint-request`` (:data:`REQUEST_FILE`) — **the request**. Its existence is the request; its
   content is free text (who asked, when). The job script removes a stale one *before* it starts the ranks,
   and creates it (``: > "$CTL/checkpoint-request"``) from its trap on ``USR1`` (Slurm's wall-time warning,
   ``--signal=B:USR1@checkpoint.signal_lead_s``), ``TERM`` (preemption) and, for the local script, ``INT``.
2. The ranks poll at every **step boundary**: only rank 0 looks at the file (one ``stat`` per step, not one
   per rank: no metadata storm on Lustre); its answer is agreed across *all* ranks by one MPI allreduce (the
   same one that agrees on interval checkpoints, :meth:`Checkpointer.at_step_end`), so every rank checkpoints
   after the same step.
3. The ranks then write a checkpoint (collective, atomic: :mod:`milehpc.checkpoint`). After it is
   committed rank 0 writes ``CTL/checkpointed`` (:data:`CHECKPOINTED_FILE`: JSON ``{"step", "checkpoint", "time",
   "restart_count"}``) and deletes the request file.
4. Every rank exits with **:data:`EXIT_REQUEUE` = 75** ("checkpointed, requeue me"; EX_TEMPFAIL). Exit 0 means
   the run finished (a request that arrives during the last step is ignored: nothing is left to do; rank 0 then
   touches ``CTL/step-done``, ``milehpc.render.script.DONE_FILE``, so that the script can tell a real finish from
   a launcher that exited 0 without running the ranks); any other code is a failure.
5. The job script waits for the launch step (``wait`` returns early when a trapped signal arrives: wait again
   until the step itself has ended), and if its status is 75 and ``SLURM_RESTART_COUNT`` (0 on the first run)
   is below ``checkpoint.max_restarts``, runs ``scontrol requeue "$SLURM_JOB_ID"``; otherwise it exits with
   the status (75 then tells the user to ``milehpc submit --resume RUN_DIR``). Only a job that Slurm still
   has RUNNING is requeued: after ``scancel`` it is COMPLETING, and Slurm would requeue even that (measured,
   22.05), so the script asks ``scontrol show job`` first; it then says how to resume and exits 75, as it does
   when Slurm refuses the requeue.
6. A restarted job knows it is one: ``SLURM_RESTART_COUNT`` (Slurm), exported to the ranks as
   ``MILEHPC_RESTART_COUNT`` (:func:`restart_count`); with ``checkpoint.resume`` on (the default) the ranks load
   the newest complete checkpoint whether or not this is a restart, so ``milehpc submit --resume`` needs
   nothing more than resubmitting the same script.
7. **A manual stop** (``milehpc stop JOBID|RUN_DIR``, :mod:`milehpc.scheduler.stop` on the login node)
   creates ``CTL/stop-request`` (:data:`STOP_FILE`) *and then* the request of 1. The ranks cannot tell it from
   a requeue request and need not: they checkpoint and exit 75 as in 3-4. The script, once the step has ended, finds the stop file, removes it
   and, for status 75, exits **0 without requeueing**, printing ``milehpc submit --resume RUN_DIR``; for any
   other status it goes on as without it. The script also removes a stale stop file before it starts the ranks.
8. **TERM to the ranks** (``scancel`` signals the batch shell *and* every task of the job's steps, then sends
   KILL ``KillWait`` seconds later; ``srun`` forwards TERM too): each rank turns TERM into the request of 1
   (:func:`install_rank_handlers`, called by ``milehpc launch`` before anything else) instead of dying, so the
   ranks checkpoint at their next step boundary — within ``KillWait``, or the checkpoint is lost (the previous
   complete one stays: commits are atomic). The script never kills the ranks: it waits for the step to end.
   Caveat, measured with Open MPI 5.0 (PyPI wheel): an ``mpirun`` that itself gets TERM forwards it and
   SIGKILLs its ranks about 3-4 s later, and exits 1 — under an ``mpirun`` launcher only a checkpoint that
   commits within those seconds survives a TERM; the request file (``milehpc stop``) has no such limit.

The job script side is rendered from ``sbatch/_prologue.sh.j2`` / ``job.sbatch.j2`` (they use the same
path and exit code, re-exported by ``milehpc.render.script``). :func:`forward_signals` does the job script's
part inside a Python process (a local launcher, tests).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from milehpc.errors import MilehpcError

CONTROL_DIR = ".milehpc"
REQUEST_FILE = f"{CONTROL_DIR}/checkpoint-request"
STOP_FILE = f"{CONTROL_DIR}/stop-request"
CHECKPOINTED_FILE = f"{CONTROL_DIR}/checkpointed"
EXIT_REQUEUE = 75


def request_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / REQUEST_FILE


def checkpointed_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTED_FILE


def request_checkpoint(run_dir: str | os.PathLike[str], reason: str = "requested") -> Path:
    """Ask the ranks of the run in ``run_dir`` to checkpoint and exit 75 at their next step boundary."""
    path = request_path(run_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{reason} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def clear_request(run_dir: str | os.PathLike[str]) -> None:
    """Remove a stale request (before starting the ranks)."""
    request_path(run_dir).unlink(missing_ok=True)


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was requeued: ``SLURM_RESTART_COUNT`` or ``MILEHPC_RESTART_COUNT``, else 0."""
    env = os.environ if env is None else env
    for key in ("SLURM_RESTART_COUNT", "MILEHPC_RESTART_COUNT"):
        value = env.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 0


class RequestWatcher:
    """The ranks' side of the contract. ``requested()`` is cheap and rank-local (only the polling rank —
    rank 0 by default — touches the file system); agree on it with the checkpointer's allreduce."""

    def __init__(self, run_dir: str | os.PathLike[str], *, rank: int, poll: bool | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.poll = rank == 0 if poll is None else poll

    def requested(self) -> bool:
        return self.poll and request_path(self.run_dir).exists()

    def acknowledge(self, step: int, checkpoint: str | os.PathLike[str]) -> None:
        """After the requeue checkpoint is committed: rank 0 records it and consumes the request."""
        if self.rank != 0:
            return
        done = checkpointed_path(self.run_dir)
        done.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        record: dict[str, Any] = {"step": step, "checkpoint": str(checkpoint), "time": time.time(),
                                  "restart_count": restart_count()}
        tmp = done.with_name(f".{done.name}.tmp")
        tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
        os.replace(tmp, done)
        request_path(self.run_dir).unlink(missing_ok=True)


def forward_signals(run_dir: str | os.PathLike[str],
                    signums: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM)) -> dict[int, Any]:
    """Make this (launcher) process turn ``signums`` into a checkpoint request for ``run_dir``, as the job
    script's trap does. Returns the previous handlers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        request_checkpoint(run_dir, f"signal {signal.Signals(signum).name}")

    return {s: signal.signal(s, handler) for s in signums}


def install_rank_handlers(run_dir: str | os.PathLike[str]) -> dict[int, Any]:
    """A rank's side of contract item 8: TERM (``scancel``, preemption, ``mpirun`` forwarding it) becomes a
    checkpoint request instead of killing the rank mid-step or mid-commit. Returns the previous handlers."""
    return forward_signals(run_dir, (signal.SIGTERM,))


class RequeueExit(MilehpcError):
    """Raised on every rank after the requeue checkpoint is committed; the process exits with 75."""

    exit_code = EXIT_REQUEUE
