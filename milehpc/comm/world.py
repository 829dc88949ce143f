"""One MPI world, split into trainer and rollout groups, and the torch.distributed groups built on it (no Ray).

``bootstrap(plan, job)`` runs on every rank:

1. a timed start-up barrier (names the ranks that never started), pid/host exchange, the liveness watchdog;
2. ``COMM_WORLD.Split`` into the trainer, rollout, per-engine and reward-model communicators (colocated: every
   trainer rank is also a rollout rank; reward ranks are neither);
3. the device (honouring Slurm's visibility variables) and the torch.distributed *default* group = the trainer
   ranks only, so Megatron's parallel_state sees world = tp * pp * dp. Rank 0 hosts its TCPStore on a port seeded
   by the job id and checked free by binding it, and sends address and port over MPI;
4. one standalone weight-sync process group per pipeline stage (the stage leader + every rollout rank), each with
   its own TCPStore hosted by the stage leader, as slime/verl build their weight-update groups and as SGLang's
   ``init_weights_update_group`` expects (so an out-of-process engine can join the same group over NCCL).

Control messages (small, pickled) go over a private duplicate of COMM_WORLD with nonblocking sends and matched
probes polled against a deadline: every wait has a timeout (``resources.collective_timeout_s``) and knows, per
peer, who it is still waiting for. A rank that dies or freezes is found sooner by the watchdog (runtime/watchdog.py;
heartbeat timeout ``min(collective_timeout_s, 60)`` s, or ``MILEHPC_HEARTBEAT_TIMEOUT``), which ends every rank
with a message naming it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from milehpc.comm.net import host_store, resolve_address
from milehpc.comm.watchdog import Peer, Watchdog, failed_ranks, this_peer
from milehpc.errors import RuntimeFailure

if TYPE_CHECKING:
    import torch

    from milehpc.config.job import JobSpec
    from milehpc.plan import Plan

TAG_GATHER, TAG_BCAST = 31011, 31012
RECEIVER_SLACK_S = 5.0  # receivers wait this much longer than senders, so they hear the sender's verdict first


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:16])
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def make_backend(backend: str, store: Any, rank: int, size: int, timeout: float) -> Any:
    """A standalone torch.distributed backend object (not registered as the default group)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise RuntimeFailure(f"unknown torch.distributed backend {backend!r} (expected nccl or gloo)")


@dataclass
class WeightSyncGroup:
    """One weight-update group: group rank 0 is the source (a pipeline stage's leader), then the rollout ranks."""

    stage: int
    source: int  # world rank
    ranks: list[int]  # world ranks, source first
    rank: int  # this process's world rank
    name: str
    backend: str
    address: str
    port: int
    device: Any
    pg: Any = field(repr=False)
    store: Any = field(repr=False)
    comms: Comms = field(repr=False)
    version: int = -1  # the last weight version sent (source) or received (rollout)
    buffers: list[Any] = field(default_factory=list, repr=False)  # two byte buffers during a sync (weights.broadcast)

    @property
    def group_rank(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_source(self) -> bool:
        return self.rank == self.source

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from the source into ``tensor`` on every member; returns the Work to ``wait``."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def wait(self, work: Any, what: str, timeout: float | None = None) -> None:
        """Wait for a broadcast with a deadline; a dead or stuck member ends it with a message naming the rank.

        Polls ``work.is_completed()`` (and, between polls, whether another rank reported a failure), then a plain
        ``work.wait()`` that raises the backend's error, if any. Never ``work.wait(timeout)``: NCCL's
        ``WorkNCCL::wait`` measures that timeout from the enqueue and, once past, aborts the communicator and
        throws (ProcessGroupNCCL.cpp, ``WorkNCCL::checkTimeout`` / ``synchronizeInternal``), so waiting in short
        slices would kill every bucket still in flight a slice after it was queued."""
        timeout = self.comms.timeout if timeout is None else timeout
        peers = [r for r in self.ranks if r != self.rank]
        self.comms.poll(work.is_completed, timeout,
                        lambda: f"{what}: not complete after {timeout:.0f} s (group of {_ranks_text(peers)})",
                        lambda: peers)
        try:
            work.wait()
        except RuntimeError as err:  # the op failed (a peer died: let the watchdog say who)
            raise self.comms.explain(err, what) from None


# The longest sleep between polls. A waiting rank (the rollout rank between generations, the trainer before a batch)
# answers at most this late: the trainer's weight sync waits for it every step, so 10 ms cost ~5% of a CPU demo step;
# 2 ms costs ~1% of a core in improbes while idle.
POLL_MAX_S = 0.002


@dataclass
class Comms:
    """Everything a rank needs to talk to the others. MPI sub-communicators are None where this rank is not a member."""

    world: Any
    rank: int
    size: int
    plan: Plan
    ctrl: Any  # private duplicate of COMM_WORLD for milehpc's own control messages
    watchdog: Watchdog
    peers: list[Peer]
    timeout: float
    trainer: Any = None
    rollout: Any = None
    engine: Any = None
    reward: Any = None  # the reward-model ranks' own ([reward_model] ranks of their own)
    device: Any = None
    backend: str = "gloo"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    store: Any = None
    sync_groups: dict[int, WeightSyncGroup] = field(default_factory=dict)

    # ---- roles ------------------------------------------------------------
    @property
    def is_trainer(self) -> bool:
        return self.plan.is_trainer(self.rank)

    @property
    def is_rollout(self) -> bool:
        return self.plan.is_rollout(self.rank)

    @property
    def is_reward(self) -> bool:
        return self.plan.is_reward(self.rank)

    # ---- failure handling -------------------------------------------------
    def check(self) -> None:
        """Raise if any rank failed (seen here or by a notice from another rank)."""
        if self.watchdog.failure is not None:
            raise RuntimeFailure(self.watchdog.failure)

    def fail(self, message: str, ranks: Sequence[int] = ()) -> RuntimeFailure:
        """Record a failure, tell every other rank (so they end too) and return the error to raise."""
        self.watchdog.declare(message, set(ranks))
        return RuntimeFailure(self.watchdog.failure or message)

    def explain(self, err: BaseException, what: str) -> RuntimeFailure:
        """A backend error (gloo/NCCL) usually means a peer died: give the watchdog time to name it."""
        deadline = time.monotonic() + self.watchdog.dead_after + 4 * self.watchdog.interval
        while self.watchdog.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.watchdog.failure is not None:
            return RuntimeFailure(f"{what}: {self.watchdog.failure}")
        return self.fail(f"{what} failed on rank {self.rank}: {str(err).splitlines()[0] if str(err) else err!r}")

    def poll(self, done: Callable[[], bool], timeout: float, on_timeout: Callable[[], str],
             culprits: Callable[[], Sequence[int]] = lambda: ()) -> None:
        """Wait until ``done()`` with a deadline, ending early if any rank failed."""
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while True:
            try:
                if done():
                    return
            except Exception as err:  # noqa: BLE001 - with ULFM, MPI raises when a peer is gone
                dead = failed_ranks(self.ctrl)
                if dead:
                    raise self.fail(f"{_ranks_text(sorted(dead))} gone (MPI reports the process failed)",
                                    sorted(dead)) from None
                raise self.explain(err, on_timeout().split(":")[0]) from None
            self.check()
            if time.monotonic() > deadline:
                raise self.fail(on_timeout(), culprits())
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    # ---- timed MPI helpers (world ranks; default: every rank) -------------
    def _members(self, ranks: Sequence[int] | None) -> list[int]:
        members = list(range(self.size)) if ranks is None else list(ranks)
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not in the group {members}")
        return members

    def _recv_from(self, src: int, tag: int, timeout: float, what: str) -> Any:
        box: list[Any] = []

        def probe() -> bool:
            msg = self.ctrl.improbe(src, tag)
            if msg is not None:
                box.append(msg.recv())
            return bool(box)

        self.poll(probe, timeout + RECEIVER_SLACK_S,
                  lambda: f"{what}: rank {self.rank} heard nothing from rank {src} within "
                          f"{timeout + RECEIVER_SLACK_S:.0f} s", lambda: [src])
        return box[0]

    def bcast(self, obj: Any, root: int = 0, ranks: Sequence[int] | None = None, *, what: str = "broadcast",
              timeout: float | None = None) -> Any:
        """Broadcast a picklable object from world rank ``root`` to ``ranks``."""
        members = self._members(ranks)
        timeout = self.timeout if timeout is None else timeout
        if self.rank != root:
            return self._recv_from(root, TAG_BCAST, timeout, what)
        reqs = {r: self.ctrl.isend(obj, r, TAG_BCAST) for r in members if r != root}

        def sent() -> bool:
            for r in [r for r, req in reqs.items() if req.Test()]:
                del reqs[r]
            return not reqs

        self.poll(sent, timeout, lambda: f"{what}: {_ranks_text(list(reqs))} did not take the message from "
                                         f"rank {root} within {timeout:.0f} s", lambda: list(reqs))
        return obj

    def gather(self, obj: Any, root: int = 0, ranks: Sequence[int] | None = None, *, what: str = "gather",
               timeout: float | None = None) -> list[Any] | None:
        """Gather picklable objects at ``root`` (in the order of ``ranks``); None elsewhere."""
        members = self._members(ranks)
        timeout = self.timeout if timeout is None else timeout
        if self.rank != root:
            req = self.ctrl.isend(obj, root, TAG_GATHER)
            self.poll(req.Test, timeout + RECEIVER_SLACK_S,
                      lambda: f"{what}: rank {root} did not collect from rank {self.rank}", lambda: [root])
            return None
        got: dict[int, Any] = {root: obj}
        waiting = [r for r in members if r != root]

        def collect() -> bool:
            for r in list(waiting):
                msg = self.ctrl.improbe(r, TAG_GATHER)
                if msg is not None:
                    got[r] = msg.recv()
                    waiting.remove(r)
            return not waiting

        self.poll(collect, timeout, lambda: f"{what}: {_ranks_text(waiting)} did not arrive within {timeout:.0f} s "
                                            f"(dead or stuck)", lambda: list(waiting))
        return [got[r] for r in members]

    def allgather(self, obj: Any, ranks: Sequence[int] | None = None, *, what: str = "allgather",
                  timeout: float | None = None) -> list[Any]:
        members = self._members(ranks)
        out = self.gather(obj, members[0], members, what=what, timeout=timeout)
        return self.bcast(out, members[0], members, what=what, timeout=timeout)

    def barrier(self, ranks: Sequence[int] | None = None, *, what: str = "barrier",
                timeout: float | None = None) -> None:
        self.allgather(None, ranks, what=what, timeout=timeout)

    # ---- shutdown ---------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Clean end: a timed barrier (names the missing ranks), then stop the watchdog and the groups."""
        self.barrier(what="shutdown", timeout=timeout)
        self.watchdog.stop()
        import torch.distributed as dist

        for group in self.sync_groups.values():
            with contextlib.suppress(Exception):  # backends without shutdown
                group.pg.shutdown()
        self.sync_groups.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        for comm in (self.reward, self.engine, self.rollout, self.trainer):
            if comm is not None:
                comm.Free()


def bootstrap(plan: Plan, job: JobSpec, *, run_id: str | None = None, master_addr: str | None = None,
              world: Any = None, heartbeat_timeout: float | None = None) -> Comms:
    """Bring up the communicators and process groups of ``plan`` on this rank (collective over the world)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD if world is None else world
    rank, size = world.Get_rank(), world.Get_size()
    if size != plan.world_size:
        raise RuntimeFailure(f"expected an MPI world of {plan.world_size} ranks (the plan's world_size), got {size}")
    timeout = float(job.resources.collective_timeout_s)
    if heartbeat_timeout is None:
        heartbeat_timeout = float(os.environ.get("MILEHPC_HEARTBEAT_TIMEOUT", min(timeout, 60.0)))
    run_id = run_id or os.environ.get("SLURM_JOB_ID") or os.environ.get("MILEHPC_RUN_ID") or plan.job_name
    mode = master_addr or ("127.0.0.1" if plan.nodes == 1 else "hostname")

    # A watchdog-less Comms on COMM_WORLD for the start-up barrier: it names ranks that never started.
    starter = Watchdog(world, [this_peer(rank)] * size, dead_after=heartbeat_timeout)
    early = Comms(world=world, rank=rank, size=size, plan=plan, ctrl=world, watchdog=starter, peers=[],
                  timeout=timeout)
    peers = early.allgather(this_peer(rank), what="start-up (waiting for every rank to start)")
    # Import torch before the watchdog starts: loading its C extension holds the GIL for seconds, which would
    # silence this rank's heartbeat and make its neighbour think it is gone.
    import torch.distributed  # noqa: F401

    ctrl, hb = world.Dup(), world.Dup()
    dog = Watchdog(hb, peers, dead_after=heartbeat_timeout)
    dog.start()
    comms = Comms(world=world, rank=rank, size=size, plan=plan, ctrl=ctrl, watchdog=dog, peers=peers,
                  timeout=timeout, backend=plan.backend)
    try:
        _split(comms, MPI)
        from milehpc.comm.devices import bind_device

        comms.device = bind_device(plan, rank)
        _init_default_group(comms, run_id, mode)
        for spec in plan.weight_sync_groups():
            if rank in spec["ranks"]:
                group = _init_sync_group(comms, spec, run_id, mode)
                comms.sync_groups[group.stage] = group
        comms.barrier(what="bootstrap")
    except RuntimeFailure:
        raise
    except Exception as err:  # noqa: BLE001 - a backend failing to connect: name the rank if one is gone
        raise comms.explain(err, "bootstrap") from err
    return comms


def _split(comms: Comms, MPI: Any) -> None:
    plan, rank, world = comms.plan, comms.rank, comms.world

    def split(member: bool, color: int = 0) -> Any:
        comm = world.Split(color if member else MPI.UNDEFINED, rank)
        return None if comm == MPI.COMM_NULL else comm

    comms.trainer = split(plan.is_trainer(rank))
    comms.rollout = split(plan.is_rollout(rank))
    comms.engine = split(plan.is_rollout(rank), plan.engine_of(rank)[0] if plan.is_rollout(rank) else 0)
    comms.reward = split(plan.is_reward(rank))


def _init_default_group(comms: Comms, run_id: str, mode: str) -> None:
    """torch.distributed's default group over the trainer ranks (world ranks 0..T-1 = group ranks)."""
    import torch.distributed as dist

    plan = comms.plan
    trainers = list(plan.trainer_group())
    if comms.rank not in trainers:
        return
    store = None
    if comms.rank == 0:
        addr = resolve_address(mode)
        store, port = host_store(addr, run_id, len(trainers), comms.timeout)
        where = (addr, port)
    else:
        where = None
    addr, port = comms.bcast(where, 0, trainers, what="torch.distributed rendezvous address")
    if store is None:
        from torch.distributed import TCPStore

        store = TCPStore(addr, port, len(trainers), False, timedelta(seconds=comms.timeout))
    comms.master_addr, comms.master_port, comms.store = addr, port, store
    kwargs: dict[str, Any] = {}
    if comms.backend == "nccl" and comms.device is not None and comms.device.type == "cuda":
        kwargs["device_id"] = comms.device
    dist.init_process_group(comms.backend, store=store, rank=comms.rank, world_size=len(trainers),
                            timeout=timedelta(seconds=comms.timeout), **kwargs)


def _init_sync_group(comms: Comms, spec: dict[str, Any], run_id: str, mode: str) -> WeightSyncGroup:
    from torch.distributed import PrefixStore, TCPStore

    stage, source, ranks = int(spec["stage"]), int(spec["source"]), list(spec["ranks"])
    name = f"milehpc-weight-sync-{stage}"
    store = None
    if comms.rank == source:
        addr = resolve_address(mode)
        store, port = host_store(addr, f"{run_id}/{name}", len(ranks), comms.timeout)
        where = (addr, port)
    else:
        where = None
    addr, port = comms.bcast(where, source, ranks, what=f"weight-sync group {stage} address")
    if store is None:
        store = TCPStore(addr, port, len(ranks), False, timedelta(seconds=comms.timeout))
    group_rank = ranks.index(comms.rank)
    pg = make_backend(comms.backend, PrefixStore(name, store), group_rank, len(ranks), comms.timeout)
    return WeightSyncGroup(stage=stage, source=source, ranks=ranks, rank=comms.rank, name=name,
                           backend=comms.backend, address=addr, port=port, device=comms.device, pg=pg,
                           store=store, comms=comms)
