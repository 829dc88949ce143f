"""Weights to elastic engines: per join, an update group of two (trainer rank 0 as group rank 0, the engine as 1) built
SGLang's way on a fresh name over the TCPStore trainer rank 0 hosts (:func:`milehpc.weights.sglang
.join_update_group`), and per sync the model in flat buckets laid out as SGLang's flattened-bucket receiver takes
them (:func:`milehpc.rollout.sglang_mapping.flatten_bucket`), one broadcast each.

Who receives them is the engine's own update path, as on separate rollout ranks: an engine that takes the bytes
itself (its plugin says ``direct_weight_sync``: SGLang's schedulers, vLLM's workers) joins the group and loads each
bucket (``join_update_group`` / ``receive_bucket`` / ``finish_update``); any other engine's process joins the group,
receives the buckets and hands the tensors to ``update_weights``. A dropped engine's group is aborted; the others'
are untouched."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import JobSpec
    from milehpc.runtime.loop.rollout_side import RolloutSide
    from milehpc.weights.converters import NamedTensors

Buckets = list[tuple[dict[str, list], "torch.Tensor"]]  # (names/dtypes/shapes, the flat uint8 bytes) per bucket
GROUP_SIZE = 2  # trainer rank 0 and one engine
ENGINE_RANK = 1


def pack(named: NamedTensors, bucket_bytes: int) -> Buckets:
    """The weights as flat CPU buckets of at most ``bucket_bytes`` (a bigger tensor alone), kept for engines that
    join later: copies, never views of the trainer's parameters (the optimizer changes those in place)."""
    from milehpc.rollout import sglang_mapping as sm

    out: Buckets = []
    for bucket in sm.buckets(((n, t.detach()) for n, t in named), bucket_bytes):
        flat, meta = sm.flatten_bucket(bucket)
        out.append((meta, flat.to("cpu", copy=len(bucket) == 1)))  # a bucket of one is that tensor's own bytes
    return out


def _layout(meta: dict[str, list]) -> list[tuple[str, Any, list[int], int]]:
    """(name, torch dtype, shape, bytes) of each tensor of a bucket, in the bucket's order."""
    import math

    import torch

    out = []
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"], strict=True):
        dt = getattr(torch, dtype)
        out.append((name, dt, list(shape), math.prod(shape) * torch.empty((), dtype=dt).element_size()))
    return out


def bucket_bytes(meta: dict[str, list]) -> int:
    return sum(n for *_, n in _layout(meta))


def unflatten(meta: dict[str, list], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One bucket's tensors again (views of ``flat``), in the bucket's order."""
    out, at = [], 0
    for name, dtype, shape, nbytes in _layout(meta):
        out.append((name, flat[at:at + nbytes].view(dtype).reshape(shape)))
        at += nbytes
    return out


def trainer_group(store: Any, name: str, backend: str, timeout: float, device: Any = None) -> Any:
    """Trainer rank 0's end of one engine's update group; blocks until the engine joined or ``timeout``."""
    from milehpc.weights.sglang import join_update_group

    return join_update_group(store, world_size=GROUP_SIZE, rank=0, group_name=name, backend=backend,
                             timeout=timeout, device=device)


def drop_group(pg: Any) -> None:
    """Give up a dropped engine's group (NCCL: aborted, so no kernel waits for the dead peer)."""
    from milehpc.weights.sglang import abort_update_group

    abort_update_group(pg)


def start_broadcast(pg: Any, buf: torch.Tensor) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([buf], opts)


def wait(work: Any, timeout: float, what: str) -> None:
    """Wait for a broadcast with a deadline (polling: a dead peer must not hold the caller longer)."""
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"{what}: not complete after {timeout:.0f} s")
        time.sleep(0.002)
    try:
        work.wait()
    except RuntimeError as err:
        raise RuntimeFailure(f"{what}: {str(err).splitlines()[0] if str(err) else err!r}") from None


class Receiver:
    """An elastic engine's end: ``("group", address, port, name, backend)`` and ``("weights", version, metas)``
    (the bucket broadcasts follow on the group, in order) through the engine's own update path (module
    docstring)."""

    def __init__(self, job: JobSpec, side: RolloutSide, engine_id: int, timeout: float) -> None:
        from milehpc.weights.sync import direct_weight_sync

        self.side, self.engine_id, self.timeout = side, engine_id, timeout
        self.direct = direct_weight_sync(job)
        self.store: Any = None
        self.group: Any = None

    def join(self, address: str, port: int, name: str, backend: str) -> None:
        engine: Any = self.side.engine
        if self.direct:
            engine.join_update_group(master_address=address, master_port=int(port), world_size=GROUP_SIZE,
                                     stage=0, backend=backend, group_name=name)
            return
        from torch.distributed import TCPStore

        from milehpc.weights.sglang import join_update_group

        if self.store is None:
            self.store = TCPStore(address, int(port), GROUP_SIZE, False, timedelta(seconds=self.timeout))
        if self.group is not None:
            drop_group(self.group)
        self.group = join_update_group(self.store, world_size=GROUP_SIZE, rank=ENGINE_RANK, group_name=name,
                                       backend=backend, timeout=self.timeout)

    def receive(self, version: int, metas: list[dict[str, list]]) -> None:
        engine: Any = self.side.engine
        if self.direct:
            engine.begin_update(version)
            for meta in metas:
                engine.receive_bucket(meta, stage=0)
            engine.finish_update(version)
            self.side.state.weight_version = version
            return
        import torch

        named: list[tuple[str, torch.Tensor]] = []
        for k, meta in enumerate(metas):
            flat = torch.empty(bucket_bytes(meta), dtype=torch.uint8)
            wait(start_broadcast(self.group, flat), self.timeout,
                 f"engine {self.engine_id}: weights {version}, bucket {k + 1} of {len(metas)}")
            named += unflatten(meta, flat)
        self.side.update_weights(named, version)
