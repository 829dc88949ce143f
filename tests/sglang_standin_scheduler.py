"""Stand-in for SGLang's side of weight updates (sglang cannot be installed here), written from its source:

* ``init_custom_process_group`` (sgl-project/sglang python/sglang/srt/utils/common.py): TCP ``rendezvous`` as rank
  ``rank_offset + tp_rank``, ``store.set_timeout``, ``PrefixStore(group_name, store)``,
  ``_new_process_group_helper(world, rank, [], Backend(backend), store, group_name=..., timeout=...)``,
  ``_world.pg_group_ranks[pg] = {i: i}``;
* ``ModelRunner.update_weights_from_distributed``: per name, ``torch.empty(shape, dtype=getattr(torch, dtype))`` and
  a broadcast from rank 0 of the group, in the order of ``names``;
* ``Engine`` methods with SGLang's keyword names (python/sglang/srt/entrypoints/engine.py), answering
  ``(success, message)`` like the scheduler does.

Used by tests/test_sglang_sync.py (2 processes) and tests/sglang_mpi_entries.py (under mpirun). Imported by the test
processes only, with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any


def sglang_side_join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                     backend: str, timeout: float = 60.0) -> Any:
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timedelta(seconds=timeout)))
    store.set_timeout(timedelta(seconds=timeout))
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timedelta(seconds=timeout), **{options: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def sglang_side_receive(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    got = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=pg)
        got[name] = t
    return got


class SchedulerStandInEngine:
    """``sglang.Engine`` with a single TP scheduler living in this process (tp_size = 1)."""

    def __init__(self, **server_args: Any) -> None:
        from standin_gpu_stack.sglang_requests import attach

        attach(self)  # milehpc's weight-update requests reach the methods below
        self.server_args = server_args
        self.groups: dict[str, Any] = {}
        self.weights: dict[str, Any] = {}
        self.flushes = 0

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self.groups[group_name] = sglang_side_join(master_address, master_port, rank_offset, world_size,
                                                   group_name, backend)
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, group_name):
        import torch.distributed as dist

        dist.destroy_process_group(self.groups.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self.weights.update(sglang_side_receive(self.groups[group_name], names, dtypes, shapes))
        return True, "Succeeded to update parameter online."

    def get_weights_by_name(self, name, truncate_size=100):
        return self.weights[name].flatten()[:truncate_size].float().tolist()

    def flush_cache(self):
        self.flushes += 1
        return True

    def shutdown(self):
        import torch.distributed as dist

        for pg in self.groups.values():
            dist.destroy_process_group(pg)
        self.groups.clear()
