"""Weight sync from the trainer's stage leaders straight into SGLang's TP schedulers (separate-ranks layouts).

SGLang's side of the update group is built by ``Engine.init_weights_update_group`` in every TP scheduler:
a TCP rendezvous at ``master_address:master_port`` as rank ``rank_offset + tp_rank``, the store wrapped in
``PrefixStore(group_name, store)``, then ``torch.distributed.distributed_c10d._new_process_group_helper`` and
registration in ``_world.pg_group_ranks`` (``init_custom_process_group`` in sgl-project/sglang
``python/sglang/srt/utils/common.py``; slime and OpenRLHF copy the same recipe for their trainer side).
The trainer's stage leader joins as rank 0 the same way (:func:`join_update_group`), but hosts the TCPStore itself
on a port seeded by the job id and checked free (:func:`milehpc.comm.net.host_store`), so nothing blocks until
all workers have arrived.

One sync (:func:`sync_weights`), per pipeline stage, in stage order:

1. stage leader → engine leaders (MPI, timed): ``("bucket", {names, dtypes, shapes})``;
2. engine leaders call ``update_weights_from_distributed(names, dtypes, shapes, group,
   load_format="flattened_bucket", flush_cache=True)`` while the stage leader broadcasts the whole bucket as one
   flat uint8 tensor from rank 0 (:func:`milehpc.rollout.sglang_mapping.flatten_bucket`; NCCL, the wait has the
   job's timeout). The flush inside the request resets the radix cache without the allocator clean-up of a
   separate ``flush_cache`` call (a full ``gc.collect()`` in SGLang's CPU scheduler: 0.5-1 s, against ~0.03 s
   for the rest of a sync of the CPU demo's model);
3. after the last bucket ``("done", version)``; the engine closes its weight-update session.

A restarted engine cannot rejoin a live NCCL group, so at the start of a sync the engine leaders report whether they
need a group; if any does, every stage's group is rebuilt (old groups destroyed on both sides) before the bytes move.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from milehpc.rollout import sglang_mapping as sm

if TYPE_CHECKING:
    from milehpc.comm.world import Comms


def join_update_group(store: Any, *, world_size: int, rank: int, group_name: str, backend: str,
                      timeout: float) -> Any:
    """Join an update group built SGLang's way (see the module docstring) on an already-connected ``store``."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"  # renamed in torch 2.6
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timedelta(seconds=timeout), **{options: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_update_group(pg: Any) -> None:
    import contextlib

    import torch.distributed as dist

    with contextlib.suppress(Exception):  # a group whose peers died may refuse a clean destroy
        dist.destroy_process_group(pg)


class StageSender:
    """The trainer stage leader's end of one stage's update group."""

    def __init__(self, comms: Comms, stage: int, leaders: list[int], world_size: int, backend: str) -> None:
        self.comms, self.stage, self.leaders = comms, stage, leaders
        self.world_size, self.backend = world_size, backend
        self.pg: Any = None
        self.store: Any = None

    @property
    def members(self) -> list[int]:
        return [self.comms.rank, *self.leaders]

    def setup(self, run_id: str) -> None:
        from milehpc.comm.net import host_store, resolve_address

        if self.pg is not None:
            leave_update_group(self.pg)
            self.pg = None
        plan = self.comms.plan
        addr = resolve_address("127.0.0.1" if plan.nodes == 1 else "hostname")
        name = sm.group_name(self.stage)
        self.store, port = host_store(addr, f"{run_id}/{name}/{id(self)}", self.world_size, self.comms.timeout)
        self.comms.bcast(("group", addr, port, self.world_size), self.comms.rank, self.members,
                         what=f"SGLang update group {self.stage} address")
        self.pg = join_update_group(self.store, world_size=self.world_size, rank=0, group_name=name,
                                    backend=self.backend, timeout=self.comms.timeout)

    def send(self, named: Any, version: int, bucket_bytes: int) -> int:
        """Broadcast ``named`` (HF names, this stage's full tensors on the device) bucket by bucket, each bucket as one
        flat uint8 tensor (:func:`sglang_mapping.flatten_bucket`: one collective per bucket, not one per tensor);
        returns the bytes sent."""
        total = 0
        for bucket in sm.buckets(named, bucket_bytes):
            flat, meta = sm.flatten_bucket(bucket)
            self.comms.bcast(("bucket", meta), self.comms.rank, self.members,
                             what=f"weight bucket metadata (stage {self.stage})")
            self._broadcast(flat)
            total += flat.numel()
        self.comms.bcast(("done", version), self.comms.rank, self.members,
                         what=f"end of weight sync (stage {self.stage})")
        return total

    def _broadcast(self, flat: Any) -> None:
        """One broadcast from rank 0 of the update group, polled so that a dead peer ends it within the timeout."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = self.pg.broadcast([flat], opts)
        self.comms.poll(work.is_completed, self.comms.timeout,
                        lambda: f"weight broadcast to SGLang (stage {self.stage}) not complete after "
                                f"{self.comms.timeout:.0f} s", lambda: self.leaders)
        work.wait()


def engine_receive(comms: Comms, engine: Any, sources: list[int], leaders: list[int], version_hint: int | None = None
                   ) -> int:
    """On an engine leader: take one sync from every stage source in stage order; returns the new version."""
    version = version_hint if version_hint is not None else engine.weight_version()
    engine.begin_update()
    for stage, source in enumerate(sources):
        members = [source, *leaders]
        while True:
            kind, *rest = comms.bcast(None, source, members, what=f"weight sync from stage {stage}")
            if kind == "group":
                addr, port, world = rest
                engine.join_update_group(master_address=addr, master_port=port, world_size=world, stage=stage,
                                         backend=comms.backend)
            elif kind == "bucket":
                engine.receive_bucket(rest[0], stage=stage)
            else:  # done
                version = int(rest[0])
                break
    engine.finish_update(version)
    return version


_SENDERS: dict[int, dict[int, StageSender]] = {}  # per Comms object: this rank's stage senders between syncs


def sync_weights(comms: Comms, version: int, *, named_tensors: Any = None, engine: Any = None,
                 bucket_bytes: int = 512 << 20, converter: Any = None, timeout: float | None = None,
                 run_id: str = "milehpc") -> dict[str, float]:
    """Drop-in for :func:`milehpc.weights.sync.sync_weights` when the engine receives the bytes itself (SGLang on
    separate ranks; :func:`milehpc.weights.sync.direct_weight_sync`): call on every rank. Stage leaders send
    ``named_tensors`` (their stage's HF-named weights; a callable gets the stage), engine leaders have SGLang receive
    them, other ranks return. ``converter`` maps trainer names/layouts to HF ones; ``timeout`` is the comms'.
    """
    import time

    plan = comms.plan
    sources = [g["source"] for g in plan.weight_sync_groups()]
    leaders = plan.engine_leaders()
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    if comms.rank in sources:
        stage = sources.index(comms.rank)
        flags = comms.gather(None, comms.rank, [comms.rank, *leaders], what=f"engine group check (stage {stage})")
        senders = _SENDERS.setdefault(id(comms), {})
        sender = senders.get(stage)
        if sender is None or sender.pg is None or any(flags[1:]):
            sender = sender or StageSender(comms, stage, leaders, 1 + plan.rollout_ranks, comms.backend)
            senders[stage] = sender
            sender.setup(run_id)
        tensors = named_tensors(stage) if callable(named_tensors) else named_tensors
        if tensors is None:
            raise ValueError(f"rank {comms.rank} leads stage {stage}: it needs named_tensors")
        nbytes = sender.send(converter(tensors) if converter else tensors, version, bucket_bytes)
        dt = time.perf_counter() - t0
        metrics.update({"time/weight_sync": dt, "sync/bytes": float(nbytes), "sync/gbps": nbytes / max(dt, 1e-9) / 1e9})
    elif comms.rank in leaders:
        if engine is None:
            raise ValueError(f"rank {comms.rank} leads an engine: it needs the engine")
        need = engine.needs_weight_sync or not engine.update_groups
        for stage, source in enumerate(sources):
            comms.gather(need, source, [source, *leaders], what=f"engine group check (stage {stage})")
        engine_receive(comms, engine, sources, leaders, version)
        metrics["time/weight_sync"] = time.perf_counter() - t0
    return metrics
