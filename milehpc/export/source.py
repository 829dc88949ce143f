"""What an export reads: the run's job, the checkpoint to export (the newest complete one, or ``--step N``) and the
trainer state in it — trainer rank 0's, or every trainer rank's model shards joined when FSDP2 sharded them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milehpc.checkpoint import Checkpointer, CheckpointInfo, checkpoint_root, list_checkpoints, rank_file
from milehpc.checkpoint.files import sha256_file
from milehpc.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import JobSpec


@dataclass
class Source:
    """One checkpoint of one run, and trainer rank 0's trainer state in it (``state_dict_for_checkpoint``)."""

    run_dir: Path
    job: JobSpec
    info: CheckpointInfo
    trainer: dict[str, Any]

    @property
    def weight_version(self) -> int:
        return int(self.info.meta.get("weight_version", self.trainer.get("version", 0)))

    @property
    def trainer_ranks(self) -> int:
        parallel = (self.info.manifest.get("layout") or {}).get("parallel") or {}
        return int(parallel.get("trainer_ranks", 1))

    def parallel(self) -> dict[str, Any]:
        """The rank layout the checkpoint was written at (tp/pp/dp/ep...), for the provenance record."""
        return dict((self.info.manifest.get("layout") or {}).get("parallel") or {})


def pick_checkpoint(run_dir: Path, job: JobSpec, step: int | None) -> CheckpointInfo:
    """The newest complete checkpoint of the run, or the one of ``step``; one line naming the steps there are
    otherwise."""
    root = checkpoint_root(job, run_dir)
    found = list_checkpoints(root, warn=True)
    if not found:
        raise ConfigError("expected a committed checkpoint (step-N with a manifest), got none", file=str(root))
    if step is None:
        return found[0]
    for info in found:
        if info.step == step:
            return info
    steps = ", ".join(str(i.step) for i in sorted(found, key=lambda i: i.step))
    raise ConfigError(f"expected one of the run's checkpoint steps ({steps}), got {step}", file=str(root),
                      field="--step")


def _verified(info: CheckpointInfo, rank: int) -> None:
    """The checksum of ``rank``'s shard (a bit flipped on disk would export a silently different model)."""
    name = rank_file(rank, "pt")
    want = info.manifest["files"].get(name, {}).get("sha256")
    if want is not None and sha256_file(info.path / name) != want:
        raise ConfigError(f"{name}: sha256 differs from the manifest's: the checkpoint is damaged; export another "
                          "step (--step)", file=str(info.path))


def _trainer_state(ckpt: Checkpointer, info: CheckpointInfo, rank: int) -> dict[str, Any]:
    _verified(info, rank)
    # FSDP2 shards are DTensors: torch.load(weights_only=True) accepts them once their module is imported.
    import torch.distributed.tensor  # noqa: F401

    # Unpickling a DTensor's device mesh without process groups warns about torch.compile; nothing here compiles.
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        state = ckpt.load(info, source_rank=rank).state
    finally:
        mesh_log.setLevel(level)
    if "trainer" not in state:
        raise ConfigError(f"expected trainer state in {rank_file(rank, 'pt')} (a trainer rank's shard), got "
                          f"{sorted(state)}", file=str(info.path))
    return state["trainer"]["trainer"]


def load_source(run_dir: str | Path, step: int | None = None) -> Source:
    from milehpc.config.load import run_job

    run_dir = Path(run_dir)
    job = run_job(run_dir)
    info = pick_checkpoint(run_dir, job, step)
    return Source(run_dir, job, info, _trainer_state(Checkpointer(info.path.parent), info, 0))


def full_model_state(source: Source) -> dict[str, torch.Tensor]:
    """The torch trainer's policy weights (HF names), whole: as saved under DDP (every rank holds them all), or
    joined from the trainer ranks' FSDP2 shards (``Shard(d)`` DTensors, concatenated along ``d`` in mesh order)."""
    from torch.distributed.tensor import DTensor

    model = source.trainer["model"]
    if not any(isinstance(t, DTensor) for t in model.values()):
        return dict(model)
    ckpt = Checkpointer(source.info.path.parent)
    shards = [model] + [_trainer_state(ckpt, source.info, r)["model"] for r in range(1, source.trainer_ranks)]
    return {name: _join(name, [s[name] for s in shards]) for name in model}


def _join(name: str, parts: list[Any]) -> torch.Tensor:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    first = parts[0]
    if not isinstance(first, DTensor):
        return first
    (placement,) = first.placements  # FSDP2 over the trainer ranks: a 1-D mesh
    if isinstance(placement, Replicate):
        return first.to_local()
    if not isinstance(placement, Shard):
        raise ConfigError(f"expected FSDP2 shards (Shard or Replicate), got {placement} for {name}")
    mesh = [int(r) for r in first.device_mesh.mesh.tolist()]
    if sorted(mesh) != list(range(len(parts))):
        raise ConfigError(f"expected {name} sharded over the {len(parts)} trainer ranks, got mesh {mesh}")
    full = torch.cat([parts[r].to_local() for r in mesh], dim=placement.dim)
    if tuple(full.shape) != tuple(first.shape):
        raise ConfigError(f"joining the FSDP2 shards of {name} gave {tuple(full.shape)}, expected "
                          f"{tuple(first.shape)}")
    return full
