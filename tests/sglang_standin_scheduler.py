"""SGLang's side of weight updates in this process: the joining and receiving are sglang's own code
(``init_custom_process_group``; ``WeightUpdater.receive_weights_from_distributed``, which with
``load_format="flattened_bucket"`` takes one uint8 broadcast per bucket); the stand-in is only the engine around
them (``Engine`` methods with SGLang's keyword names, python/sglang/srt/entrypoints/engine.py, answering
``(success, message)`` like the scheduler does), so several "engines" fit in MPI ranks without a scheduler process
each.

Used by tests/sglang_mpi_entries.py (under mpirun, for tests/test_sglang_sync.py). Imported by the test
processes only, with tests/ on PYTHONPATH.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def sglang_side_join(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                     backend: str, timeout: float = 60.0) -> Any:
    """SGLang's own ``init_custom_process_group``, called as its ``WeightUpdater.init_weights_update_group`` does."""
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                     timeout=timedelta(seconds=timeout), world_size=world_size, rank=rank,
                                     group_name=group_name)


def sglang_side_receive(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
                        load_format: str | None = None, group_name: str = "g") -> dict[str, Any]:
    """SGLang's own receiver: ``WeightUpdater.receive_weights_from_distributed`` (one uint8 broadcast per bucket
    with ``load_format="flattened_bucket"``), on a WeightUpdater that has only the update group."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    def unused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the receive path must not touch the model")

    # The group goes in through the private field: the public init_weights_update_group builds its own group and
    # asserts a default process group exists, which these MPI ranks (their trainer-side group is the peer) lack.
    updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                            get_model=unused, update_model_fields=unused, recapture_cuda_graph=unused,
                            get_model_runner=unused, _model_update_group={group_name: pg})
    return dict(updater.receive_weights_from_distributed(names=names, dtypes=dtypes, shapes=shapes,
                                                         group_name=group_name, load_format=load_format))


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
        self.weights.update(sglang_side_receive(self.groups[group_name], names, dtypes, shapes, load_format))
        if flush_cache:
            self.flush_cache()
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
