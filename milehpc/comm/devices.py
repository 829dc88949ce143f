"""Which accelerator a rank drives, honouring what Slurm (or the launcher) already made visible.

Slurm restricts each task with ``CUDA_VISIBLE_DEVICES`` (NVIDIA) or ``ROCR_VISIBLE_DEVICES`` (AMD); the runtime
then renumbers the visible devices from 0. We never write physical ids into a second variable: on AMD, HIP (and
HIP's ``CUDA_VISIBLE_DEVICES``) index into the list ROCr already filtered, so setting them to the same physical
ids filters twice and leaves zero GPUs (the failure the Frontier user guide warns about). When we find such a
double filter, we drop the redundant variable instead. The choice is a pure function (testable without a GPU);
``bind_device`` applies it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from milehpc.errors import RuntimeFailure

if TYPE_CHECKING:
    import torch

    from milehpc.plan import Plan

# In the order the runtime applies them: ROCr filters first, HIP (or CUDA_* under HIP) indexes into what is left.
_VARS = {"nvidia": ("CUDA_VISIBLE_DEVICES",),
         "amd": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}


@dataclass(frozen=True)
class DeviceChoice:
    """The device a rank should use: ``index`` among the devices the runtime will show this process."""

    kind: str  # "cpu" | "cuda" (torch calls ROCm/HIP devices "cuda" too)
    index: int | None
    physical: str | None  # the id as the scheduler named it, for logs
    unset: tuple[str, ...] = ()  # visibility variables to remove (they would filter a second time)
    why: str = ""


def parse_visible(value: str | None) -> list[str] | None:
    """``None`` when unset (everything visible), else the listed ids (``""`` means none)."""
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def local_rank_from_env(environ: MutableMapping[str, str], default: int) -> int:
    """The launcher's node-local rank (Slurm, Open MPI, MPICH/PMI), else the plan's."""
    for var in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        value = environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return default


def choose_device(vendor: str, local_rank: int, ranks_per_node: int,
                  environ: MutableMapping[str, str]) -> DeviceChoice:
    """Pick this rank's device from the visibility the scheduler set (pure: reads ``environ`` only)."""
    if vendor == "none":
        return DeviceChoice("cpu", None, None, why="the site has no GPUs")
    if vendor not in _VARS:
        raise RuntimeFailure(f"unknown device vendor {vendor!r} (expected nvidia, amd or none)")
    unset: list[str] = []
    first, *later = _VARS[vendor]
    visible = parse_visible(environ.get(first))
    if vendor == "amd":
        if visible is not None:
            renumbered = [str(i) for i in range(len(visible))]
            for var in later:
                ids = parse_visible(environ.get(var))
                # Same physical ids in a second variable: a double filter (unless they are already 0..n-1).
                if ids is not None and ids == visible and ids != renumbered:
                    unset.append(var)
        else:
            for var in later:  # no ROCr filter: the first HIP-level variable is the one that counts
                visible = parse_visible(environ.get(var))
                if visible is not None:
                    first = var
                    break
    if visible is not None and not visible:
        raise RuntimeFailure(f"{first} is set but empty: the scheduler gave this rank no GPU "
                             f"(check --gpus-per-task / --gpus-per-node in the job script)")
    if visible is None:
        # Nothing filtered: every rank sees the node's GPUs; take ours by node-local rank.
        return DeviceChoice("cuda", local_rank, str(local_rank), tuple(unset),
                            f"no {first}: node-local rank {local_rank}")
    if len(visible) == 1:
        return DeviceChoice("cuda", 0, visible[0], tuple(unset), f"{first}={visible[0]} (bound by the scheduler)")
    if len(visible) >= ranks_per_node and local_rank < len(visible):
        # Per-node binding: every task sees all of the node's GPUs.
        return DeviceChoice("cuda", local_rank, visible[local_rank], tuple(unset),
                            f"{first} lists the node's {len(visible)} GPUs: node-local rank {local_rank}")
    return DeviceChoice("cuda", 0, visible[0], tuple(unset), f"{first}={','.join(visible)}: first of this task's GPUs")


def bind_device(plan: Plan, rank: int, environ: MutableMapping[str, str] | None = None) -> torch.device:
    """Choose, apply (drop double filters, ``torch.cuda.set_device``) and return this rank's torch device."""
    import torch

    env = os.environ if environ is None else environ
    local = local_rank_from_env(env, plan.local_rank(rank))
    choice = choose_device(plan.device_vendor, local, plan.ranks_per_node, env)
    if choice.kind == "cpu":
        return torch.device("cpu")
    for var in choice.unset:  # before the first CUDA/HIP call initialises the runtime
        env.pop(var, None)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice.index is None or choice.index >= count:
        seen = ", ".join(f"{v}={env.get(v)!r}" for v in _VARS[plan.device_vendor])
        raise RuntimeFailure(f"rank {rank} should drive GPU {choice.index} ({choice.why}) but torch sees "
                             f"{count} GPU(s) ({seen})")
    torch.cuda.set_device(choice.index)
    return torch.device("cuda", choice.index)
