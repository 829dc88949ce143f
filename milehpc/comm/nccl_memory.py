"""The trainer's NCCL communicator memory, released while the colocated engine generates.

NCCL communicators allocate their buffers (channels, proxy FIFOs, often hundreds of MiB per communicator on a large
group) outside PyTorch's caching allocator, so pausing the trainer's torch_memory_saver region leaves them in place.
NCCL 2.29.7 added ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` / ``ncclCommResume``, which PyTorch exposes as
``Backend.suspend()`` / ``Backend.resume()`` (``ProcessGroupNCCL::suspend`` raises "requires NCCL 2.29.7+" on an
older NCCL; gloo "does not support suspend"; torch 2.11's ProcessGroupNCCL has no ``suspend`` at all). megatron-core
0.16.1 has no communicator offload of its own.

:class:`CommunicatorMemory` has the interface of :class:`milehpc.runtime.offload.ReloadableGroups` (``release`` /
``restore``), so the colocated driver takes it as its ``groups``: released with the trainer's memory, restored before
training resumes. It covers every process group of this process whose CUDA backend is NCCL (the default group,
Megatron's groups), found in torch's registry at release time. Under the device check on the CPU the groups that
stand for NCCL are suspended in the stand-in (:func:`milehpc.comm.devcheck.suspend`): an operation on one before
``restore`` fails there as it would on a suspended communicator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def registered_groups() -> list[Any]:
    """Every ProcessGroup of this process that torch knows of (default group first)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if not dist.is_initialized():
        return []
    return list(_world.pg_map)


def _nccl_backend(group: Any) -> Any:
    """The NCCL backend of ``group`` (None if it has none)."""
    import torch
    import torch.distributed as dist

    try:
        if "nccl" not in str(dist.get_backend(group)).lower():
            return None
        return group._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError):  # no CUDA backend registered on it
        return None


class CommunicatorMemory:
    """Suspend (``release``) and resume (``restore``) the NCCL communicators of this process's process groups."""

    def __init__(self, groups: Callable[[], list[Any]] = registered_groups) -> None:
        self.groups = groups
        self.suspended: list[tuple[Any, Callable[[], None]]] = []  # (group, its resume)
        self.unsupported: str | None = None  # why suspend is not available here (said once)

    def release(self) -> None:
        from milehpc.comm import devcheck

        if self.suspended or self.unsupported:
            return
        for group in self.groups():
            if devcheck.simulating():
                if devcheck.stands_for_nccl(group):
                    devcheck.suspend(group)
                    self.suspended.append((group, lambda g=group: devcheck.resume(g)))
                continue
            backend = _nccl_backend(group)
            if backend is None:
                continue
            try:
                backend.suspend()
            except (AttributeError, RuntimeError) as err:  # torch < 2.13 has no suspend (2.11's ProcessGroupNCCL,
                # seen on an H200); NCCL < 2.29.7 refuses it: nothing to release with, the buffers stay
                self.unsupported = str(err).splitlines()[0] if str(err) else repr(err)
                log.warning("the trainer's NCCL buffers stay on the GPU during rollout: %s", self.unsupported)
                break
            self.suspended.append((group, backend.resume))

    def restore(self) -> None:
        while self.suspended:
            _, resume = self.suspended.pop()
            resume()
