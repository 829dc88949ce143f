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
  the manifest is committed (the directory is still a temporary one).
"""

from __future__ import annotations

import os
import signal
from functools import lru_cache

from milehpc.errors import ConfigError

POINTS = ("generate", "broadcast", "optimizer", "commit")


@lru_cache(maxsize=1)
def _armed(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    point, _, step = spec.partition(":")
    if point not in POINTS or not step.isdigit():
        raise ConfigError(f"MILEHPC_FAULT={spec!r}: expected POINT:STEP with POINT one of {', '.join(POINTS)}")
    return point, int(step)


def maybe_fail(point: str, step: int) -> None:
    """Die here (SIGKILL) when ``MILEHPC_FAULT`` names this point and step."""
    armed = _armed(os.environ.get("MILEHPC_FAULT", ""))
    if armed == (point, step):
        os.kill(os.getpid(), signal.SIGKILL)
