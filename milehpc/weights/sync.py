"""One weight sync on every rank: the trainer's stage leaders send, the rollout ranks load what arrives into their
engine, colocated ranks load the trainer's tensors in place (see ``weights.broadcast`` for the wire protocol)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from milehpc.weights.broadcast import DEFAULT_BUCKET_BYTES, SyncStats, recv_weights_stream, send_weights
from milehpc.weights.converters import Converter, NamedTensors, identity
from milehpc.weights.inplace import WeightSink, load_in_place

if TYPE_CHECKING:
    from milehpc.comm.world import Comms
    from milehpc.config.job import JobSpec


class TimedExport:
    """An export iterated by the sync (gathered and converted as it is sent): ``seconds`` counts the time spent
    making its tensors, apart from the sending around it (the ``time/sync_export`` metric)."""

    def __init__(self, named: NamedTensors) -> None:
        self._it = iter(named)
        self.seconds = 0.0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self

    def __next__(self) -> tuple[str, Any]:
        t0 = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0

    def drain(self) -> None:
        """Iterate to the end, keeping nothing: a rank that sends nothing still takes part in a collective export."""
        for _ in self:
            pass


def direct_weight_sync(job: JobSpec) -> bool:
    """Separate rollout ranks whose engine receives the bytes into its own update group (its plugin says
    ``direct_weight_sync``): the sync is :func:`milehpc.weights.sglang.sync_weights`, not :func:`sync_weights`.
    Not with ``[trainer.lora]``: the adapter comes to the rollout rank, which hands it to the engine's LoRA API
    (:mod:`milehpc.rollout.sglang_lora`)."""
    from milehpc import plugins

    return (not job.resources.colocate and job.trainer.lora is None
            and plugins.lookup("engine", job.rollout.engine).direct_weight_sync)


def sync_weights(comms: Comms, version: int, *, named_tensors: NamedTensors | Callable[[int], NamedTensors] | None = None,
                 engine: WeightSink | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 converter: Converter | None = None, timeout: float | None = None) -> list[SyncStats]:
    """Call on every rank. Stage leaders send ``named_tensors`` (their stage's weights; a callable gets the stage),
    rollout ranks load what arrives into ``engine`` (stage by stage), other trainer ranks return at once.
    Colocated: the engine on this rank takes the trainer's tensors in place, no communication.
    Returns the stats of what this rank sent (empty elsewhere)."""
    convert = converter or identity
    sent: list[SyncStats] = []
    if comms.plan.colocated:
        if engine is None or named_tensors is None:
            raise ValueError("colocated weight sync needs both named_tensors and engine on every rank")
        load_in_place(engine, named_tensors(0) if callable(named_tensors) else named_tensors, version, convert)
        return sent
    for stage in sorted(comms.sync_groups):
        group = comms.sync_groups[stage]
        if group.is_source:
            if named_tensors is None:
                raise ValueError(f"rank {comms.rank} leads stage {stage}: it needs named_tensors")
            tensors = named_tensors(stage) if callable(named_tensors) else named_tensors
            sent.append(send_weights(group, tensors, version, bucket_bytes, converter=convert, timeout=timeout))
        else:
            if engine is None:
                raise ValueError(f"rank {comms.rank} is a rollout rank: it needs the engine")
            stream = recv_weights_stream(group, timeout)
            engine.update_weights(stream, stream.version)
            stream.drain()
    return sent
