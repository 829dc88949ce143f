"""Weight sync from the trainer's stage leaders straight into SGLang's TP schedulers (separate-ranks layouts).

SGLang's side of the update group is built by ``Engine.init_weights_update_group`` in every TP scheduler:
a TCP rendezvous at ``master_address:master_port`` as rank ``rank_offset + tp_rank``, the store wrapped in
``PrefixStore(group_name, store)``, then ``torch.distributed.distributed_c10d._new_process_group_helper`` and
registration in ``_world.pg_group_ranks`` (``init_custom_process_group`` in sgl-project/sglang
``python/sglang/srt/utils/common.py``; slime and OpenRLHF copy the same recipe for their trainer side).
The trainer's stage leader joins as rank 0 the same way (:func:`join_update_group`), but hosts the TCPStore itself
on a port seeded by the job id and checked free (:func:`milehpc.comm.net.host_store`), so nothing blocks until
all workers have arrived.

One sync (:func:`sync_weights`): first every stage's group, ``("group", address, port, world size, name)`` (a new
one) or ``("keep",)``, so that no rendezvous is left waiting once bytes move; then per pipeline stage, in stage order:

1. stage leader → engine leaders (MPI, timed): ``("bucket", {names, dtypes, shapes})``;
2. engine leaders call ``update_weights_from_distributed(names, dtypes, shapes, group,
   load_format="flattened_bucket", flush_cache=True)`` while the stage leader broadcasts the whole bucket as one
   flat uint8 tensor from rank 0 (:func:`milehpc.rollout.sglang_mapping.flatten_bucket`; NCCL, the wait has the
   job's timeout). The flush inside the request resets the radix cache without the allocator clean-up of a
   separate ``flush_cache`` call (a full ``gc.collect()`` in SGLang's CPU scheduler: 0.5-1 s, against ~0.03 s
   for the rest of a sync of the CPU demo's model);
3. after the last bucket ``("done", version)``; the engine closes its weight-update session;
4. every engine leader tells every stage leader whether its whole sync succeeded; stage 0's leader broadcasts the
   verdict.

A restarted engine cannot rejoin a live NCCL group, so at the start of a sync the engine leaders report whether they
need a group; if any does, every stage's group is rebuilt (old groups destroyed on both sides, the new one under a
new name and port) before the bytes move.

**A scheduler that dies during a sync** (:func:`sync_weights` retries): the engine leader's request fails (milehpc's
watcher sees the child die) and it tells every stage leader over MPI (``TAG_SYNC_FAILED``); the stage leader's
broadcast ends either by the backend's error (gloo raises on a closed peer) or by that message (NCCL never returns
from a broadcast to a dead peer: the communicator is aborted, ``ProcessGroup.abort`` = ``ncclCommAbort``); the
collective timeout stays the last resort (the job fails). The stage leader then sends ``("abort", version)`` in
place of ``"done"`` and the verdict (step 4) is a failure. Then the dead engine restarts in place (counted against
``rollout.options.max_restarts``), every stage rebuilds its group and the same version is sent again to every
engine (an engine that had taken it loads the same bytes again), at most :data:`MAX_ATTEMPTS` times. NCCL needs
more than gloo on the engine side: SGLang 0.5.23 has no request that aborts a scheduler's communicator, so a
surviving scheduler whose receive waits behind the dead one is expected to end by NCCL's watchdog at its group's
timeout and then be restarted like the dead one (not exercised on a CPU: the tests run gloo). An engine that fails
to close its weight-update session after the last bucket (``finish_update``) fails the attempt the same way. A
failure while an engine joins a new group (``init_weights_update_group``) is not retried: the rendezvous cannot be
completed without it, so the rank's error ends the job. A broadcast the backend refuses at the enqueue (NCCL: a tensor
not on the trainer's GPU) breaks the attempt the same way, so the engines hear ``"abort"`` at once instead of waiting
inside ``update_weights_from_distributed`` until their timeout; the buckets go from the trainer's device
(:func:`milehpc.comm.collectives.collective_device` of the group), whatever device the trainer exported them on.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure
from milehpc.rollout import sglang_mapping as sm
from milehpc.rollout.sglang_engine import log

if TYPE_CHECKING:
    from milehpc.comm.world import Comms

TAG_SYNC_FAILED = 32120  # engine leader -> stage leaders: (attempt, reason), its engine failed during that attempt
MAX_ATTEMPTS = 4  # of one sync (each failed attempt costs an engine restart, bounded by max_restarts as well)


class SyncBroken(Exception):
    """This stage's update group broke during a sync (a member died or reported failure); the sync is redone."""


def join_update_group(store: Any, *, world_size: int, rank: int, group_name: str, backend: str,
                      timeout: float, device: Any = None) -> Any:
    """Join an update group built SGLang's way (see the module docstring) on an already-connected ``store``.
    ``device``: this rank's GPU (a CUDA torch.device), declared into the group's store so that the device check
    (:func:`milehpc.comm.devcheck.check_group_devices`) can refuse two members on one GPU as NCCL does."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    from milehpc.comm import devcheck

    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"  # renamed in torch 2.6
    prefixed = PrefixStore(group_name, store)
    if device is not None and getattr(device, "type", None) == "cuda" and device.index is not None:
        devcheck.declare_device(prefixed, rank, device.index)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefixed,
                                      group_name=group_name, timeout=timedelta(seconds=timeout), **{options: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_update_group(pg: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # a group whose peers died may refuse a clean destroy
        dist.destroy_process_group(pg)


def abort_update_group(pg: Any) -> None:
    """Give up a group whose broadcast cannot complete. NCCL: ``ncclCommAbort`` (``ProcessGroup.abort``) ends the
    kernels waiting for a dead peer, which a plain destroy would wait for; gloo returns at once (its pending send
    times out in gloo's own thread). Then the group is unregistered."""
    from torch.distributed.distributed_c10d import _abort_process_group

    with contextlib.suppress(Exception):
        _abort_process_group(pg)
    leave_update_group(pg)


class StageSender:
    """The trainer stage leader's end of one stage's update group."""

    def __init__(self, comms: Comms, stage: int, leaders: list[int], world_size: int, backend: str) -> None:
        self.comms, self.stage, self.leaders = comms, stage, leaders
        self.world_size, self.backend = world_size, backend
        self.pg: Any = None
        self.store: Any = None
        self.generation = 0  # groups built so far: each rebuild has a new name (sm.group_name)

    @property
    def members(self) -> list[int]:
        return [self.comms.rank, *self.leaders]

    def setup(self, run_id: str) -> None:
        from milehpc.comm.net import host_store, resolve_address

        self.drop()
        plan = self.comms.plan
        addr = resolve_address("127.0.0.1" if plan.nodes == 1 else "hostname")
        name = sm.group_name(self.stage, self.generation)
        self.generation += 1
        self.store, port = host_store(addr, f"{run_id}/{name}/{id(self)}", self.world_size, self.comms.timeout)
        self.comms.bcast(("group", addr, port, self.world_size, name), self.comms.rank, self.members,
                         what=f"SGLang update group {self.stage} address")
        self.pg = join_update_group(self.store, world_size=self.world_size, rank=0, group_name=name,
                                    backend=self.backend, timeout=self.comms.timeout, device=self.comms.device)

    def drop(self, *, abort: bool = False) -> None:
        """Leave this stage's group (``abort``: it broke mid-broadcast); the next sync builds a new one."""
        if self.pg is not None:
            (abort_update_group if abort else leave_update_group)(self.pg)
            self.pg = None

    def send(self, named: Any, version: int, bucket_bytes: int, attempt: int) -> tuple[int, str | None]:
        """Broadcast ``named`` (HF names, this stage's full tensors on the device) bucket by bucket, each bucket as one
        flat uint8 tensor (:func:`sglang_mapping.flatten_bucket`: one collective per bucket, not one per tensor);
        returns (the bytes sent, why the group broke or None). A broken group is aborted and the rest of the
        buckets is not sent: the engine leaders get ``("abort", version)`` instead of ``("done", version)``.

        Double-buffered (issue 33): bucket k+1 is exported and packed into one of two reused buffers while bucket k
        is on the wire from the other (a fresh buffer per bucket costs its page faults on a CPU, and packing after
        the broadcast put the export on the sync's critical path); the buffers are released after the sync."""
        from milehpc.comm.collectives import collective_device

        total, broken = 0, None
        # NCCL takes CUDA tensors only: the bucket goes from the trainer's device (a no-op for tensors exported there;
        # a copy for any that a trainer left on the host). gloo: the CPU.
        device = collective_device(self.pg)
        buffers: list[Any] = [None, None]
        in_flight: _InFlight | None = None  # the broadcast of the bucket before
        try:
            for k, bucket in enumerate(sm.buckets(named, bucket_bytes)):
                flat, meta = sm.flatten_bucket(bucket, out=lambda n, dev, slot=k % 2: _reused(buffers, slot, n, dev))
                flat = flat.to(device)
                total += self._finish(in_flight, attempt)
                in_flight = None
                self.comms.bcast(("bucket", meta), self.comms.rank, self.members,
                                 what=f"weight bucket metadata (stage {self.stage})")
                in_flight = self._start(flat)
            total += self._finish(in_flight, attempt)
        except SyncBroken as err:
            broken = str(err)
        if broken is not None:
            self.drop(abort=True)
            for _ in named:  # the rest of a lazy export: its gathers are collectives the TP peers are in
                pass
        buffers.clear()
        self.comms.bcast(("abort" if broken else "done", version), self.comms.rank, self.members,
                         what=f"end of weight sync (stage {self.stage})")
        return total, broken

    def _start(self, flat: Any) -> _InFlight:
        """Start one broadcast of ``flat`` from rank 0 of the update group."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            return _InFlight(self.pg.broadcast([flat], opts), flat, int(flat.numel()))
        except Exception as err:  # noqa: BLE001 - refused at the enqueue (NCCL: a tensor it cannot take): the engines
            # wait inside update_weights_from_distributed, so they must hear "abort", not be left to their timeout
            raise SyncBroken(f"the broadcast could not start: {str(err).splitlines()[0][:200]}") from err

    def _finish(self, in_flight: _InFlight | None, attempt: int) -> int:
        """Wait for a broadcast (returns its bytes; 0 for none), polled so that a dead peer ends it: by the backend's
        error, by an engine leader's failure report over MPI (:data:`TAG_SYNC_FAILED`), or, as the last resort, by
        the collective timeout (which fails the job)."""
        if in_flight is None:
            return 0
        work = in_flight.work
        reports: list[str] = []

        def over() -> bool:
            if work.is_completed():
                return True
            reports.extend(failure_reports(self.comms, self.leaders, attempt))
            return bool(reports)

        self.comms.poll(over, self.comms.timeout,
                        lambda: f"weight broadcast to SGLang (stage {self.stage}) not complete after "
                                f"{self.comms.timeout:.0f} s", lambda: self.leaders)
        if reports:
            raise SyncBroken("; ".join(reports))
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001 - gloo: "Connection closed by peer" when a scheduler died
            raise SyncBroken(f"the broadcast failed: {str(err).splitlines()[0][:200]}") from err
        return in_flight.nbytes


@dataclass
class _InFlight:
    work: Any
    flat: Any  # the bytes on the wire: kept alive (and their buffer not refilled) until the work is done
    nbytes: int


def _reused(buffers: list[Any], slot: int, nbytes: int, device: Any) -> Any:
    """``nbytes`` of the sender's buffer ``slot`` on ``device``, grown (never shrunk) within one sync."""
    import torch

    buf = buffers[slot]
    if buf is None or buf.numel() < nbytes or buf.device != device:
        buf = buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes]


def failure_reports(comms: Comms, leaders: list[int], attempt: int) -> list[str]:
    """The engine leaders' failure reports of sync attempt ``attempt`` that have arrived (older ones dropped)."""
    out = []
    for r in leaders:
        while (msg := comms.ctrl.improbe(r, TAG_SYNC_FAILED)) is not None:
            got, reason = msg.recv()
            if got == attempt:
                out.append(f"engine leader {r}: {reason}")
    return out


def report_failure(comms: Comms, sources: list[int], attempt: int, reason: str) -> None:
    """Tell every stage leader that this engine's sync attempt ``attempt`` failed (their broadcast may be waiting for
    this engine); the send is waited for under the collective timeout (a stage leader that is gone ends the job)."""
    reqs = [comms.ctrl.isend((attempt, reason), r, TAG_SYNC_FAILED) for r in sources]
    comms.poll(lambda: all(req.Test() for req in reqs), comms.timeout,
               lambda: f"sync failure report to the stage leaders not sent after {comms.timeout:.0f} s",
               lambda: sources)


def engine_receive(comms: Comms, engine: Any, sources: list[int], leaders: list[int], version: int,
                   attempt: int) -> tuple[int, str | None]:
    """On an engine leader: take one sync of ``version`` (sync attempt ``attempt``) from every stage source in stage
    order. Returns (the version, why this engine's sync failed or None). A failure (the engine died, SGLang refused
    a bucket, a stage's broadcast broke, the session did not close) is reported to every stage leader at once; the
    rest of the sync's messages are still taken, without the engine."""
    failed: str | None = None

    def fail(why: str) -> None:
        nonlocal failed
        if failed is None:
            failed = (why.splitlines() or [""])[0][:200]  # one short line: it travels over MPI and into logs
            report_failure(comms, sources, attempt, failed)

    engine.begin_update(version)
    # Every stage's group first, then the bytes: a death during the bytes never leaves a rendezvous waiting.
    for stage, source in enumerate(sources):
        kind, *rest = comms.bcast(None, source, [source, *leaders], what=f"update group of stage {stage}")
        if kind == "group":
            addr, port, world, name = rest
            engine.join_update_group(master_address=addr, master_port=port, world_size=world, stage=stage,
                                     backend=comms.backend, group_name=name)
    for stage, source in enumerate(sources):
        while True:
            kind, *rest = comms.bcast(None, source, [source, *leaders], what=f"weight sync from stage {stage}")
            if kind == "bucket":
                if failed is None:
                    try:
                        engine.receive_bucket(rest[0], stage=stage)
                    except RuntimeFailure as err:
                        fail(str(err))
                continue
            version = int(rest[0])  # done / abort
            if kind == "abort":
                fail(f"stage {stage}'s broadcast broke")
            break
    if failed is None:
        try:
            engine.finish_update(version)
        except RuntimeFailure as err:  # redone like a failed bucket
            fail(str(err))
    elif engine.health():  # close its update session; the attempt is redone, the weights are not this version's
        with contextlib.suppress(RuntimeFailure):
            engine.finish_update(-1)
    return version, failed


_SENDERS: dict[int, dict[int, StageSender]] = {}  # per Comms object: this rank's stage senders between syncs
_ATTEMPTS: dict[int, int] = {}  # per Comms object: sync attempts so far (the same count on every sync member)


def sync_weights(comms: Comms, version: int, *, named_tensors: Any = None, engine: Any = None,
                 bucket_bytes: int = 512 << 20, converter: Any = None, timeout: float | None = None,
                 run_id: str = "milehpc", again: Any = None) -> dict[str, float]:
    """Drop-in for :func:`milehpc.weights.sync.sync_weights` when the engine receives the bytes itself (SGLang on
    separate ranks; :func:`milehpc.weights.sync.direct_weight_sync`): call on every rank. Stage leaders send
    ``named_tensors`` (their stage's HF-named weights; a callable gets the stage), engine leaders have SGLang receive
    them, other ranks return. ``converter`` maps trainer names/layouts to HF ones; ``timeout`` is the comms'.
    A sync that broke (see the module docstring) is redone: the dead engine restarted, every group rebuilt.

    ``again``: a lazy export made collectively by the trainer ranks (Megatron's gathers; issue 33: it is sent as it
    is made, never held whole): every trainer rank calls this with its own ``named_tensors`` (the other ranks' are
    drained), and a redone sync exports again on every trainer rank (``again()``), told by stage 0's verdict.
    Without it ``named_tensors`` is listed once and sent again as it is.
    """
    import time

    plan = comms.plan
    sources = [g["source"] for g in plan.weight_sync_groups()]
    leaders = plan.engine_leaders()
    followers = [r for r in plan.trainer_group() if r not in sources] if again is not None else []
    if comms.rank in followers:
        return _follow(comms, sources[0], named_tensors, again, [sources[0], *leaders, *followers])
    if comms.rank not in sources and comms.rank not in leaders:
        return {}
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    tensors = None
    if comms.rank in sources:
        stage = sources.index(comms.rank)
        tensors = named_tensors(stage) if callable(named_tensors) else named_tensors
        if tensors is None:
            raise ValueError(f"rank {comms.rank} leads stage {stage}: it needs named_tensors")
        tensors = converter(tensors) if converter else tensors
        if again is None:
            tensors = list(tensors)  # sent again if the sync breaks
    elif engine is None:
        raise ValueError(f"rank {comms.rank} leads an engine: it needs the engine")
    for attempt in range(MAX_ATTEMPTS):
        n = _ATTEMPTS[id(comms)] = _ATTEMPTS.get(id(comms), -1) + 1
        if comms.rank in sources:
            ok, nbytes = _send_attempt(comms, sources.index(comms.rank), leaders, tensors, version, bucket_bytes,
                                       run_id, n, earlier_tries=attempt, followers=followers)
            metrics.update({"sync/bytes": float(nbytes), "sync/attempts": float(attempt + 1)})
            if not ok and again is not None and attempt + 1 < MAX_ATTEMPTS:
                tensors = converter(again()) if converter else again()
        else:
            ok = _receive_attempt(comms, engine, sources, leaders, version, n, redo=attempt > 0,
                                  followers=followers)
        if ok:
            break
    else:
        raise RuntimeFailure(f"the weight sync of version {version} into SGLang failed {MAX_ATTEMPTS} times")
    dt = time.perf_counter() - t0
    metrics["time/weight_sync"] = dt
    if "sync/bytes" in metrics:
        metrics["sync/gbps"] = metrics["sync/bytes"] / max(dt, 1e-9) / 1e9
    return metrics


def _follow(comms: Comms, source: int, named: Any, again: Any, members: list[int]) -> dict[str, float]:
    """A trainer rank that leads no stage, in a collective export: take part in each attempt's export (keeping
    nothing) until stage 0's verdict says the sync went through."""
    for _ in range(MAX_ATTEMPTS):
        for _ in named:
            pass
        if comms.bcast(None, source, members, what="weight sync verdict"):
            return {}
        named = again()
    raise RuntimeFailure(f"the weight sync into SGLang failed {MAX_ATTEMPTS} times (told by rank {source})")


def _send_attempt(comms: Comms, stage: int, leaders: list[int], tensors: Any, version: int,
                  bucket_bytes: int, run_id: str, attempt: int, *, earlier_tries: int,
                  followers: list[int]) -> tuple[bool, int]:
    """A stage leader's part of one sync attempt (``attempt``: counted over all syncs, the failure reports' tag;
    ``earlier_tries``: this sync's failed attempts before it): (whether every engine took every stage, bytes sent)."""
    failure_reports(comms, leaders, attempt)  # drop reports of earlier attempts
    members = [comms.rank, *leaders]
    flags = comms.gather(None, comms.rank, members, what=f"engine group check (stage {stage})")
    senders = _SENDERS.setdefault(id(comms), {})
    sender = senders.get(stage)
    if sender is None:
        sender = senders[stage] = StageSender(comms, stage, leaders, 1 + comms.plan.rollout_ranks, comms.backend)
    if sender.pg is None or earlier_tries or any(flags[1:]):
        sender.setup(run_id)
    else:
        comms.bcast(("keep",), comms.rank, members, what=f"SGLang update group {stage} kept")
    nbytes, broken = sender.send(tensors, version, bucket_bytes, attempt)
    results = comms.gather(None, comms.rank, members, what=f"engine sync results (stage {stage})")[1:]
    failures = [f"engine leader {r}: {why}" for r, why in zip(leaders, results, strict=True) if why]
    ok = not failures and broken is None
    if stage == 0:
        comms.bcast(ok, comms.rank, members + followers, what="weight sync verdict")
    if not ok:
        sender.drop(abort=True)  # a clean destroy may block (NCCL, a dead peer) wherever the attempt failed
        log(f"weight sync of version {version} (stage {stage}, attempt {earlier_tries + 1}) failed: "
             f"{'; '.join(failures) or broken}; rebuilding the update groups and sending it again")
    return ok, nbytes


def _receive_attempt(comms: Comms, engine: Any, sources: list[int], leaders: list[int], version: int,
                     attempt: int, *, redo: bool, followers: list[int]) -> bool:
    """An engine leader's part of one sync attempt; a dead engine is restarted before the attempt."""
    if redo and not engine.health():
        engine.restart()  # counted; raises once rollout.options.max_restarts is used up
    need = redo or engine.needs_weight_sync or not engine.update_groups
    for stage, source in enumerate(sources):
        comms.gather(need, source, [source, *leaders], what=f"engine group check (stage {stage})")
    _, failed = engine_receive(comms, engine, sources, leaders, version, attempt)
    for stage, source in enumerate(sources):
        comms.gather(failed, source, [source, *leaders], what=f"engine sync results (stage {stage})")
    return bool(comms.bcast(None, sources[0], [sources[0], *leaders, *followers], what="weight sync verdict"))
