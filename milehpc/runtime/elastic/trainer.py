"""The trainer ranks' driver of an elastic-rollout job (see the package docstring): the separate-groups trainer
(:class:`~milehpc.runtime.loop.separate_trainer.SeparateTrainer`: warm-up, the optimizer step, checkpoints, the
other trainer ranks' shares over MPI) with trainer rank 0 dealing prompts to, and sending weights to, the engines
that joined over TCP instead of a fixed set of MPI ranks."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from milehpc.errors import RuntimeFailure
from milehpc.runtime.elastic import ADDRESS_FILE, LOST_FILE, SECRET_FILE
from milehpc.runtime.elastic import weights as ew
from milehpc.runtime.loop.protocol import TAG_NOTICE
from milehpc.runtime.loop.rollout_metrics import merge_rollout_stats, rollout_metrics
from milehpc.runtime.loop.separate_trainer import SeparateTrainer

if TYPE_CHECKING:
    from milehpc.comm.context import RunContext
    from milehpc.runtime.elastic.hub import Hub, Link
    from milehpc.runtime.loop.checkpointing import LoopCheckpoint
    from milehpc.samples import Group
    from milehpc.train.base import Trainer

WAIT_SLICE_S = 0.05


class ElasticTrainer(SeparateTrainer):
    """One trainer rank (see the module docstring); trainer rank 0 holds the :class:`~.hub.Hub`."""

    push_at_start = True  # every joining engine gets the trainer's weights; the first ones too

    def __init__(self, ctx: RunContext, trainer: Trainer, checkpointing: LoopCheckpoint, *, progress: bool) -> None:
        super().__init__(ctx, trainer, checkpointing, progress=progress)
        self.leaders, self.rollout_ranks = [], []  # no rollout rank in this world: the engines come over TCP
        self.latest: tuple[int, ew.Buckets] | None = None  # the last weights sent: what a joining engine gets
        self.hub: Hub | None = None
        self.store: Any = None
        self.address = ""  # trainer rank 0's: the engines' update groups meet at its store
        self.store_port = 0
        # Direct engines (SGLang, vLLM) receive on their device: NCCL on GPUs, as on separate rollout ranks; an
        # engine fed through update_weights receives in its process, on the CPU (gloo).
        self.group_backend = self.comms.backend if self.direct else "gloo"
        self.joins = 0
        self.run_dir = ctx.run_dir
        # Rank 0 may take a timeout per engine lost in a step (its silence), one for a stuck step and one wait for an
        # engine to join (:meth:`join_wait_s`), on top of the generation: the other trainer ranks wait that long.
        engines = ctx.job.rollout.engines + ctx.job.resources.spare_nodes * ctx.plan.ranks_per_node
        self.share_timeout = self.comms.timeout * (engines + 2) + max(self.comms.timeout,
                                                                      ctx.job.resources.startup_timeout_s)
        self.pending_joins: list[Link] = []  # connected during a step: admitted at its end
        self.step_counts: dict[str, float] = {}  # rollout/engines & co. of the step just gathered
        if self.leader:
            self._listen(ctx)

    def _listen(self, ctx: RunContext) -> None:
        from milehpc.comm.net import host_store, listen_seeded, resolve_address
        from milehpc.rollout.endpoint_auth import job_token
        from milehpc.runtime.elastic.hub import Hub, write_address

        run_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("MILEHPC_RUN_ID") or ctx.run_dir.name
        mode = ctx.partition.get("master_addr") or ("127.0.0.1" if ctx.plan.nodes == 1 and not os.environ.get(
            "SLURM_JOB_ID") else "hostname")
        address = resolve_address(mode)
        timeout = self.comms.timeout
        self.store, store_port = host_store(address, f"{run_id}/elastic-weights", 1, timeout)
        self.address, self.store_port = address, store_port
        fd, port = listen_seeded(address, f"{run_id}/elastic-channel", what="the elastic channel")
        secret = job_token(ctx.run_dir / ".milehpc", name=SECRET_FILE)
        self.hub = Hub(fd, secret, timeout)
        write_address(ctx.run_dir, {"job_id": os.environ.get("SLURM_JOB_ID", ""),
                                    "restart": os.environ.get("SLURM_RESTART_COUNT", "0") or "0",
                                    "address": address, "port": port, "store_port": store_port})
        print(f"milehpc: elastic rollout: trainer rank 0 takes engines at {address}:{port} ({ADDRESS_FILE})",
              flush=True)

    def run(self) -> list[dict[str, float]]:
        try:
            return super().run()
        finally:
            if self.hub is not None:
                self.hub.close()

    # ---- engines joining and leaving ----------------------------------------------------------------------
    def admit(self, link: Link) -> bool:
        """A new engine: its own weight-update group (a fresh name on the trainer's store) and the current weights.
        False (and the engine dropped) when it fails meanwhile."""
        assert self.hub is not None
        self.joins += 1
        name = f"milehpc_elastic_e{link.engine}_j{self.joins}"  # never reused: nothing of an old group mixes in
        try:
            if not self.hub.send(link, ("group", self.address, self.store_port, name, self.group_backend)):
                raise RuntimeFailure("it cannot be written to")
            link.group = ew.trainer_group(self.store, name, self.group_backend, self.comms.timeout,
                                          device=self.comms.device)
            self.hub.add(link)
            if self.latest is not None:
                self._send_weights([link], *self.latest)
        except Exception as err:  # noqa: BLE001 - its failure is its own, not the job's
            self.lose(link, f"joining failed: {err}")
            return False
        if link.alive:
            print(f"milehpc: elastic rollout: {link.name} joined ({len(self.hub.live())} engine(s) live)", flush=True)
        return link.alive

    def lose(self, link: Link, why: str, step: int | None = None, prompts: int = 0) -> None:
        """Drop an engine, naming it (and its node) in one line."""
        assert self.hub is not None
        if not link.alive and link.serial not in self.hub.links:
            return
        self.hub.drop(link)
        if link.group is not None:
            ew.drop_group(link.group)
            link.group = None
        with open(self.run_dir / LOST_FILE, "a") as f:  # the job script starts a spare node's engines
            f.write(f"{link.host}\n")
        where = f"during step {step}: its {prompts} unfinished prompt(s) go to the others" if step is not None else ""
        print(f"milehpc: elastic rollout: lost {link.name}: {why}; {len(self.hub.live())} engine(s) left"
              f"{'; ' + where if where else ''}", flush=True)

    def join_wait_s(self) -> float:
        """How long to wait for an engine when none is live. The first ones, and a spare node's, are starting (a model
        to load, an SGLang or vLLM engine to start: far longer than a collective), so the job's start-up timeout;
        without spare nodes, an engine lost mid-run does not come back: the collective timeout."""
        res = self.job.resources
        return res.startup_timeout_s if self.joins == 0 or res.spare_nodes else self.comms.timeout

    def take_joins(self, *, block: bool) -> None:
        """Admit every engine that connected (``block``: wait for one, up to :meth:`join_wait_s`, when none is
        live)."""
        assert self.hub is not None
        wait_s = self.join_wait_s()
        deadline = time.monotonic() + wait_s
        while True:
            while True:
                ev = self.hub.next_event(0)
                if ev is None:
                    break
                self._handle_outside_step(ev)
            if not block or self.hub.live():
                return
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"no rollout engine joined trainer rank 0 within {wait_s:.0f} s (none is "
                                     f"{'left' if self.joins else 'up: resources.startup_timeout_s'})")
            ev = self.hub.next_event(WAIT_SLICE_S)
            if ev is not None:
                self._handle_outside_step(ev)

    def _handle_outside_step(self, ev: tuple[Any, ...]) -> None:
        if ev[0] == "join":
            self.admit(ev[1])
        elif ev[0] == "lost":
            self.lose(ev[1], ev[2])
        # a message outside a step (a late result of a dropped engine) has no owner: nothing to do

    # ---- one step's prompts ---------------------------------------------------------------------------------
    def collect(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """Rank 0: step ``step``'s groups from the engines that live, and the rollout metrics (with how many
        engines served the step)."""
        groups, stats = self.gather_step(step)
        return groups, {**rollout_metrics(stats), **self.step_counts}

    def gather_step(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """Hand step ``step``'s prompts out to the live engines and collect one group per prompt, giving a lost
        engine's unfinished prompts to the others. Each index is trained once: a result counts only from the
        engine that holds the index now."""
        assert self.hub is not None
        per = self.job.rollout.prompts_per_step
        self.take_joins(block=True)
        owner: dict[int, Link] = {}
        done: dict[int, tuple[Group, dict[str, float], int]] = {}  # index -> (group, counters, engine)
        served: set[int] = set()
        lost = redone = 0
        self.assign(step, list(range(step * per, (step + 1) * per)), owner)
        progress = time.monotonic()  # the last result: live engines that deliver nothing for the timeout are stuck
        while len(done) < per:
            ev = self.hub.next_event(WAIT_SLICE_S)
            self.comms.check()
            if time.monotonic() - progress > self.comms.timeout and self.hub.live():
                owing = sorted({lk.name for i, lk in owner.items() if i not in done})
                raise RuntimeFailure(f"step {step}: no prompt's group arrived within {self.comms.timeout:.0f} s; "
                                     f"waiting for {', '.join(owing) or 'no engine'}")
            if ev is None:
                if not self.hub.live():
                    self.take_joins(block=True)  # every engine is gone: wait for one to (re)join
                    self.assign(step, [i for i in owner if i not in done], owner)
                    progress = time.monotonic()
                continue
            if ev[0] == "join":
                if not self.hub.live():  # nobody left to finish the step: the newcomer does
                    if self.admit(ev[1]):
                        self.assign(step, [i for i in owner if i not in done], owner)
                        progress = time.monotonic()
                else:
                    self.pending_joins.append(ev[1])
                    print(f"milehpc: elastic rollout: {ev[1].name} connected; it joins after step {step}", flush=True)
            elif ev[0] == "lost":
                link = ev[1]
                if link in self.pending_joins:
                    self.pending_joins.remove(link)
                mine = [i for i, lk in owner.items() if lk is link and i not in done]
                if link.alive:
                    lost += 1
                    self.lose(link, ev[2], step, len(mine))
                redone += len(mine)
                if mine and self.hub.live():
                    self.assign(step, mine, owner)
            elif ev[0] == "msg" and ev[2][0] == "result":
                _, b, index, group, stats = ev[2]
                if b == step and owner.get(index) is ev[1] and index not in done:
                    done[index] = (group, stats, ev[1].engine)
                    progress = time.monotonic()
                    served.add(ev[1].engine)
        for link in self.pending_joins:  # connected during the step: they work from the next one
            self.admit(link)
        self.pending_joins = []
        self.step_counts = {"rollout/engines": float(len(served)), "rollout/engines_lost": float(lost),
                            "rollout/prompts_redone": float(redone)}
        # Each engine's counters summed over its prompts, then merged across engines (times: the slowest engine's).
        per_engine: dict[int, dict[str, float]] = {}
        for _, stats, engine in done.values():
            mine = per_engine.setdefault(engine, {})
            for k, v in stats.items():
                mine[k] = mine.get(k, 0.0) + v
        return [done[i][0] for i in sorted(done)], merge_rollout_stats(list(per_engine.values()))

    def assign(self, step: int, indices: list[int], owner: dict[int, Link]) -> None:
        """Deal ``indices`` in contiguous shares to the live engines; an engine that cannot be written to is lost
        and its share dealt again."""
        assert self.hub is not None
        while indices:
            live = self.hub.live()
            if not live:
                return  # gather_step waits for an engine to join
            k, extra = divmod(len(indices), len(live))
            at, failed = 0, []
            for j, link in enumerate(live):
                share = indices[at:at + k + (j < extra)]
                at += len(share)
                if not share:
                    continue
                for i in share:
                    owner[i] = link
                if not self.hub.send(link, ("work", step, share)):
                    self.lose(link, "it cannot be written to", step, len(share))
                    failed += share
            indices = failed

    # ---- weights ----------------------------------------------------------------------------------------------
    def push_weights(self, version: int, tag: int = TAG_NOTICE, *, eval_step: int | None = None) -> float:
        """Every trainer rank: export (a collective export needs them all); rank 0 sends the weights to every live
        engine, each over its own group, and keeps them for engines that join later."""
        t0 = time.perf_counter()
        self.export_s = 0.0
        if self.leader or self.trainer.export_is_collective:
            from milehpc.weights.sync import TimedExport

            export = TimedExport(self.trainer.export_weights())
            if self.leader:
                from milehpc.config.job import sync_bucket_bytes

                self.latest = (version, ew.pack(export, sync_bucket_bytes(self.job)))
                assert self.hub is not None
                self.take_joins(block=False)
                # an engine admitted just now got this version in admit(): not twice
                self._send_weights([ln for ln in self.hub.live() if ln.version != version], version, self.latest[1])
            else:
                export.drain()
            self.export_s = export.seconds
        return time.perf_counter() - t0

    def _send_weights(self, links: list[Link], version: int, buckets: ew.Buckets) -> None:
        """Announce ``version`` to each of ``links``, then broadcast it bucket by bucket to all of them at once; an
        engine that fails it is lost (the others go on)."""
        from milehpc.comm.collectives import collective_device

        assert self.hub is not None
        metas = [meta for meta, _ in buckets]
        going = []
        for link in links:
            if self.hub.send(link, ("weights", version, metas)):
                going.append(link)
            else:
                self.lose(link, "it cannot be written to")
        for k, (_, flat) in enumerate(buckets):
            started = []
            for link in going:
                try:  # NCCL takes the bucket from the trainer's device; gloo the CPU copy itself (kept till done)
                    buf = flat.to(collective_device(link.group))
                    started.append((link, ew.start_broadcast(link.group, buf), buf))
                except RuntimeError as err:
                    self.lose(link, f"weight sync failed: {err}")
            for link, work, _ in started:
                try:
                    ew.wait(work, self.comms.timeout, f"weight sync {version} (bucket {k + 1} of {len(buckets)}) "
                                                      f"to {link.name}")
                except RuntimeFailure as err:
                    self.lose(link, str(err))
            going = [link for link in going if link.alive]
        for link in going:
            link.version = version

    def stop_rollouts(self) -> None:
        if self.hub is not None:
            self.hub.close()
        self.box.flush()
