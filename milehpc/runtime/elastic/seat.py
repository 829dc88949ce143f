"""An elastic engine's place, as an engine plugin's factory reads it (``impl(ctx)``: the job, the plan, the
communicators, the run directory). The rollout ranks' factories are used as they are, so an elastic job runs the
engines they build that the job rules admit (config.rules.ELASTIC_ENGINES), each with its own weight path.

What differs from a rollout rank: the process is a world of one (no MPI: its job step is of its own, so a dead node
ends no other step), it drives the device its task was bound to, and its weight-update group holds only trainer
rank 0 (group rank 0) and this engine: in that group it is engine 0, so an engine's update-group rank (SGLang's
``rank_offset``, :func:`milehpc.rollout.sglang_mapping.rank_offset`) is 1 whatever the engine's id. Its rank is the
engine's id: what the factories make unique per engine with it (vLLM's model folder, the reference engine's
sampling stream) stays unique."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan
    from milehpc.rollout.engine import Engine


class SoloPlan:
    """The part of :class:`milehpc.plan.Plan` an engine factory reads, for one elastic engine (one process, one
    device, engine 0 of its update group; see the module docstring)."""

    gpus_per_engine = 1  # the job rules keep elastic engines to one process each
    colocated = False

    def __init__(self, plan: Plan, engine_id: int, device_index: int | None) -> None:
        self.nodes = plan.nodes
        self.device_vendor = plan.device_vendor
        self.engine_id = engine_id
        self._device_index = device_index

    def engine_of(self, rank: int) -> tuple[int, int]:
        return 0, 0

    def engine_leaders(self) -> list[int]:
        return [self.engine_id]

    def node_of(self, rank: int) -> int:
        return 0

    def device_index(self, rank: int) -> int | None:
        return self._device_index


@dataclass
class SoloComms:
    """The part of :class:`milehpc.comm.world.Comms` an engine factory reads: its rank (the engine's id), its device
    and the job's collective timeout. There is no MPI world to talk to."""

    rank: int
    device: torch.device
    timeout: float
    size: int = 1


def build_engine(job: JobSpec, plan: Plan, partition: dict[str, Any], run_dir: Path, engine_id: int) -> Engine:
    """Engine ``engine_id`` of an elastic job, built by the job's engine plugin on this task's device."""
    from milehpc import plugins
    from milehpc.comm.context import RunContext
    from milehpc.comm.devices import bind_device

    device = bind_device(plan, engine_id)  # the task's local id (SLURM_LOCALID) picks the GPU, as for any rank
    ctx = RunContext(job, SoloPlan(plan, engine_id, device.index), SoloComms(engine_id, device,  # type: ignore[arg-type]
                     float(job.resources.collective_timeout_s)), run_dir, partition=partition)
    factory = plugins.load("engine", job.rollout.engine, file=str(run_dir / "job.toml"), field="rollout.engine")
    return factory(ctx)
