"""What every rank's entry point receives: the job, the rank layout, the communicators and the run directory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from milehpc.comm.world import Comms
    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan


@dataclass
class RunContext:
    job: JobSpec
    plan: Plan
    comms: Comms
    run_dir: Path
    restart_count: int = 0  # SLURM_RESTART_COUNT: how many times this job was requeued
    partition: dict[str, Any] = field(default_factory=dict)  # the site partition (site.json), when the CLI wrote it

    @property
    def rank(self) -> int:
        return self.comms.rank

    @property
    def is_trainer(self) -> bool:
        return self.comms.is_trainer

    @property
    def is_rollout(self) -> bool:
        return self.comms.is_rollout
