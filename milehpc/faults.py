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
  killed instead of the rank, as when a scheduler dies of a kernel fault; the rank lives on and restarts the engine
  (a vLLM engine: its process is killed while it generates batch STEP, milehpc.rollout.vllm_engine);
* ``sync`` — an SGLang engine leader on separate rollout ranks, during the weight sync of version STEP (the
  trainer's broadcast of the first bucket is under way): its scheduler process is killed; the sync is redone;
* ``eval`` — an SGLang engine leader on separate rollout ranks, as it starts its share of the evaluation after
  step STEP: its scheduler process is killed; the engine restarts, is re-synced and evaluates again;
* ``scorer`` — a reward rank (``[reward_model]``), right after it hands a batch of step STEP's samples to its scorer
  process: that process is killed; the rank restarts it and scores the samples again (milehpc.rollout.scorer_process).

``POINT:STEP@RANK`` arms the point on MPI world rank RANK only (read from the launcher's environment); several
faults are separated by commas (``scheduler:1@3,sync:3@2``).
"""

from __future__ import annotations

import os
import signal
from functools import lru_cache

from milehpc.errors import ConfigError

POINTS = ("generate", "broadcast", "optimizer", "commit", "scheduler", "sync", "eval", "scorer")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


@lru_cache(maxsize=1)
def _armed(specs: str) -> frozenset[tuple[str, int]]:
    out = set()
    for spec in filter(None, (s.strip() for s in specs.split(","))):
        point, _, rest = spec.partition(":")
        step, _, rank = rest.partition("@")
        if point not in POINTS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ConfigError(f"MILEHPC_FAULT={specs!r}: expected POINT:STEP[@RANK][,...] with POINT one of "
                              f"{', '.join(POINTS)}")
        if rank and next((os.environ[v] for v in RANK_VARS if v in os.environ), None) != rank:
            continue  # armed on another rank
        out.add((point, int(step)))
    return frozenset(out)


def armed(point: str, step: int) -> bool:
    """True when ``MILEHPC_FAULT`` names this point and step (on this rank)."""
    return (point, step) in _armed(os.environ.get("MILEHPC_FAULT", ""))


def maybe_fail(point: str, step: int) -> None:
    """Die here (SIGKILL) when ``MILEHPC_FAULT`` names this point and step."""
    if armed(point, step):
        os.kill(os.getpid(), signal.SIGKILL)
