"""Fault injection for the interruption tests: ``MILEHPC_FAULT="POINT:STEP"`` kills each process that reaches
``POINT`` at ``STEP`` with SIGKILL (every rank inherits the variable: under ``optimizer`` every trainer rank dies) —
no handler runs, no file is closed, as when a node dies or Slurm's KillWait expires. Unset (always, outside tests)
it costs one dictionary lookup per call.

Points, and what STEP counts there:

* ``generate`` — a rollout engine leader, before generating batch STEP;
* ``broadcast`` — the weight sender, after the header and before the buckets of weight version STEP;
* ``optimizer`` — a torch trainer rank (the Megatron trainer has no such point), after the gradients of optimizer
  step STEP (0-based) and before ``step()``;
* ``commit`` — checkpoint rank 0, after every shard of the checkpoint after STEP steps is written and before
  the manifest is committed (the directory is still a temporary one);
* ``scheduler`` — an SGLang engine leader, after generating its batch STEP (0-based): its scheduler process is
  killed instead of the rank, as when a scheduler dies of a kernel fault; the rank lives on and restarts the engine.

``POINT:STEP@RANK`` arms the point on MPI world rank RANK only (read from the launcher's environment).
"""

from __future__ import annotations

import os
import signal
from functools import lru_cache

from milehpc.errors import ConfigError

POINTS = ("generate", "broadcast", "optimizer", "commit", "scheduler")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


@lru_cache(maxsize=1)
def _armed(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    point, _, rest = spec.partition(":")
    step, _, rank = rest.partition("@")
    if point not in POINTS or not step.isdigit() or (rank and not rank.isdigit()):
        raise ConfigError(f"MILEHPC_FAULT={spec!r}: expected POINT:STEP[@RANK] with POINT one of "
                          f"{', '.join(POINTS)}")
    if rank and next((os.environ[v] for v in RANK_VARS if v in os.environ), None) != rank:
        return None  # armed on another rank
    return point, int(step)


def armed(point: str, step: int) -> bool:
    """True when ``MILEHPC_FAULT`` names this point and step (on this rank)."""
    return _armed(os.environ.get("MILEHPC_FAULT", "")) == (point, step)


def maybe_fail(point: str, step: int) -> None:
    """Die here (SIGKILL) when ``MILEHPC_FAULT`` names this point and step."""
    if armed(point, step):
        os.kill(os.getpid(), signal.SIGKILL)
